"""PPO plugin: options and their validation. The advantage and loss hooks are not registered yet: PPO
needs a critic role that the core does not place yet, and a half-wired algorithm would train wrongly.
The estimators themselves are in ``slime_ppo.algorithm`` and tested."""

from slimecore import hookimpl
from slimecore.config import ConfigError, Option

NAME = "ppo"


@hookimpl
def slime_options():
    return [
        Option("advantage_estimator", str, "ppo", "Estimator.", choices=("ppo", "reinforce_plus_plus",
                                                                        "reinforce_plus_plus_baseline")),
        Option("gamma", float, 1.0, "Discount."),
        Option("lambd", float, 1.0, "GAE lambda."),
        Option("value_clip", float, 0.2, "Value-loss clip range."),
        Option("num_critic_only_steps", int, 0, "Critic warm-up steps before the actor trains."),
        Option("kl_coef", float, 0.0, "KL-in-reward coefficient."),
        Option("normalize_advantages", bool, False, "Whiten advantages over the step's tokens."),
    ]


@hookimpl
def slime_validate_config(config):
    o = config.plugin(NAME)
    if o.advantage_estimator.startswith("reinforce_plus_plus") and not o.normalize_advantages:
        raise ConfigError(f"--advantage-estimator {o.advantage_estimator} needs --normalize-advantages "
                          "(as in slime)")
