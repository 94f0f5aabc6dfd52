"""reasoning-gym for slime-core: procedural tasks with verifiable answers, difficulty that follows the policy.

Hooks:
- ``slime_data_source``: problems of the ``--rg-tasks`` (any registered reasoning-gym dataset), each at its
  task's current level (``source.py``, ``tasks.py``), with ``--rg-system-prompt`` as system message.
- ``slime_reward`` / ``slime_group_reward``: the task's own ``score_answer`` on the answer read from the response
  (``--rg-answer``: reasoning-gym's ``extract_answer``, the last ``<answer>...</answer>``, or the whole
  response); each result also goes to the difficulty controller (``difficulty.py``). A sample that is no
  reasoning-gym problem (an ``--eval-prompt-data`` set) is scored by the built-in reward hub.
- ``slime_log_rollout``: ``reasoning_gym/<task>/{reward,pass_rate,level,level_changes}`` per step.
- ``slime_options``, ``slime_validate_config`` (every task built at its start level before Ray starts),
  ``slime_quickstart_options``.
"""

from __future__ import annotations

import asyncio
import logging
import statistics

from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from slimecore import hookimpl
from slimecore.config import ConfigError, Option, json_value
from slimecore.defaults import reward as default_reward

from slime_reasoning_gym.difficulty import DifficultyController, Thresholds
from slime_reasoning_gym.source import METADATA_KEY, ReasoningGymSource
from slime_reasoning_gym.tasks import RANGE_MODES, Task, TaskError, entry

log = logging.getLogger("slime_reasoning_gym")
NAME = "reasoning_gym"
NO_SYSTEM_PROMPT = "none"
_SOURCES: list[ReasoningGymSource] = []  # the training source of this (rollout) process, once built


@hookimpl
def slime_options():
    return [
        Option("rg_tasks", str, ["basic_arithmetic"], "reasoning-gym datasets to train on (any name in "
               "reasoning_gym.factory.DATASETS); each prompt group draws one of them uniformly.", nargs="+"),
        Option("rg_task_config", json_value, None, "Fixed dataset-config fields per task, over its curriculum, as "
               "JSON: {\"basic_arithmetic\": {\"operators\": [\"+\", \"-\"]}}."),
        Option("rg_system_prompt", str, "direct", "System message: one of reasoning-gym's SYSTEM_PROMPTS, or none.",
               choices=(*SYSTEM_PROMPTS, NO_SYSTEM_PROMPT)),
        Option("rg_answer", str, "tag", "What is graded: tag = the last <answer>...</answer> of the response "
               "(reasoning-gym's extract_answer; none gives 0), response = the whole response, stripped.",
               choices=("tag", "response")),
        Option("rg_adapt", bool, True, "Move each task's level with its pass rate (--no-rg-adapt: stay at "
               "--rg-start-level)."),
        Option("rg_start_level", int, 0, "Level every task starts at (clamped to the task's top level)."),
        Option("rg_range_mode", str, "inclusive", "How a curriculum level becomes a config: inclusive = range "
               "attributes span levels 0..L; upper_bound = only level L's segment.", choices=RANGE_MODES),
        Option("rg_window", int, 64, "Results kept per task (at its current level) for its pass rate."),
        Option("rg_min_samples", int, 32, "Results a task needs at its level before the level may move."),
        Option("rg_raise_at", float, 0.8, "Pass rate at or above which a task goes one level up."),
        Option("rg_lower_at", float, 0.2, "Pass rate at or below which a task goes one level down."),
        Option("rg_pass_score", float, 1.0, "Score (reasoning-gym's, 0..1) at or above which a sample passes."),
    ]


# The quick-start run on a CPU: chat prompts, short answers (the "direct" prompt asks for no reasoning), groups
# of 8 so a task at 1/8 pass rate still gives GRPO a signal.
QUICKSTART = {"rollout_batch_size": 8, "n_samples_per_prompt": 8, "num_rollout": 16, "rollout_max_response_len": 32,
              "apply_chat_template": True, "lr": 1e-5}


@hookimpl
def slime_quickstart_options():
    return QUICKSTART


def thresholds(opts) -> Thresholds:
    return Thresholds(window=opts.rg_window, min_samples=opts.rg_min_samples, raise_at=opts.rg_raise_at,
                      lower_at=opts.rg_lower_at, pass_score=opts.rg_pass_score)


def build_tasks(opts) -> list[Task]:
    """The ``--rg-tasks`` as Tasks; raises TaskError naming the task and flag."""
    fixed = opts.rg_task_config or {}
    if not isinstance(fixed, dict) or not all(isinstance(v, dict) for v in fixed.values()):
        raise TaskError("--rg-task-config must be a JSON object of objects: {\"task\": {\"field\": value}}")
    stray = sorted(set(fixed) - set(opts.rg_tasks))
    if stray:
        raise TaskError(f"--rg-task-config names {stray}, which are not in --rg-tasks {opts.rg_tasks}")
    return [Task(name, fixed.get(name), opts.rg_range_mode) for name in opts.rg_tasks]


@hookimpl
def slime_validate_config(config):
    opts = config.plugin(NAME)
    if config.prompt_data is not None:
        raise ConfigError("plugin reasoning_gym generates its prompts from --rg-tasks; drop --prompt-data (for "
                          "held-out problems, give --eval-prompt-data: its samples get the built-in reward)")
    if len(set(opts.rg_tasks)) != len(opts.rg_tasks):
        raise ConfigError(f"--rg-tasks {opts.rg_tasks} names a task twice (plugin reasoning_gym)")
    problem = thresholds(opts).check()
    if problem:
        raise ConfigError(f"plugin reasoning_gym: {problem}")
    if not 0.0 < opts.rg_pass_score <= 1.0 or opts.rg_start_level < 0:
        raise ConfigError("plugin reasoning_gym: need 0 < --rg-pass-score <= 1 and --rg-start-level >= 0")
    try:
        for task in build_tasks(opts):  # every task's config at its start level, so a bad one fails here
            task.config(min(opts.rg_start_level, task.top_level), config.rollout_seed, config.task_size)
    except TaskError as exc:
        raise ConfigError(f"plugin reasoning_gym: {exc}") from None


@hookimpl
def slime_data_source(config, tokenizer, buffer_filter):
    opts = config.plugin(NAME)
    tasks = build_tasks(opts)
    controller = DifficultyController({t.name: t.top_level for t in tasks}, opts.rg_start_level, thresholds(opts),
                                      adapt=opts.rg_adapt)

    def render(messages):
        if config.apply_chat_template:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **(config.apply_chat_template_kwargs or {}))
        else:
            text = "\n\n".join(m["content"] for m in messages) + "\n"
        return text, tokenizer(text, add_special_tokens=False).input_ids

    system = None if opts.rg_system_prompt == NO_SYSTEM_PROMPT else SYSTEM_PROMPTS[opts.rg_system_prompt]
    source = ReasoningGymSource(tasks, controller, render, n_samples_per_prompt=config.n_samples_per_prompt,
                                system_prompt=system, seed=config.rollout_seed, size=config.task_size,
                                max_prompt_len=config.rollout_max_prompt_len,
                                buffer_filter=buffer_filter)
    _SOURCES[:] = [source]
    log.info("reasoning_gym: tasks %s, top levels %s, start level %d, adapt %s", opts.rg_tasks,
             {t.name: t.top_level for t in tasks}, opts.rg_start_level, opts.rg_adapt)
    return source


def grade(config, sample) -> float:
    """reasoning-gym's score of a sample drawn by the source (its metadata names the problem)."""
    meta = sample.metadata[METADATA_KEY]
    problem, dataset = entry(meta["task"], meta["config"], meta["index"])
    response = sample.response
    answer = extract_answer(response) if config.plugin(NAME).rg_answer == "tag" else response.strip()
    return float(dataset.score_answer(answer, problem))


@hookimpl
async def slime_reward(config, sample):
    if METADATA_KEY not in sample.metadata:
        return await default_reward.score(config, sample)
    score = await asyncio.to_thread(grade, config, sample)  # some tasks' checks are slow; keep the loop free
    if _SOURCES:
        meta = sample.metadata[METADATA_KEY]
        _SOURCES[0].controller.record(sample.index, meta["task"], meta["level"], score)
    return score


@hookimpl
async def slime_group_reward(config, samples):
    return list(await asyncio.gather(*(slime_reward(config, sample) for sample in samples)))


@hookimpl
def slime_log_rollout(config, samples, metrics):
    by_task: dict[str, list[float]] = {}
    for sample in samples:
        meta = sample.metadata.get(METADATA_KEY)
        if meta is not None and isinstance(sample.reward, (int, float)):
            by_task.setdefault(meta["task"], []).append(float(sample.reward))
    for task, rewards in by_task.items():
        metrics[f"reasoning_gym/{task}/reward"] = statistics.fmean(rewards)
    if not _SOURCES:
        return
    source = _SOURCES[0]
    source.controller.apply()  # this step's results, so the logged levels are those the next step draws at
    for task in source.names:
        rate = source.controller.pass_rate(task)
        if rate is not None:
            metrics[f"reasoning_gym/{task}/pass_rate"] = rate
        metrics[f"reasoning_gym/{task}/level"] = float(source.controller.level(task))
        metrics[f"reasoning_gym/{task}/level_changes"] = float(source.controller.changes[task])
