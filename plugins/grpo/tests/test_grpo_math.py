"""GRPO math on hand-computed cases (slime reference 4.1, 4.2, 4.5)."""

import math
import types

import pytest
import torch

from slime_grpo.algorithm import clipped_surrogate, group_normalize, policy_loss
from slimecore.config import Config, ConfigError
from slimecore.ops.reducers import make_sample_mean_reducer
from slimecore.plugins import installed_entry_points, load_plugins
from slimecore.types import Sample


def test_group_normalisation_uses_unbiased_std_per_group():
    rewards = [1.0, 0.0, 0.0, 0.0, 5.0, 5.0]
    out = group_normalize(rewards, [0, 0, 0, 0, 1, 1], std_normalize=True)
    std = math.sqrt(((0.75**2) + 3 * 0.25**2) / 3)  # unbiased
    assert out[0] == pytest.approx(0.75 / (std + 1e-6))
    assert out[1] == pytest.approx(-0.25 / (std + 1e-6))
    assert out[4:] == [0.0, 0.0]  # all-equal group: no signal, no NaN


def test_single_sample_group_gives_zero_not_nan():
    assert group_normalize([3.0], [7], std_normalize=True) == [0.0]


def test_dr_grpo_only_centres():
    assert group_normalize([1.0, 0.0], [0, 0], std_normalize=False) == [0.5, -0.5]


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


def test_plugin_is_discovered_and_validates_flags():
    assert "grpo" in installed_entry_points()
    hooks = load_plugins(["grpo"])
    hooks.check()
    values = {o.name: o.default for o in hooks.slime_options()["grpo"]}
    with pytest.raises(ConfigError, match="--kl-coef and --kl-loss-coef"):
        hooks.slime_validate_config(config=Config.make(plugins=["grpo"], plugin_values={"grpo": values | {
            "kl_coef": 0.1, "kl_loss_coef": 0.1, "use_kl_loss": True}}))
    with pytest.raises(ConfigError, match="--eps-clip-c must be > 1"):
        hooks.slime_validate_config(config=Config.make(plugin_values={"grpo": values | {"eps_clip_c": 0.5}}))


def test_post_process_rewards_groups_by_group_index():
    hooks = load_plugins(["grpo"])
    values = {o.name: o.default for o in hooks.slime_options()["grpo"]}
    config = Config.make(plugin_values={"grpo": values}, n_samples_per_prompt=2, rollout_batch_size=2)
    samples = [Sample(group_index=g, reward=r) for g, r in [(0, 1.0), (1, 1.0), (0, 0.0), (1, 1.0)]]
    raw, rewards = hooks.slime_post_process_rewards(config=config, samples=samples)
    assert raw == [1.0, 1.0, 0.0, 1.0]
    assert rewards[1] == rewards[3] == 0.0 and rewards[0] == pytest.approx(-rewards[2]) and rewards[0] > 0.7


def test_failed_samples_leave_the_group_statistics():
    # rewards [1, 1, 0.5] plus one FAILED sample (reward 0, not trained): the 0.5 sample's advantage is what the
    # three scored samples alone give, -(1/3) / unbiased std 0.2887 = -1.155 (counting the failure gave -0.261)
    hooks = load_plugins(["grpo"])
    values = {o.name: o.default for o in hooks.slime_options()["grpo"]}
    config = Config.make(plugin_values={"grpo": values}, n_samples_per_prompt=4, rollout_batch_size=1)
    samples = [Sample(group_index=0, reward=r) for r in (1.0, 1.0, 0.5, 0.0)]
    samples[3].status = Sample.Status.FAILED
    _, rewards = hooks.slime_post_process_rewards(config=config, samples=samples)
    assert rewards[2] == pytest.approx(-1.1547, abs=1e-4) and rewards[3] == 0.0
    assert rewards[0] == rewards[1] == pytest.approx(0.5774, abs=1e-4)


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


def test_dapo_overlong_penalty_and_flag_checks():
    from slime_grpo.algorithm import overlong_penalty

    assert [overlong_penalty(n, 16, 4, 1.0) for n in (10, 12, 13, 16)] == [0.0, 0.0, -0.25, -1.0]
    assert overlong_penalty(14, 16, 4, 0.5) == -0.25
    hooks = load_plugins(["grpo"])
    values = {o.name: o.default for o in hooks.slime_options()["grpo"]}
    config = Config.make(plugin_values={"grpo": values | {"overlong_buffer_len": 4, "disable_rewards_normalization": True}},
                         rollout_max_response_len=16, n_samples_per_prompt=2, rollout_batch_size=1)
    samples = [Sample(group_index=0, reward=1.0, response_length=16), Sample(group_index=0, reward=1.0, response_length=8)]
    raw, rewards = hooks.slime_post_process_rewards(config=config, samples=samples)
    assert raw == [1.0, 1.0] and rewards == [0.0, 1.0]  # the logged raw reward keeps the task's score
    for bad, match in (({"overlong_buffer_len": 16}, "smaller than --rollout-max-response-len"),
                       ({"use_tis": True, "use_rollout_logprobs": True}, "mutually exclusive"),
                       ({"tis_clip_low": 3.0}, "--tis-clip-low < --tis-clip")):
        with pytest.raises(ConfigError, match=match):
            hooks.slime_validate_config(config=Config.make(plugins=["grpo"], plugin_values={"grpo": values | bad},
                                                     rollout_max_response_len=16))
