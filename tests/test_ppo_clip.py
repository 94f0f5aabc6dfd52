"""The PPO-clip policy loss (``slimecore.ops.policy_loss``) on hand-computed cases, against slime's formulas:
``L = max(-ratio A, -clip(ratio, 1 - eps, 1 + eps_high) A)``, dual clip ``min(L, -c A)`` where ``A < 0``, TIS / ICEPOP
weights ``clamp(exp(logp_old - logp_rollout), low, high)``, and a zero KL and clip fraction on the first step."""

import math
import types

import pytest
import torch

from slimecore.ops import clipped_surrogate, policy_loss
from slimecore.ops.reducers import make_sample_mean_reducer


def test_clipped_surrogate_hand_case():
    new = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, clipfrac, ppo_kl = clipped_surrogate(new, old, adv, 0.2, 0.2)
    # ratio 1.5 > 1.2 with A>0 -> clipped at 1.2; ratio 0.5 < 0.8 with A<0 -> -0.8*-1=0.8 vs 0.5 -> max 0.8
    assert loss.tolist() == pytest.approx([-1.2, 0.8, -2.0])
    assert clipfrac.tolist() == [1.0, 1.0, 0.0]
    assert ppo_kl.tolist() == pytest.approx((-new).tolist())


def test_dual_clip_bounds_negative_advantages():
    new, old, adv = torch.log(torch.tensor([5.0])), torch.zeros(1), torch.tensor([-1.0])
    loss, _, _ = clipped_surrogate(new, old, adv, 0.2, 0.2, eps_c=3.0)
    assert loss.item() == pytest.approx(3.0)  # -ratio*A = 5 is capped at c*|A| = 3


def _opts(**kw):
    base = dict(eps_clip=0.2, eps_clip_high=None, eps_clip_c=None, use_kl_loss=False, kl_loss_coef=0.0,
                kl_loss_type="k1", kl_coef=0.0, entropy_coef=0.0, use_rollout_logprobs=False, use_tis=False,
                get_mismatch_metrics=False, tis_mode="tis", tis_clip=2.0, tis_clip_low=0.0)
    return types.SimpleNamespace(**(base | kw))


def test_on_policy_first_step_has_zero_kl_and_clipfrac_and_zero_kl_loss():
    lp = [torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-0.5], requires_grad=True)]
    masks = [torch.ones(2), torch.ones(1)]
    batch = {"log_probs": [x.detach() for x in lp], "ref_log_probs": [x.detach() for x in lp],
             "advantages": [torch.tensor([1.0, 1.0]), torch.tensor([-1.0])]}
    reducer = make_sample_mean_reducer(masks, [2.0, 1.0], 2)
    loss, m = policy_loss(_opts(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k3"), batch,
                          {"log_probs": lp, "entropy": []}, reducer)
    assert m["ppo_kl"].item() == 0.0 and m["pg_clipfrac"].item() == 0.0 and m["kl_loss"].item() == 0.0
    # pg loss = mean over samples of -A: (-1 + 1) / 2 = 0; gradient = -A / D / B per token
    loss.backward()
    assert lp[0].grad.tolist() == pytest.approx([-0.25, -0.25]) and lp[1].grad.tolist() == pytest.approx([0.5])


def _tis_case(**kw):
    """Two tokens at the old policy (ratio 1, A = 1) whose rollout log-probs differ: rho = exp(old - roll)."""
    old = torch.tensor([-1.0, -1.0])
    lp = [old.clone().requires_grad_(True)]
    roll = torch.tensor([-1.0 - math.log(3.0), -1.0 + math.log(2.0)])  # rho = [3, 0.5]
    batch = {"log_probs": [old], "rollout_log_probs": [roll], "advantages": [torch.ones(2)]}
    reducer = make_sample_mean_reducer([torch.ones(2)], [2.0], 1)
    loss, m = policy_loss(_opts(**kw), batch, {"log_probs": lp, "entropy": []}, reducer)
    loss.backward()
    return loss, m, lp[0].grad


def test_vanilla_tis_clamps_the_ratio_and_weights_the_token_loss():
    loss, m, grad = _tis_case(use_tis=True, tis_mode="tis", tis_clip=2.0, tis_clip_low=0.0)
    # w = clamp([3, 0.5], 0, 2) = [2, 0.5]; L_t = -ratio * A = -1 -> loss = mean(-w) = -1.25
    assert loss.item() == pytest.approx(-1.25)
    assert grad.tolist() == pytest.approx([-1.0, -0.25])  # d(-w r)/d logp / 2 tokens
    assert m["tis"].item() == pytest.approx(1.25) and m["tis_clipfrac"].item() == pytest.approx(0.5)
    assert m["tis_abs"].item() == pytest.approx((2.0 + 0.5) / 2) and m["ois"].item() == pytest.approx(1.0)


def test_icepop_zeroes_tokens_outside_the_band():
    loss, m, grad = _tis_case(use_tis=True, tis_mode="icepop", tis_clip=2.0, tis_clip_low=0.6)
    # rho = [3, 0.5]: both outside [0.6, 2] -> both weights 0
    assert loss.item() == 0.0 and grad.tolist() == [0.0, 0.0] and m["tis_clipfrac"].item() == 1.0
    loss, m, grad = _tis_case(use_tis=True, tis_mode="icepop", tis_clip=4.0, tis_clip_low=0.4)
    assert loss.item() == pytest.approx(-(3.0 + 0.5) / 2) and m["tis_clipfrac"].item() == 0.0


def test_mismatch_metrics_alone_do_not_change_the_loss():
    loss, m, _ = _tis_case(get_mismatch_metrics=True)
    assert loss.item() == pytest.approx(-1.0) and m["tis"].item() == pytest.approx(1.25)
