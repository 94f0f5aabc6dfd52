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
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import threading
import time

from slimecore import hookimpl
from slimecore.plugins import HookCallError, PluginError
from slimecore.types import FilterResult, RolloutOutput, Sample, Status

log = logging.getLogger("slimecore.rollout")
FAILURES_LOGGED = 3  # reward failures logged with their traceback per rollout process


def sampling_params(config, evaluation: bool = False) -> dict:
    """SGLang sampling params from the run's options (eval overrides where given)."""
    def pick(eval_value, value):
        return eval_value if evaluation and eval_value is not None else value

    params = {
        "temperature": pick(config.eval_temperature, config.rollout_temperature),
        "top_p": pick(config.eval_top_p, config.rollout_top_p),
        "top_k": config.rollout_top_k,
        "max_new_tokens": pick(config.eval_max_response_len, config.rollout_max_response_len),
        "skip_special_tokens": config.rollout_skip_special_tokens,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    if config.rollout_stop:
        params["stop"] = list(config.rollout_stop)
    if config.rollout_stop_token_ids:
        params["stop_token_ids"] = list(config.rollout_stop_token_ids)
    return params


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
        from slimecore.tools import run_turns

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
    return sample


@hookimpl
def slime_post_process_rewards(config, samples: list[Sample]):
    raw = [s.get_reward_value(config.reward_key) for s in samples]
    return raw, list(raw)


class _GroupRunner:
    """Runs generate -> sample hooks -> reward for one prompt group, with the global concurrency cap."""

    def __init__(self, config, client, sample_hooks, rollout_id: int, evaluation: bool, semaphore: asyncio.Semaphore):
        self.config, self.client, self.sample_hooks = config, client, sample_hooks
        self.rollout_id, self.evaluation, self.semaphore = rollout_id, evaluation, semaphore
        self.params = sampling_params(config, evaluation)
        self.reward_failures = 0
        self.reward_time = 0.0  # seconds spent in reward hooks, summed over samples (they overlap)

    async def run(self, group: list[Sample]) -> list[Sample]:
        results = await asyncio.gather(*(self._generate(s) for s in group))
        samples = [s for r in results for s in (r if isinstance(r, list) else [r])]
        for sample in samples:
            await self.sample_hooks.process_sample(config=self.config, sample=sample, rollout_id=self.rollout_id,
                                            evaluation=self.evaluation)
        if any(s.status == Status.ABORTED for s in samples):
            return samples  # goes back to the buffer; scored when it completes
        if self.sample_hooks.scores_groups(self.config, self.evaluation):
            try:
                rewards = await self._bounded_reward("slime_group_reward", self.sample_hooks.group_reward(
                    config=self.config, samples=samples))
            except HookCallError as exc:  # the whole group is unscored: mark each sample, as for slime_reward
                for sample in samples:
                    self._fail(sample, str(exc))
                return samples
            for sample, reward in zip(samples, rewards, strict=True):
                self._set_reward(sample, reward)
        else:
            # a generate hook may score its samples itself (an agent's reward): those are not scored again
            await asyncio.gather(*(self._reward(s) for s in samples if s.reward is None))
        return samples

    async def _generate(self, sample: Sample):
        if sample.status in (Status.COMPLETED, Status.TRUNCATED):
            return sample  # finished before its group was aborted; resumed groups only continue the rest
        async with self.semaphore:
            start = time.perf_counter()
            call = self.sample_hooks.generate(config=self.config, sample=sample, sampling_params=self.params,
                                       client=self.client, evaluation=self.evaluation)
            try:
                out = await asyncio.wait_for(call, self.config.generate_timeout)
            except asyncio.TimeoutError:
                plugin = self.sample_hooks.answering("slime_generate")
                raise PluginError(f"plugin {plugin!r}: slime_generate did not return within --generate-timeout "
                                  f"{self.config.generate_timeout:g}s for sample {sample.index}; fix the hook (is "
                                  "it waiting on something that never answers?) or raise the timeout") from None
            for s in out if isinstance(out, list) else [out]:
                s.metadata["generate_time"] = time.perf_counter() - start
            return out

    async def _reward(self, sample: Sample) -> None:
        start = time.perf_counter()
        try:
            reward = await self._bounded_reward("slime_reward",
                                                self.sample_hooks.reward(config=self.config, sample=sample))
        except HookCallError as exc:
            self._fail(sample, str(exc), exc.cause_traceback)
            return
        finally:
            self.reward_time += time.perf_counter() - start
        self._set_reward(sample, reward)

    def _set_reward(self, sample: Sample, reward) -> None:
        value = reward.get(self.config.reward_key) if isinstance(reward, dict) and self.config.reward_key else reward
        if isinstance(value, (int, float)) and math.isnan(float(value)):
            self._fail(sample, "reward is NaN")
            return
        sample.reward = reward

    async def _bounded_reward(self, hook: str, call):
        """A reward hook's answer within ``--reward-timeout``; past it, a HookCallError naming the plugin."""
        try:
            return await asyncio.wait_for(call, self.config.reward_timeout)
        except asyncio.TimeoutError:
            plugin = self.sample_hooks.answering(hook)
            raise HookCallError(plugin, hook, TimeoutError(
                f"no answer within --reward-timeout {self.config.reward_timeout:g}s")) from None

    def _fail(self, sample: Sample, why: str, trace: str | None = None) -> None:
        self.reward_failures += 1
        if self.reward_failures <= FAILURES_LOGGED:
            log.warning("sample %s: reward failed (%d so far this step; the sample is not trained): %s%s", sample.index,
                        self.reward_failures, why, f"\n{trace}" if trace else "")
        sample.status, sample.reward, sample.remove_sample = Status.FAILED, 0.0, True
        sample.metadata["reward_error"] = why


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


class FilterStarvedError(RuntimeError):
    """Group filters dropped groups for ``--max-filter-rounds`` over-sampling rounds without filling a step."""


def _starved(rollout_id: int, rounds: int, accepted: int, target: int, by_filter: collections.Counter):
    named = "; ".join(f"plugin {plugin!r} dropped {n} ({reason})" for (plugin, reason), n in by_filter.most_common(5))
    return FilterStarvedError(
        f"rollout {rollout_id}: group filters dropped {sum(by_filter.values())} groups in {rounds} over-sampling "
        f"rounds and accepted {accepted} of {target} (--max-filter-rounds {rounds}): {named}. The filter rejects "
        "(nearly) every group: check the rewards it sees (all equal?) and the filter, or raise --max-filter-rounds")


def _concurrency(config) -> int:
    return config.sglang_server_concurrency * max(1, config.rollout_num_gpus // config.rollout_num_gpus_per_engine)


@hookimpl
async def slime_rollout(config, rollout_id: int, data_source, client, sample_hooks, evaluation: bool):
    if config.fully_async and not evaluation:
        return await _fully_async_step(config, rollout_id, data_source, client, sample_hooks)
    runner = _GroupRunner(config, client, sample_hooks, rollout_id, evaluation, asyncio.Semaphore(_concurrency(config)))
    if evaluation:
        groups = await asyncio.gather(*(runner.run(g) for g in data_source.get_samples(len(data_source))))
        return RolloutOutput(list(groups), {"rollout/reward_failures": runner.reward_failures})

    target = config.rollout_batch_size
    over = config.over_sampling_batch_size or target
    accepted: list[list[Sample]] = []
    drops: collections.Counter = collections.Counter()
    by_filter: collections.Counter = collections.Counter()  # (plugin, reason) -> groups dropped
    tasks: set[asyncio.Task] = set()
    submitted_alive = 0  # submitted and not rejected (slime's remaining_batch_size)
    rounds = 0
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
                _warn_if_starving(drops, len(accepted), target)
    aborted = 0
    if tasks:
        await client.abort_all()
        for group in await asyncio.gather(*tasks):
            if any(s.status == Status.ABORTED for s in group):
                _recycle(config, data_source, group, rollout_id)
                aborted += 1
    metrics = {f"rollout/dynamic_filter/drop_{reason}": float(n) for reason, n in drops.items()}
    metrics.update({"rollout/aborted_groups": float(aborted), "rollout/reward_failures": float(runner.reward_failures),
                    "perf/reward_time": runner.reward_time})
    accepted.sort(key=lambda g: g[0].index if g[0].index is not None else 0)
    return RolloutOutput(accepted, metrics)


def _warn_if_starving(drops: collections.Counter, accepted: int, target: int) -> None:
    """A filter that rejects (nearly) everything would make a step sample forever: say so, every 10x target."""
    dropped = sum(drops.values())
    if dropped % (10 * target) == 0:
        log.warning("dynamic sampling has dropped %d groups (%s) while %d of %d are accepted; if this goes on, "
                    "check the filter (--dynamic-sampling-filter, slime_filter_group) and the rewards", dropped,
                    ", ".join(f"{reason}: {n}" for reason, n in drops.most_common(3)), accepted, target)


def _recycle(config, data_source, group: list[Sample], rollout_id: int) -> None:
    """Return an aborted group to the buffer: partial responses kept only with --partial-rollout."""
    for sample in group:
        sample.metadata.setdefault("start_rollout_id", rollout_id)
        if not config.partial_rollout:
            sample.reset_response()
        elif sample.status == Status.ABORTED:
            sample.status = Status.PENDING
    data_source.add_samples([group])


# ---------------------------------------------------------------------------------------------
# Fully async (--fully-async): one background worker per data source, across steps
# ---------------------------------------------------------------------------------------------


class BackgroundRollout:
    """Keeps up to ``--fully-async-groups`` groups queued or in flight on its own thread and event loop,
    while the manager serves steps and weight updates. Finished groups pass the group filter and wait in
    a queue; a step takes them in completion order. Requests started before a weight update finish on
    the old weights (the engine loads new weights between decode waves), so each sample records the
    versions that produced it.

    Everything that touches the data source holds ``lock``; ``state()`` is the data source's state with
    every group still held here put back into the buffer (responses cleared), so a checkpoint loses none.
    """

    def __init__(self, config, data_source, client, sample_hooks):
        self.config, self.data_source, self.client, self.sample_hooks = config, data_source, client, sample_hooks
        self.capacity = config.fully_async_groups or config.rollout_batch_size
        self.lock = threading.Lock()
        self.finished: queue.Queue = queue.Queue()
        # id(group) -> a copy of the group as it was submitted, for every group in flight or finished and not
        # yet taken (the copy, not the live samples, goes into checkpoints: those may be mid-update)
        self.held: dict[int, list[Sample]] = {}
        self.drops: collections.Counter = collections.Counter()
        self.rollout_id = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="slimecore-fully-async", daemon=True)
        self._thread.start()

    # -- the worker thread -------------------------------------------------------------------------
    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._produce())
        except BaseException as exc:  # surfaced to the next step by take()
            self.error = exc
            self.finished.put(None)
        finally:
            loop.run_until_complete(self.client.close())  # this loop's session only
            loop.close()

    async def _produce(self) -> None:
        runner = _GroupRunner(self.config, self.client, self.sample_hooks, self.rollout_id, False,
                              asyncio.Semaphore(_concurrency(self.config)))
        tasks: dict[asyncio.Task, list[Sample]] = {}
        while not self._stop.is_set():
            while len(self.held) < self.capacity:
                with self.lock:
                    group = self.data_source.get_samples(1)[0]
                self.held[id(group)] = [Sample.from_dict(sample.to_dict()) for sample in group]
                runner.rollout_id = self.rollout_id
                tasks[asyncio.ensure_future(runner.run(group))] = group
            if not tasks:  # everything held is finished and queued: wait for a step to take some
                await asyncio.sleep(0.05)
                continue
            done, _ = await asyncio.wait(tasks, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = tasks.pop(task)
                task.result()  # a generate hook that raised stops the worker; take() re-raises it
                if any(s.status == Status.ABORTED for s in group):
                    self.give_back(group, keep_partial=self.config.partial_rollout)
                    continue
                verdict, _ = self.sample_hooks.filter_group(config=self.config, samples=group)
                if verdict.keep:
                    self.finished.put(group)
                else:
                    self.drops[verdict.reason or "filtered"] += 1
                    del self.held[id(group)]
                    _warn_if_starving(self.drops, self.finished.qsize(), self.config.rollout_batch_size)
        if tasks:  # shutting down: abort what runs and return it to the buffer
            await self.client.abort_all()
            await asyncio.gather(*tasks, return_exceptions=True)
            for group in tasks.values():
                self.give_back(group, keep_partial=self.config.partial_rollout)

    # -- called from the manager's thread ----------------------------------------------------------
    def take(self, timeout: float) -> list[Sample]:
        try:
            group = self.finished.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the fully-async rollout finished no group in {timeout:.0f}s (--rollout-timeout); "
                               "are the engines alive and is the group filter rejecting everything?") from None
        if group is None:
            raise RuntimeError(f"the fully-async rollout worker stopped: {self.error!r}") from self.error
        return group

    def give_back(self, group: list[Sample], keep_partial: bool = False) -> None:
        """Return a group to the data source's buffer (to be generated again, or continued)."""
        for sample in group:
            if not keep_partial:
                sample.reset_response()
            elif sample.status == Status.ABORTED:
                sample.status = Status.PENDING
        with self.lock:
            self.held.pop(id(group), None)
            self.data_source.add_samples([group])

    def release(self, group: list[Sample]) -> None:
        self.held.pop(id(group), None)

    def state(self) -> dict:
        with self.lock:
            state = self.data_source.state_dict()
            held = [list(g) for g in self.held.values()]
        for group in held:
            for sample in group:
                sample.reset_response()
            state["buffer"].append([sample.to_dict() for sample in group])
        return state

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.config.rollout_timeout)


_WORKERS: dict[int, BackgroundRollout] = {}


async def _fully_async_step(config, rollout_id: int, data_source, client, sample_hooks) -> RolloutOutput:
    """One step from the background worker: the first ``--rollout-batch-size`` finished groups whose
    samples the trainer will see at most ``--max-staleness`` versions old; older groups go back to the
    buffer and are generated again (``rollout/stale_groups_regenerated``)."""
    worker = _WORKERS.get(id(data_source))
    if worker is None:
        worker = _WORKERS[id(data_source)] = BackgroundRollout(config, data_source, client, sample_hooks)
    worker.rollout_id = rollout_id
    # the async loop trains this step after one more update than the engines serve now
    train_version = client.policy_version + 1
    accepted, stale, lags = [], 0, []
    loop = asyncio.get_running_loop()
    wait_start = time.perf_counter()
    while len(accepted) < config.rollout_batch_size:
        group = await loop.run_in_executor(None, worker.take, config.rollout_timeout)
        versions = [int(v) for s in group for v in s.weight_versions if v not in (None, "default")]
        lag = train_version - min(versions) if versions else 0
        if lag > config.max_staleness:
            stale += 1
            worker.give_back(group)
            continue
        worker.release(group)
        lags.append(lag)
        accepted.append(group)
    drops, worker.drops = worker.drops, collections.Counter()
    metrics = {f"rollout/dynamic_filter/drop_{reason}": float(n) for reason, n in drops.items()}
    metrics.update({"rollout/stale_groups_regenerated": float(stale), "rollout/async_max_lag": float(max(lags)),
                    "rollout/async_queue_wait_time": time.perf_counter() - wait_start,
                    "rollout/async_groups_ready": float(worker.finished.qsize())})
    accepted.sort(key=lambda g: g[0].index if g[0].index is not None else 0)
    return RolloutOutput(accepted, metrics, data_state=worker.state())


@hookimpl
def slime_shutdown(config, process: str):
    if process == "rollout":
        for key in list(_WORKERS):
            _WORKERS.pop(key).stop()
        from slimecore.agents.episode import stop_session_server

        stop_session_server()
