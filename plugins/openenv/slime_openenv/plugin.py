"""OpenEnv environments for slime-core: the environment server's ``reset`` / ``step`` drive each episode, the
policy plays it through an agent session (exact tokens), the steps' rewards score it.

Hooks:
- ``slime_options``: ``--openenv-app`` (the server's ASGI app as ``MODULE:ATTRIBUTE``, started as a uvicorn process
  on 127.0.0.1; default the shipped example ``slime_openenv.guess.server:app``) or ``--openenv-url`` (a server
  already running: a container, a Space), ``--openenv-episodes``, ``--openenv-reset-args``,
  ``--openenv-action-field``, ``--openenv-observation-field``, ``--openenv-max-turns``,
  ``--openenv-system-prompt``, ``--openenv-reward``.
- ``slime_validate_config``: the app is imported (or the URL's ``/schema`` read) and the text fields checked
  against the action and observation schemas, before Ray starts.
- ``slime_data_source``: one prompt group per reset seed ``0 .. N-1``, so a group's samples play one game.
- ``slime_agent``: reset with the sample's seed, then reply / step until the environment says done or the turn
  limit; the steps' rewards (summed, or the last) are the sample's. An environment that errors, or a server that
  dies, raises: the sample is FAILED and not trained.
- ``slime_log_rollout``: ``openenv/steps`` and ``openenv/done`` (episodes the environment ended) per step.
- ``slime_shutdown``: stops the server process this plugin started.
- ``slime_quickstart_options``: a short run of the example on the default model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics

from slimecore import hookimpl
from slimecore.config import ConfigError, Option, json_value
from slimecore.data.source import PromptDataSource

from slime_openenv.environment import EnvironmentSpec, OpenEnvEnvironment, OpenEnvSetupError

log = logging.getLogger("slime_openenv")
NAME = "openenv"
EXAMPLE_APP = "slime_openenv.guess.server:app"
METADATA_KEY = "openenv"  # sample.metadata[METADATA_KEY] = {"seed", then the episode's rewards, steps, done}
_ENVIRONMENTS: dict[str, OpenEnvEnvironment] = {}  # by the spec's JSON


@hookimpl
def slime_options():
    return [
        Option("openenv_app", str, None, "OpenEnv server app as MODULE:ATTRIBUTE (what uvicorn runs), started on "
               f"127.0.0.1 for the run (default: the example {EXAMPLE_APP})."),
        Option("openenv_url", str, None, "URL of an OpenEnv server already running (a container, a Space), "
               "instead of --openenv-app."),
        Option("openenv_episodes", int, 64, "Episodes per epoch: reset seeds 0..N-1, one prompt group each."),
        Option("openenv_reset_args", json_value, None, "Extra reset() arguments as JSON: {\"task\": \"easy\"}."),
        Option("openenv_action_field", str, None, "Action field the model's reply fills (default: the action's "
               "only string field)."),
        Option("openenv_observation_field", str, None, "Observation field shown to the model (default: its only "
               "string field, else all fields as JSON)."),
        Option("openenv_max_turns", int, 8, "Replies (steps) one episode may make."),
        Option("openenv_system_prompt", str, None, "System message before the first observation."),
        Option("openenv_reward", str, "sum", "The sample's reward from the steps' rewards: sum or last.",
               choices=("sum", "last")),
    ]


QUICKSTART = {"rollout_batch_size": 8, "n_samples_per_prompt": 8, "num_rollout": 16, "rollout_max_response_len": 8,
              "lr": 1e-5}


@hookimpl
def slime_quickstart_options():
    return QUICKSTART


def spec(config) -> EnvironmentSpec:
    opts = config.plugin(NAME)
    app = opts.openenv_app if opts.openenv_app is not None or opts.openenv_url is not None else EXAMPLE_APP
    return EnvironmentSpec(app, opts.openenv_url, opts.openenv_action_field, opts.openenv_observation_field,
                           dict(opts.openenv_reset_args or {}))


def environment(config) -> OpenEnvEnvironment:
    """This process's environment for ``config`` (checked once; its server starts on the first episode)."""
    wanted = spec(config)
    key = json.dumps(dataclasses.asdict(wanted), sort_keys=True)
    if key not in _ENVIRONMENTS:
        _ENVIRONMENTS[key] = OpenEnvEnvironment(wanted)
    return _ENVIRONMENTS[key]


@hookimpl
def slime_validate_config(config):
    opts = config.plugin(NAME)
    if config.prompt_data is not None:
        raise ConfigError("plugin openenv takes its episodes from the environment (reset seeds); drop --prompt-data")
    if opts.openenv_app is not None and opts.openenv_url is not None:
        raise ConfigError("plugin openenv: give --openenv-app (a server to start) or --openenv-url (a running one), "
                          "not both")
    if opts.openenv_reset_args is not None and not isinstance(opts.openenv_reset_args, dict):
        raise ConfigError(f"--openenv-reset-args must be a JSON object of reset() arguments, "
                          f"got {opts.openenv_reset_args!r}")
    if "seed" in (opts.openenv_reset_args or {}):
        raise ConfigError("--openenv-reset-args must not set 'seed': each prompt group resets with its own")
    for flag, value in (("--openenv-episodes", opts.openenv_episodes), ("--openenv-max-turns", opts.openenv_max_turns)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value} (plugin openenv)")
    try:
        environment(config)
    except OpenEnvSetupError as exc:
        raise ConfigError(f"plugin openenv: {exc}") from None


@hookimpl
def slime_data_source(config, tokenizer, buffer_filter):
    opts = config.plugin(NAME)
    env = environment(config)
    records = []
    for seed in range(opts.openenv_episodes):
        prompt = f"OpenEnv {env.name} reset(seed={seed})"  # the opening observation replaces it once played
        records.append({"prompt": prompt, "tokens": tokenizer(prompt, add_special_tokens=False).input_ids,
                        "label": None, "metadata": {METADATA_KEY: {"seed": seed}}})
    log.info("openenv: %s, %d episodes per epoch, action field %r", env.name, len(records), env.action_field)
    return PromptDataSource(records, config.n_samples_per_prompt, shuffle=config.rollout_shuffle,
                            seed=config.rollout_seed, buffer_filter=buffer_filter)


@hookimpl
async def slime_agent(config, sample, session):
    opts = config.plugin(NAME)
    env = environment(config)
    meta = sample.metadata[METADATA_KEY]
    sampling = {"max_tokens": config.rollout_max_response_len, "temperature": config.rollout_temperature}
    episode = await env.play(session, meta["seed"], sampling, opts.openenv_max_turns, opts.openenv_system_prompt)
    sample.prompt = episode.opening
    reward = episode.reward(opts.openenv_reward)
    meta.update(rewards=episode.rewards, steps=len(episode.rewards), done=episode.done, reward=reward,
                last_observation=episode.last_observation)
    return reward


@hookimpl
def slime_log_rollout(config, samples, metrics):
    played = [s.metadata[METADATA_KEY] for s in samples if "steps" in (s.metadata.get(METADATA_KEY) or {})]
    if played:
        metrics["openenv/steps"] = statistics.fmean(m["steps"] for m in played)
        metrics["openenv/done"] = statistics.fmean(float(m["done"]) for m in played)


@hookimpl
def slime_shutdown(config, process):
    for env in _ENVIRONMENTS.values():
        env.stop()
