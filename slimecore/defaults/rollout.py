"""Built-in rollout plugin: single-turn generate, the over-sampling rollout loop, identity rewards.

It implements the same hooks a user plugin would; the loop has no special case for it. The rollout
follows slime's ``generate_rollout_async``: submit groups until enough are in flight, filter each
finished group (dynamic sampling), stop at ``--rollout-batch-size`` accepted groups, abort what is
still running on every engine and wait for it. Differences from slime, on purpose:
- aborted groups are never lost: with ``--partial-rollout`` they go back to the buffer with their
  partial responses; without it they go back with the response cleared;
- a reward hook that raises, returns NaN or runs past ``--reward-timeout`` marks that sample FAILED
  (reward 0, not trained) and is counted as ``rollout/reward_failures``; the first few are logged with
  their traceback; the batch is not poisoned (the rollout manager stops the run when more than
  ``--max-reward-failure-fraction`` of a step failed);
- a generate hook past ``--generate-timeout`` fails the step naming the plugin;
- group filters that keep dropping groups stop the step after ``--max-filter-rounds`` over-sampling rounds,
  naming each filter's plugin and its drop reasons, instead of sampling forever.

One group's generate -> reward is ``slimecore.rollout.groups``; ``--fully-async`` steps come from the background
worker in ``slimecore.rollout.fully_async``.
"""

from __future__ import annotations

import asyncio
import collections
import math

from slimecore import aio, hookimpl
from slimecore.errors import FilterStarvedError
from slimecore.rollout.fully_async import fully_async_step, stop_workers
from slimecore.rollout.groups import GroupRunner, concurrency, warn_if_starving
from slimecore.types import FilterResult, RolloutOutput, Sample, Status

DEFAULT_MAX_TURNS = 4


@hookimpl
async def slime_generate(config, sample: Sample, sampling_params: dict, client, observation, agent):
    """Single turn, token in / token out; continues a partial sample with the remaining budget.

    Multi-turn when a plugin implements ``slime_observation``: up to ``--max-turns`` model turns (default 4)
    with the observations in between (loss mask 0, log-prob 0). Each turn gets up to
    ``--rollout-max-response-len`` new tokens; with ``--rollout-max-context-len`` the whole sample (prompt,
    turns and observations) stays within it. An aborted episode is not continued: it starts again from its
    prompt (a half-finished tool exchange cannot be resumed token-exactly).

    With a ``slime_agent`` plugin active, each sample is one agent episode in a session
    (``slimecore.agents.episode.run_episode``), which may return several samples sharing one ``rollout_id``."""
    if agent is not None:
        from slimecore.agents.episode import run_episode

        return await run_episode(config, sample, client, agent, sampling_params)
    if observation is not None:
        from slimecore.rollout.turns import run_turns

        if sample.response_length:
            sample.reset_response()

        async def on_turn(text: str, turn: int):
            return await observation(config=config, sample=sample, text=text, turn=turn)

        budget = config.rollout_max_context_len - sample.prompt_length if config.rollout_max_context_len else None
        return await run_turns(sample, client, sampling_params, on_turn, max_turns=config.max_turns or
                               DEFAULT_MAX_TURNS, max_response_len=budget)
    params = dict(sampling_params)
    params["max_new_tokens"] -= sample.response_length
    if params["max_new_tokens"] <= 0:
        sample.status = Status.TRUNCATED
        return sample
    out = await client.generate(input_ids=sample.tokens, sampling_params=params, return_logprob=True)
    meta = out["meta_info"]
    entries = meta["output_token_logprobs"]
    sample.append_response_tokens(
        [e[1] for e in entries], [e[0] for e in entries], trainable=True, text=out.get("text", ""),
        finish_reason=meta["finish_reason"], weight_version=meta.get("weight_version"))
    client.keep_routed_experts(sample, meta)
    return sample


@hookimpl
def slime_post_process_rewards(config, samples: list[Sample]):
    raw = [s.get_reward_value(config.reward_key) for s in samples]
    return raw, list(raw)


@hookimpl
def slime_filter_group(config, samples: list[Sample]):
    """``--dynamic-sampling-filter nonzero_std[_with_fallback]``: slime's ``check_reward_nonzero_std``. Keep a
    group iff the std of its rewards (float64) exceeds 1e-6; the drop reason is ``zero_std_<reward to 0.1>``."""
    if config.dynamic_sampling_filter is None:
        return None
    rewards = [s.get_reward_value(config.reward_key) for s in samples]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std > 1e-6:
        return FilterResult(True)
    return FilterResult(False, reason=f"zero_std_{round(mean, 1)}",
                        keep_when_insufficient=config.dynamic_sampling_filter == "nonzero_std_with_fallback")


def _starved(rollout_id: int, rounds: int, accepted: int, target: int, by_filter: collections.Counter):
    named = "; ".join(f"plugin {plugin!r} dropped {n} ({reason})" for (plugin, reason), n in by_filter.most_common(5))
    return FilterStarvedError(
        f"rollout {rollout_id}: group filters dropped {sum(by_filter.values())} groups in {rounds} over-sampling "
        f"rounds and accepted {accepted} of {target} (--max-filter-rounds {rounds}): {named}. The filter rejects "
        "(nearly) every group: check the rewards it sees (all equal?) and the filter, or raise --max-filter-rounds")


@hookimpl
async def slime_rollout(config, rollout_id: int, data_source, client, sample_hooks, evaluation: bool):
    if config.fully_async and not evaluation:
        return await fully_async_step(config, rollout_id, data_source, client, sample_hooks)
    runner = GroupRunner(config, client, sample_hooks, rollout_id, evaluation,
                         asyncio.Semaphore(concurrency(config)))
    if evaluation:
        groups = await aio.gather(*(runner.run(g) for g in data_source.get_samples(len(data_source))))
        return RolloutOutput(list(groups), {"rollout/reward_failures": runner.reward_failures})

    target = config.rollout_batch_size
    over = config.over_sampling_batch_size or target
    accepted: list[list[Sample]] = []
    drops: collections.Counter = collections.Counter()
    by_filter: collections.Counter = collections.Counter()  # (plugin, reason) -> groups dropped
    tasks: set[asyncio.Task] = set()
    submitted_alive = 0  # submitted and not rejected (slime's remaining_batch_size)
    rounds = 0
    try:  # a failure (or the step's deadline) cancels the groups in flight and waits for them
        while len(accepted) < target:
            while submitted_alive < target:
                if rounds == config.max_filter_rounds and by_filter:
                    for task in tasks:
                        task.cancel()
                    await client.abort_all()
                    raise _starved(rollout_id, rounds, len(accepted), target, by_filter)
                rounds += 1
                for group in data_source.get_samples(over):
                    if config.mask_offpolicy_in_partial_rollout:
                        for sample in group:
                            sample.loss_mask = [0] * sample.response_length if sample.response_length else None
                    tasks.add(asyncio.ensure_future(runner.run(group)))
                    submitted_alive += 1
            done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = task.result()
                if len(accepted) >= target:
                    continue  # finished after the target was met: surplus, dropped like slime
                if any(s.status == Status.ABORTED for s in group):
                    _recycle(config, data_source, group, rollout_id)
                    submitted_alive -= 1
                    continue
                verdict, plugin = sample_hooks.filter_group(config=config, samples=group)
                if verdict.keep or (verdict.keep_when_insufficient and submitted_alive <= target):
                    accepted.append(group)
                else:
                    drops[verdict.reason or "filtered"] += 1
                    by_filter[plugin, verdict.reason or "filtered"] += 1
                    submitted_alive -= 1
                    warn_if_starving(drops, len(accepted), target)
        aborted = 0
        if tasks:
            await client.abort_all()
            for group in await aio.gather(*tasks):
                if any(s.status == Status.ABORTED for s in group):
                    _recycle(config, data_source, group, rollout_id)
                    aborted += 1
    except BaseException:
        await aio.cancel(tasks)
        raise
    metrics = {f"rollout/dynamic_filter/drop_{reason}": float(n) for reason, n in drops.items()}
    metrics.update({"rollout/aborted_groups": float(aborted), "rollout/reward_failures": float(runner.reward_failures),
                    "perf/reward_time": runner.reward_time})
    accepted.sort(key=lambda g: g[0].index if g[0].index is not None else 0)
    return RolloutOutput(accepted, metrics)


def _recycle(config, data_source, group: list[Sample], rollout_id: int) -> None:
    """Return an aborted group to the buffer: partial responses kept only with --partial-rollout."""
    for sample in group:
        sample.metadata.setdefault("start_rollout_id", rollout_id)
        if not config.partial_rollout:
            sample.reset_response()
        elif sample.status == Status.ABORTED:
            sample.status = Status.PENDING
    data_source.add_samples([group])


@hookimpl
def slime_shutdown(config, process: str):
    if process == "rollout":
        stop_workers()
        from slimecore.agents.episode import stop_session_server

        stop_session_server()
