import types

import pytest
import torch

from slime_grpo.algorithm import policy_loss, sequence_level
from slimecore.ops.reducers import make_sample_mean_reducer
from slimecore.plugins import installed_entry_points, load_plugins


def _opts():
    return types.SimpleNamespace(eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, use_kl_loss=False,
                                 kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, use_rollout_logprobs=False)


def test_sequence_ratio_is_the_masked_mean_log_ratio():
    new = torch.tensor([-1.0, -2.0, -9.0])
    old = torch.tensor([-1.5, -1.5, -1.0])
    mask = torch.tensor([1.0, 1.0, 0.0])  # the masked token does not count
    s = ((old - new) * mask).sum() / 2  # (-0.5 + 0.5) / 2 = 0
    assert (old - sequence_level(new, old, mask)).tolist() == pytest.approx([s.item()] * 3)


def test_gspo_loss_hand_case_and_equals_grpo_for_one_token_samples():
    new = [torch.log(torch.tensor([1.5, 1.5])), torch.log(torch.tensor([0.9]))]
    old = [torch.zeros(2), torch.zeros(1)]
    batch = {"log_probs": old, "advantages": [torch.ones(2), torch.tensor([-1.0])],
             "loss_masks": [torch.ones(2), torch.ones(1)]}
    reducer = make_sample_mean_reducer(batch["loss_masks"], [2.0, 1.0], 2)
    loss, m = policy_loss(_opts(), batch, {"log_probs": new, "entropy": []}, reducer, sequence_ratio=True)
    # sample 0: ratio exp(log 1.5) = 1.5 > 1.2 with A = 1 -> -1.2 per token; sample 1: 0.9 with A=-1 -> 0.9
    assert loss.item() == pytest.approx((-1.2 + 0.9) / 2)
    single = [n[:1] for n in new]
    b1 = {**batch, "log_probs": [o[:1] for o in old], "advantages": [a[:1] for a in batch["advantages"]],
          "loss_masks": [torch.ones(1), torch.ones(1)]}
    r1 = make_sample_mean_reducer(b1["loss_masks"], [1.0, 1.0], 2)
    gspo, _ = policy_loss(_opts(), b1, {"log_probs": single, "entropy": []}, r1, sequence_ratio=True)
    grpo, _ = policy_loss(_opts(), b1, {"log_probs": single, "entropy": []}, r1)
    assert gspo.item() == pytest.approx(grpo.item())


def test_on_policy_ratio_is_one():
    lp = [torch.tensor([-1.0, -3.0], requires_grad=True)]
    batch = {"advantages": [torch.ones(2)], "loss_masks": [torch.ones(2)]}
    _, m = policy_loss(_opts(), batch, {"log_probs": lp, "entropy": []},
                       make_sample_mean_reducer(batch["loss_masks"], [2.0], 1), sequence_ratio=True)
    assert m["ppo_kl"].item() == 0.0 and m["pg_clipfrac"].item() == 0.0


def test_gspo_is_discovered_and_stands_alone():
    assert "gspo" in installed_entry_points()
    hooks = load_plugins(["gspo"])
    hooks.check()
    assert {o.name for o in hooks.declared_options()["gspo"]} >= {"eps_clip", "use_kl_loss"}
    assert hooks.plugin_name(hooks.answerer("slime_loss")) == "gspo"
