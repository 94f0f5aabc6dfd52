"""GRPO math on hand-computed cases: group reward normalisation, the DAPO overlong penalty, flag checks."""

import math

import pytest

from slime_grpo.algorithm import group_normalize
from slimecore.config import Config, ConfigError
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
