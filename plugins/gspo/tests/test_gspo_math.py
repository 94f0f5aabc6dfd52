"""GSPO on hand-computed cases, through its own hooks (slime's sequence-level ``ppo_kl``)."""

import math

import pytest
import torch

from slimecore.config import Config, ConfigError, parse_config
from slimecore.ops.reducers import make_sample_mean_reducer
from slimecore.plugins import installed_entry_points, load_plugins
from slimecore.types import Sample


def _config(name, **values):
    defaults = {o.name: o.default for o in load_plugins([name]).slime_options()[name]}
    return Config.make(plugins=[name], plugin_values={name: defaults | values}, rollout_batch_size=1,
                       n_samples_per_prompt=2)


def _loss(name, batch, new, config=None):
    """One micro-batch holding every sample of a one-rollout-per-sample step (D_i = mask sum, B = #samples)."""
    masks = batch["loss_masks"]
    reducer = make_sample_mean_reducer(masks, [float(m.sum()) for m in masks], len(masks))
    return load_plugins([name]).slime_loss(config=config or _config(name), role="actor", batch=batch,
                                           outputs={"log_probs": new, "entropy": []}, reducer=reducer)


def _two_samples():
    old = [torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0])]
    new = [torch.tensor([-0.6, -2.0, -3.0], requires_grad=True), torch.tensor([-1.3, -1.1], requires_grad=True)]
    batch = {"log_probs": old, "advantages": [torch.ones(3), torch.full((2,), -1.0)],
             "loss_masks": [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0])]}
    return batch, new


def test_sequence_ratio_hand_case_with_masks():
    batch, new = _two_samples()
    loss, metrics = _loss("gspo", batch, new)
    # sample 0: old - new = [-0.4, 0, 2.5], mask [1, 1, 0] -> s0 = -0.4 / 2 = -0.2, ratio e^0.2 = 1.2214 > 1.2,
    #   A = +1 -> clipped: -1.2 per token, clipfrac 1
    # sample 1: old - new = [0.3, 0.1], mask [0, 1] -> s1 = 0.1, ratio e^-0.1 = 0.9048 inside [0.8, 1.2],
    #   A = -1 -> 0.9048 per token, clipfrac 0
    r1 = math.exp(-0.1)
    assert loss.item() == pytest.approx((-1.2 + r1) / 2)
    assert metrics["ppo_kl"].item() == pytest.approx((-0.2 + 0.1) / 2)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    # clipped sample 0: no gradient; sample 1: d(ratio)/d logp_t = ratio * m_t / sum(m), times 1/B
    assert new[0].grad.tolist() == [0.0, 0.0, 0.0]
    assert new[1].grad.tolist() == pytest.approx([0.0, r1 / 2])


def test_options_are_read_from_the_gspo_namespace():
    batch, new = _two_samples()
    loss, metrics = _loss("gspo", batch, new, _config("gspo", eps_clip=0.25))
    assert loss.item() == pytest.approx((-math.exp(0.2) + math.exp(-0.1)) / 2)  # 1.2214 < 1.25: not clipped
    assert metrics["pg_clipfrac"].item() == 0.0


def test_equals_grpo_when_each_sample_has_one_token():
    def case():
        old = [torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-0.3])]
        new = [torch.tensor([v], requires_grad=True) for v in (-0.5, -2.4, -0.3)]
        batch = {"log_probs": old, "advantages": [torch.tensor([1.0]), torch.tensor([-0.5]), torch.tensor([2.0])],
                 "loss_masks": [torch.ones(1)] * 3}
        return batch, new

    (gspo_batch, gspo_new), (grpo_batch, grpo_new) = case(), case()
    gspo_loss, gspo_metrics = _loss("gspo", gspo_batch, gspo_new)
    grpo_loss, grpo_metrics = _loss("grpo", grpo_batch, grpo_new)
    assert gspo_loss.item() == pytest.approx(grpo_loss.item())
    grpo_values = {k: v.item() for k, v in grpo_metrics.items()}
    assert {k: v.item() for k, v in gspo_metrics.items()} == pytest.approx(grpo_values)
    gspo_loss.backward()
    grpo_loss.backward()
    for a, b in zip(gspo_new, grpo_new):
        assert a.grad.tolist() == pytest.approx(b.grad.tolist())


def test_on_policy_ppo_kl_is_zero():
    new = [torch.tensor([-1.0, -3.0, -0.2], requires_grad=True), torch.tensor([-0.7], requires_grad=True)]
    batch = {"advantages": [torch.ones(3), torch.tensor([-1.0])],  # no "log_probs": old = detached current
             "loss_masks": [torch.tensor([1.0, 1.0, 0.0]), torch.ones(1)]}
    loss, metrics = _loss("gspo", batch, new)
    assert metrics["ppo_kl"].item() == 0.0 and metrics["pg_clipfrac"].item() == 0.0
    assert loss.item() == pytest.approx((-1.0 + 1.0) / 2)
    loss.backward()
    # -A m_t / sum(m) / B: GRPO's on-policy gradient, masked tokens excluded
    assert new[0].grad.tolist() == pytest.approx([-0.25, -0.25, 0.0])
    assert new[1].grad.tolist() == pytest.approx([0.5])


def test_discovered_and_stands_alone():
    assert "gspo" in installed_entry_points()
    hooks = load_plugins(["gspo"])
    hooks.check()
    grpo_options = load_plugins(["grpo"]).slime_options()["grpo"]  # the loss options, without the estimator choice
    assert hooks.slime_options()["gspo"] == [o for o in grpo_options if o.name != "advantage_estimator"]
    for hook in ("slime_loss", "slime_compute_advantages", "slime_post_process_rewards"):
        assert hooks.plugin_name(hooks.answerer(hook)) == "gspo"
    declared = hooks.slime_options()
    config = parse_config(["--prompt-data", "x.jsonl", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
                           "--eps-clip", "0.1", "--use-kl-loss", "--disable-rewards-normalization"], ["gspo"], declared)
    assert config.plugin("gspo").eps_clip == 0.1
    assert "ref_log_probs" in hooks.slime_train_inputs(config=config, role="actor")
    samples = [Sample(group_index=0, reward=r) for r in (1.0, 0.0)]
    raw, rewards = hooks.slime_post_process_rewards(config=config, samples=samples)
    assert raw == rewards == [1.0, 0.0]
    batch = {"rewards": [0.5], "response_lengths": [2], "loss_masks": [torch.ones(2)]}
    out = hooks.slime_compute_advantages(config=config, role="actor", batch=batch)
    assert out["advantages"][0].tolist() == out["returns"][0].tolist() == [0.5, 0.5]
    with pytest.raises(ConfigError, match="--eps-clip-c must be > 1"):
        hooks.slime_validate_config(config=_config("gspo", eps_clip_c=0.5))
