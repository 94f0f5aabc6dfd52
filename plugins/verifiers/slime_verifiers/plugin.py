"""Verifiers environments for slime-core: the taskset gives the prompts, its harness plays each one against the
policy through an agent session (exact tokens), its rewards score the episode.

Hooks:
- ``slime_options``: ``--vf-env`` (a taskset package id, as ``vf-eval`` takes it; default the shipped example
  ``slime_vf_compare``), ``--vf-env-args`` (its ``TasksetConfig`` fields as JSON), ``--vf-harness`` (default
  ``null``: verifiers' chat loop, with the taskset's MCP tools), ``--vf-num-tasks``, ``--vf-max-turns``.
- ``slime_validate_config``: the environment is loaded (taskset imported, tasks built) before Ray starts.
- ``slime_data_source``: one prompt group per task, epoch after epoch (``PromptDataSource``); each sample names
  its task in ``metadata["verifiers"]``.
- ``slime_agent``: one verifiers rollout of the sample's task (``environment.VerifiersEnvironment.play``); the
  trace's reward (the sum of its ``@vf.reward`` values) is the sample's. A rollout that ends with an error (the
  harness, a tool, a reward function) raises, so its samples are FAILED and not trained.
- ``slime_log_rollout``: ``verifiers/reward/<name>`` and ``verifiers/metric/<name>`` per step.
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

from slime_verifiers.environment import EnvironmentSpec, VerifiersEnvironment, VerifiersSetupError

log = logging.getLogger("slime_verifiers")
NAME = "verifiers"
METADATA_KEY = "verifiers"  # sample.metadata[METADATA_KEY] = {"task": index, "key", then the episode's scores}
_ENVIRONMENTS: dict[str, VerifiersEnvironment] = {}  # by the spec's JSON


class VerifiersEpisodeError(RuntimeError):
    """A verifiers rollout ended with an error recorded on its trace."""


@hookimpl
def slime_options():
    return [
        Option("vf_env", str, "slime_vf_compare", "Verifiers taskset id: an installed package exporting its "
               "vf.Taskset (as vf-eval takes it)."),
        Option("vf_env_args", json_value, None, "The taskset's TasksetConfig fields, as JSON: {\"num_tasks\": 32}."),
        Option("vf_harness", str, "null", "Verifiers harness that plays each task (null: verifiers' chat loop with "
               "the taskset's tools; bash adds a shell)."),
        Option("vf_num_tasks", int, None, "Train on the first N tasks (needed for an infinite taskset)."),
        Option("vf_max_turns", int, None, "Model calls one episode may make (verifiers' max_turns)."),
    ]


QUICKSTART = {"rollout_batch_size": 8, "n_samples_per_prompt": 8, "num_rollout": 16, "rollout_max_response_len": 32,
              "lr": 1e-5}


@hookimpl
def slime_quickstart_options():
    return QUICKSTART


def spec(config) -> EnvironmentSpec:
    opts = config.plugin(NAME)
    return EnvironmentSpec(opts.vf_env, dict(opts.vf_env_args or {}), opts.vf_harness, opts.vf_num_tasks,
                           opts.vf_max_turns)


def environment(config) -> VerifiersEnvironment:
    """This process's environment for ``config`` (loaded once)."""
    wanted = spec(config)
    key = json.dumps(dataclasses.asdict(wanted), sort_keys=True)
    if key not in _ENVIRONMENTS:
        _ENVIRONMENTS[key] = VerifiersEnvironment(wanted)
    return _ENVIRONMENTS[key]


@hookimpl
def slime_validate_config(config):
    opts = config.plugin(NAME)
    if config.prompt_data is not None:
        raise ConfigError("plugin verifiers takes its prompts from the taskset --vf-env; drop --prompt-data")
    if opts.vf_env_args is not None and not isinstance(opts.vf_env_args, dict):
        raise ConfigError(f"--vf-env-args must be a JSON object of TasksetConfig fields, got {opts.vf_env_args!r}")
    for flag, value in (("--vf-num-tasks", opts.vf_num_tasks), ("--vf-max-turns", opts.vf_max_turns)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be at least 1, got {value} (plugin verifiers)")
    try:
        environment(config)
    except VerifiersSetupError as exc:
        raise ConfigError(f"plugin verifiers: {exc}") from None


def prompt_messages(task) -> list[dict]:
    """The task's opening messages as the harness sends them (system prompt, then the prompt)."""
    data = task.data
    system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return system + [{"role": "user", "content": data.prompt}]
    return system + [message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
                     for message in data.prompt or []]


@hookimpl
def slime_data_source(config, tokenizer, buffer_filter):
    env = environment(config)
    records = []
    for index, task in enumerate(env.tasks):
        prompt = tokenizer.apply_chat_template(prompt_messages(task), tokenize=False, add_generation_prompt=True,
                                               **(config.apply_chat_template_kwargs or {}))
        records.append({"prompt": prompt, "tokens": tokenizer(prompt, add_special_tokens=False).input_ids,
                        "label": None, "metadata": {METADATA_KEY: {"task": index, "key": task.key}}})

    log.info("verifiers: %s with harness %s, %d tasks", env.spec.env_id, env.spec.harness, len(records))
    return PromptDataSource(records, config.n_samples_per_prompt, shuffle=config.rollout_shuffle,
                            seed=config.rollout_seed, buffer_filter=buffer_filter)


@hookimpl
async def slime_agent(config, sample, session):
    env = environment(config)
    meta = sample.metadata[METADATA_KEY]
    sampling = {"max_tokens": config.rollout_max_response_len, "temperature": config.rollout_temperature}
    trace = await env.play(env.tasks[meta["task"]], session, sampling)
    meta.update(reward=trace.reward, rewards={name: r.value for name, r in trace.rewards.items() if r is not None},
                metrics={name: v for name, v in trace.metrics.items() if v is not None},
                stop=trace.stop_condition, trace_id=trace.id)
    if trace.errors:
        error = trace.errors[-1]
        raise VerifiersEpisodeError(f"verifiers rollout of task {meta['task']} ({env.spec.env_id}) failed: "
                                    f"{error.type}: {error.message}")
    return trace.reward


@hookimpl
def slime_log_rollout(config, samples, metrics):
    by_name: dict[str, list[float]] = {}
    for sample in samples:
        meta = sample.metadata.get(METADATA_KEY) or {}
        for kind in ("rewards", "metrics"):
            for name, value in (meta.get(kind) or {}).items():
                by_name.setdefault(f"verifiers/{kind[:-1]}/{name}", []).append(float(value))
    for name, values in by_name.items():
        metrics[name] = statistics.fmean(values)
