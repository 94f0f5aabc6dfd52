"""PPO-family estimators on hand-computed cases (slime's ``compute_advantages_and_returns`` and
``value_loss_function``)."""

import pytest
import torch

from slime_ppo.algorithm import gae, reinforce_plus_plus_baseline, reinforce_plus_plus_returns, value_loss
from slimecore.config import Config, ConfigError
from slimecore.plugins import PluginError, installed_entry_points, load_plugins
from slimecore.trainers.roles import Feed, declared_roles


def test_gae_gamma_lambda_one_gives_reward_minus_value():
    values = torch.tensor([0.5, 0.25])
    adv, ret = gae(1.0, values, torch.zeros(2), kl_coef=0.0, gamma=1.0, lambd=1.0)
    # delta_1 = 1 + 0 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = -0.25 + 0.75 = 0.5
    assert adv.tolist() == pytest.approx([0.5, 0.75])
    assert ret.tolist() == pytest.approx([1.0, 1.0])  # returns = A + V = r for every token


def test_gae_with_kl_gamma_and_lambda():
    values, kl = torch.tensor([0.5, 0.25, 1.0]), torch.tensor([0.1, 0.2, 0.4])
    adv, ret = gae(2.0, values, kl, kl_coef=0.5, gamma=0.5, lambd=0.5)
    rho = [-0.05, -0.1, -0.2 + 2.0]  # -kl_coef * kl, reward on the last response token
    d2 = rho[2] + 0.0 - 1.0  # V_3 = 0
    d1 = rho[1] + 0.5 * 1.0 - 0.25
    d0 = rho[0] + 0.5 * 0.25 - 0.5
    a2, a1 = d2, d1 + 0.25 * d2
    a0 = d0 + 0.25 * a1
    assert adv.tolist() == pytest.approx([a0, a1, a2])
    assert ret.tolist() == pytest.approx([a0 + 0.5, a1 + 0.25, a2 + 1.0])


def test_gae_lambda_zero_is_one_step_td():
    values = torch.tensor([0.5, 0.25])
    adv, _ = gae(1.0, values, torch.zeros(2), kl_coef=0.0, gamma=0.9, lambd=0.0)
    assert adv.tolist() == pytest.approx([0.9 * 0.25 - 0.5, 1.0 - 0.25])


def test_reinforce_plus_plus_rewards_the_last_masked_token_and_masks_kl():
    mask = torch.tensor([1.0, 1.0, 0.0])
    g = reinforce_plus_plus_returns(2.0, torch.tensor([0.1, 0.1, 5.0]), mask, kl_coef=1.0, gamma=0.5)
    # rho = [-0.1, -0.1 + 2, 0] (the masked token's KL is dropped); G_t = rho_t + 0.5 G_{t+1}
    assert g.tolist() == pytest.approx([-0.1 + 0.5 * 1.9, 1.9, 0.0])


def test_reinforce_plus_plus_with_a_masked_middle_token_and_gamma_one():
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0])  # e.g. a tool observation in the middle, padding at the end
    g = reinforce_plus_plus_returns(1.0, torch.full((4,), 0.5), mask, kl_coef=0.2, gamma=1.0)
    assert g.tolist() == pytest.approx([-0.1 + 0.9, 0.9, 0.9, 0.0])


def test_reinforce_plus_plus_without_trainable_tokens_has_no_reward():
    g = reinforce_plus_plus_returns(1.0, torch.zeros(2), torch.zeros(2), kl_coef=0.0, gamma=1.0)
    assert g.tolist() == [0.0, 0.0]


def test_reinforce_plus_plus_baseline():
    assert reinforce_plus_plus_baseline(0.5, torch.tensor([0.1, 0.2]), 1.0).tolist() == pytest.approx([0.4, 0.3])


def test_clipped_value_loss_has_no_half_factor():
    values, old, returns = torch.tensor([1.0, 0.1, -0.5]), torch.zeros(3), torch.tensor([0.0, 1.0, -1.0])
    loss, clipfrac = value_loss(values, old, returns, clip=0.2)
    # token 0: clipped 0.2 -> max(0.04, 1.0); token 1: inside the clip -> 0.81;
    # token 2: clipped -0.2 -> max(0.64, 0.25) = 0.64 (the clipped term wins)
    assert loss.tolist() == pytest.approx([1.0, 0.81, 0.64])
    assert clipfrac.tolist() == [1.0, 0.0, 1.0]


def _config(**values):
    defaults = {o.name: o.default for o in load_plugins(["ppo"]).slime_options()["ppo"]}
    return Config.make(plugins=["ppo"], plugin_values={"ppo": defaults | values}, rollout_batch_size=2,
                       global_batch_size=2)


def test_discovered_options_and_validation():
    assert "ppo" in installed_entry_points()
    hooks = load_plugins(["ppo"])
    defaults = {o.name: o.default for o in hooks.slime_options()["ppo"]}
    assert {k: defaults[k] for k in ("advantage_estimator", "gamma", "lambd", "value_clip", "kl_coef",
                                     "normalize_advantages", "eps_clip")} == {
        "advantage_estimator": "ppo", "gamma": 1.0, "lambd": 1.0, "value_clip": 0.2, "kl_coef": 0.0,
        "normalize_advantages": False, "eps_clip": 0.2}
    for estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        with pytest.raises(ConfigError, match="--normalize-advantages"):
            hooks.slime_validate_config(config=_config(advantage_estimator=estimator))
        hooks.slime_validate_config(config=_config(advantage_estimator=estimator, normalize_advantages=True))
    hooks.slime_validate_config(config=_config())
    hooks.slime_validate_config(config=_config(kl_coef=0.1))  # KL in reward is what the PPO family uses
    with pytest.raises(ConfigError, match="--kl-coef and --kl-loss-coef are mutually exclusive"):
        hooks.slime_validate_config(config=_config(kl_coef=0.1, use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ConfigError, match="--value-clip"):
        hooks.slime_validate_config(config=_config(value_clip=0.0))


def test_critic_only_steps_need_the_ppo_estimator():
    defaults = {o.name: o.default for o in load_plugins(["ppo"]).slime_options()["ppo"]}
    config = Config.make(plugins=["ppo"], plugin_values={"ppo": defaults | {
        "advantage_estimator": "reinforce_plus_plus", "normalize_advantages": True, "num_critic_only_steps": 2}})
    with pytest.raises(ConfigError, match="--num-critic-only-steps 2 needs a critic"):
        load_plugins(["ppo"]).slime_validate_config(config=config)


def test_alone_it_is_a_complete_algorithm_and_asks_for_a_critic_only_with_gae():
    hooks = load_plugins(["ppo"])
    hooks.check()  # advantages, loss and rewards are all answered
    roles = declared_roles(_config(num_critic_only_steps=2, critic_lr=0.5), hooks)
    assert [(r.name, r.model) for r in roles] == [("actor", "policy"), ("critic", "value")]
    actor, critic = roles  # the critic scores the batch for the actor, then trains on the actor's returns
    assert actor.feeds == (Feed("critic", "scores"),) and critic.feeds == (Feed("actor", "outputs"),)
    assert not actor.updates(1) and actor.updates(2) and critic.updates(0)
    assert critic.configure(_config()).lr == 0.5  # --critic-lr
    assert declared_roles(_config(), hooks)[1].configure(_config()).lr == _config().lr  # default: --lr
    assert [r.name for r in declared_roles(_config(advantage_estimator="reinforce_plus_plus"), hooks)] == ["actor"]
    assert "values" in hooks.slime_train_inputs(config=_config(), role="actor")
    assert not hooks.slime_train_inputs(config=_config(), role="critic")
    inputs = hooks.slime_train_inputs(config=_config(kl_coef=0.1), role="actor")
    assert {"log_probs", "ref_log_probs"} <= set(inputs)
