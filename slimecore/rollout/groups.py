"""One prompt group through generate -> sample hooks -> reward: the parts the
built-in rollout (``slimecore.defaults.rollout``) and the fully-async worker (``slimecore.rollout.fully_async``)
both run.

A reward hook that raises, returns NaN or runs past ``--reward-timeout`` marks that sample FAILED (reward 0, not
trained) and is counted; the first few are logged with their traceback, and the group is not poisoned. A generate
hook past ``--generate-timeout`` fails the step naming the plugin.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import time

from slimecore import aio
from slimecore.errors import MESSAGES_FOR_USERS, HookCallError, PluginError
from slimecore.rollout.client import SharedRequests
from slimecore.types import Sample, Status

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


def sampling_seed(config, rollout_id: int, index: int | None, turn: int, evaluation: bool = False) -> int:
    """SGLang's per-request ``sampling_seed`` for one generate call: 63 bits of a hash of (``--seed``,
    ``--rollout-seed``, rollout id, sample index, turn, eval or not). The same run asks the same seeds whatever
    the engines, batching and arrival order; the embedded engine always honours them, SGLang with
    ``--sglang-enable-deterministic-inference`` (it ignores them otherwise)."""
    key = f"{config.seed}/{config.rollout_seed}/{rollout_id}/{index}/{turn}/{int(evaluation)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


def concurrency(config) -> int:
    """Generate requests in flight over all engines: ``--sglang-server-concurrency`` per engine."""
    return config.sglang_server_concurrency * max(1, config.rollout_num_gpus // config.rollout_num_gpus_per_engine)


class GroupRunner:
    """Runs generate -> sample hooks -> reward for one prompt group, with the global concurrency cap."""

    def __init__(self, config, client, sample_hooks, rollout_id: int, evaluation: bool, semaphore: asyncio.Semaphore):
        self.config, self.client, self.sample_hooks = config, client, sample_hooks
        self.rollout_id, self.evaluation, self.semaphore = rollout_id, evaluation, semaphore
        self.params = sampling_params(config, evaluation)
        self.reward_failures = 0
        self.reward_time = 0.0  # seconds spent in reward hooks, summed over samples (they overlap)

    async def run(self, group: list[Sample]) -> list[Sample]:
        with SharedRequests():  # the group's samples go to the engine in one request (they finish together anyway)
            results = await aio.gather(*(self._generate(s) for s in group))
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
            await aio.gather(*(self._reward(s) for s in samples if s.reward is None))
        return samples

    async def _generate(self, sample: Sample):
        if sample.status in (Status.COMPLETED, Status.TRUNCATED):
            return sample  # finished before its group was aborted; resumed groups only continue the rest
        async with self.semaphore:
            start = time.perf_counter()
            # turn: the generate calls this sample has had (a partial rollout's continuation is the next turn)
            params = {**self.params, "sampling_seed": sampling_seed(self.config, self.rollout_id, sample.index,
                                                                    len(sample.weight_versions), self.evaluation)}
            call = self.sample_hooks.generate(config=self.config, sample=sample, sampling_params=params,
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
        except HookCallError as exc:  # a message already written for users (a reward service's) needs no traceback
            self._fail(sample, str(exc), None if exc.cause_kind in MESSAGES_FOR_USERS else exc.cause_traceback)
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



def warn_if_starving(drops: collections.Counter, accepted: int, target: int) -> None:
    """A filter that rejects (nearly) everything would make a step sample forever: say so, every 10x target."""
    dropped = sum(drops.values())
    if dropped % (10 * target) == 0:
        log.warning("dynamic sampling has dropped %d groups (%s) while %d of %d are accepted; if this goes on, "
                    "check the filter (--dynamic-sampling-filter, slime_filter_group) and the rewards", dropped,
                    ", ".join(f"{reason}: {n}" for reason, n in drops.most_common(3)), accepted, target)
