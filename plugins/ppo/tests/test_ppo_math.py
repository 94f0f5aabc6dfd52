import pytest
import torch

from slime_ppo.algorithm import gae, reinforce_plus_plus_baseline, reinforce_plus_plus_returns, value_loss
from slimecore.config import Config, ConfigError
from slimecore.plugins import installed_entry_points, load_plugins


def test_gae_hand_case():
    values = torch.tensor([0.5, 0.25])
    adv, ret = gae(1.0, values, torch.zeros(2), kl_coef=0.0, gamma=1.0, lambd=1.0)
    # delta_1 = 1 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = -0.25 + 0.75 = 0.5
    assert adv.tolist() == pytest.approx([0.5, 0.75]) and ret.tolist() == pytest.approx([1.0, 1.0])
    adv, _ = gae(1.0, values, torch.tensor([0.1, 0.2]), kl_coef=1.0, gamma=0.5, lambd=0.5)
    d1 = (1.0 - 0.2) - 0.25
    d0 = -0.1 + 0.5 * 0.25 - 0.5
    assert adv.tolist() == pytest.approx([d0 + 0.25 * d1, d1])


def test_reinforce_plus_plus_rewards_the_last_trainable_token():
    mask = torch.tensor([1.0, 1.0, 0.0])
    g = reinforce_plus_plus_returns(2.0, torch.tensor([0.1, 0.1, 5.0]), mask, kl_coef=1.0, gamma=0.5)
    assert g.tolist() == pytest.approx([-0.1 + 0.5 * 1.9, 1.9, 0.0])
    assert reinforce_plus_plus_baseline(0.5, torch.tensor([0.1, 0.2]), 1.0).tolist() == pytest.approx([0.4, 0.3])


def test_clipped_value_loss_has_no_half_factor():
    loss, clipfrac = value_loss(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.0]), clip=0.2)
    assert loss.item() == pytest.approx(1.0) and clipfrac.item() == 1.0


def test_discovered_and_validated():
    assert "ppo" in installed_entry_points()
    hooks = load_plugins(["ppo"])
    values = {o.name: o.default for o in hooks.declared_options()["ppo"]}
    with pytest.raises(ConfigError, match="--normalize-advantages"):
        hooks.validate_config(config=Config.make(plugin_values={"ppo": values | {
            "advantage_estimator": "reinforce_plus_plus"}}))
