"""The built-in rollout against real engines behind the real router: over-sampling with a group
filter, abort of what is left, partial rollout resumed with aligned tokens, reward failures."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.request

import pytest

from slimecore import hookimpl
from slimecore.config import Config
from slimecore.data.source import PromptDataSource, load_prompts
from slimecore.hf_checkpoint import load_tokenizer
from slimecore.plugins import load_plugins
from slimecore.rollout.client import RolloutClient
from slimecore.rollout.hook_args import SampleHooks, buffer_filter
from slimecore.rollout.manager import convert_samples
from slimecore.types import FilterResult, Status


def _config(**kw):
    base = dict(rollout_batch_size=3, n_samples_per_prompt=2, rollout_max_response_len=6, task_size=50,
                apply_chat_template=True, rollout_num_gpus=2)
    return Config.make(**(base | kw))


def _run(hooks, config, source, router, rollout_id=0):
    client = RolloutClient(router.url)

    async def go():
        try:
            return await hooks.slime_rollout(config=config, rollout_id=rollout_id, data_source=source, client=client,
                                             sample_hooks=SampleHooks(hooks), evaluation=False)
        finally:
            await client.close()

    return asyncio.run(go())


def _idle(servers):
    for server in servers:
        with urllib.request.urlopen(server.url + "/v1/loads?include=core") as r:
            load = json.loads(r.read())["loads"][0]
        assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0


class DropOddGroups:
    """Keeps groups with an even group_index, like a dynamic-sampling filter with a reason."""

    @hookimpl
    def slime_filter_group(self, config, samples):
        keep = samples[0].group_index % 2 == 0
        return FilterResult(keep, reason=None if keep else "odd")


class SlowLongGenerate:
    """Group 0 is short; every other group generates the full budget, so they are still running
    when group 0 meets the target of one group."""

    @hookimpl
    async def slime_generate(self, config, sample, sampling_params, client):
        limit = 20 if sample.group_index == 0 else sampling_params["max_new_tokens"]
        params = dict(sampling_params, max_new_tokens=limit - sample.response_length, ignore_eos=True)
        out = await client.generate(input_ids=sample.tokens, sampling_params=params)
        meta = out["meta_info"]
        entries = meta["output_token_logprobs"]
        sample.append_response_tokens([e[1] for e in entries], [e[0] for e in entries], text=out["text"],
                                      finish_reason=meta["finish_reason"], weight_version=meta["weight_version"])
        return sample


def test_over_sampling_with_a_filter_reaches_exactly_the_target(engines, tiny_checkpoint):
    servers, router = engines
    config = _config(over_sampling_batch_size=4)
    tokenizer = load_tokenizer(tiny_checkpoint)
    source = PromptDataSource(load_prompts(config, tokenizer, None)[0], 2)
    out = _run(load_plugins([], extra=[DropOddGroups()]), config, source, router)
    assert len(out.samples) == 3 and all(g[0].group_index % 2 == 0 for g in out.samples)
    assert out.metrics["rollout/dynamic_filter/drop_odd"] >= 2
    assert all(len(g) == 2 and all(s.reward is not None for s in g) for g in out.samples)
    _idle(servers)


class ConstantOddGroups:
    """Odd groups score 1.0 on every sample (zero std: no GRPO signal); even groups score 0 and 1."""

    @hookimpl
    async def slime_reward(self, config, sample):
        return 1.0 if sample.group_index % 2 else float(sample.index % 2)


def test_group_rm_keeps_a_plugins_own_per_sample_reward(engines, tiny_checkpoint):
    servers, router = engines
    config = _config(group_rm=True)
    source = PromptDataSource(load_prompts(config, load_tokenizer(tiny_checkpoint), None)[0], 2)
    out = _run(load_plugins([], extra=[ConstantOddGroups()]), config, source, router)
    assert all(s.reward == (1.0 if s.group_index % 2 else float(s.index % 2)) for g in out.samples for s in g)
    _idle(servers)


def test_built_in_zero_std_filter_drops_constant_groups_and_its_fallback_keeps_them(engines, tiny_checkpoint):
    servers, router = engines
    tokenizer = load_tokenizer(tiny_checkpoint)
    config = _config(over_sampling_batch_size=4, dynamic_sampling_filter="nonzero_std")
    source = PromptDataSource(load_prompts(config, tokenizer, None)[0], 2)
    out = _run(load_plugins([], extra=[ConstantOddGroups()]), config, source, router)
    assert len(out.samples) == 3 and all(g[0].group_index % 2 == 0 for g in out.samples)
    assert out.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] >= 1
    assert all({s.reward for s in g} == {0.0, 1.0} for g in out.samples)
    _idle(servers)
    # with the fallback and no spare group in flight (over-sampling = target), a rejected group is kept
    config = _config(dynamic_sampling_filter="nonzero_std_with_fallback")
    source = PromptDataSource(load_prompts(config, tokenizer, None)[0], 2)
    out = _run(load_plugins([], extra=[ConstantOddGroups()]), config, source, router)
    assert [g[0].group_index for g in out.samples] == [0, 1, 2]
    assert not any(k.startswith("rollout/dynamic_filter/") for k in out.metrics)
    _idle(servers)


def test_partial_rollout_resumes_aborted_samples_aligned(engines, tiny_checkpoint):
    servers, router = engines
    config = _config(over_sampling_batch_size=6, partial_rollout=True, rollout_max_response_len=400,
                     rollout_batch_size=1)
    tokenizer = load_tokenizer(tiny_checkpoint)
    source = PromptDataSource(load_prompts(config, tokenizer, None)[0], 2)
    hooks = load_plugins([], extra=[SlowLongGenerate()])
    out = _run(hooks, config, source, router)
    assert len(out.samples) == 1
    _idle(servers)
    assert source.buffer, "groups still running at the target must go back to the buffer"
    partial = [s for g in source.buffer for s in g if 0 < s.response_length < 400]
    assert partial, "an aborted group keeps its partial response with --partial-rollout"
    for s in partial:
        s.check_aligned()
        assert s.status is Status.PENDING and s.metadata["start_rollout_id"] == 0
    before = {s.index: (list(s.tokens), list(s.rollout_log_probs)) for s in partial}
    state = source.state_dict()  # the buffer survives a checkpoint
    resumed = PromptDataSource(source.records, 2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    out2 = _run(hooks, _config(rollout_max_response_len=400, partial_rollout=True, rollout_batch_size=1), resumed,
                router, rollout_id=1)
    continued = {s.index: s for g in out2.samples for s in g if s.index in before}
    assert continued, "the buffer is drained first"
    for index, sample in continued.items():
        tokens, log_probs = before[index]
        assert sample.tokens[:len(tokens)] == tokens and sample.rollout_log_probs[:len(log_probs)] == log_probs
        assert sample.response_length == 400 and len(sample.loss_mask) == len(sample.rollout_log_probs) == 400
    _idle(servers)


class FlakyReward:
    @hookimpl
    async def slime_reward(self, config, sample):
        if sample.index == 0:
            raise ConnectionError("reward model unreachable")
        return math.nan if sample.index == 1 else 1.0


def test_reward_failures_mark_samples_instead_of_poisoning_the_batch(engines, tiny_checkpoint):
    _, router = engines
    config = _config(rollout_batch_size=2)
    tokenizer = load_tokenizer(tiny_checkpoint)
    source = PromptDataSource(load_prompts(config, tokenizer, None)[0], 2)
    hooks = load_plugins([], extra=[FlakyReward()])
    out = _run(hooks, config, source, router)
    samples = [s for g in out.samples for s in g]
    failed = {s.index: s for s in samples if s.status is Status.FAILED}
    assert set(failed) == {0, 1} and out.metrics["rollout/reward_failures"] == 2
    assert "reward model unreachable" in failed[0].metadata["reward_error"]
    data = convert_samples(hooks, config, samples)
    assert all(sum(m) == 0 for m, s in zip(data["loss_masks"], samples) if s.index in failed)
    assert all(not math.isnan(r) for r in data["rewards"])


class GroupRank:
    """--group-rm: scores a whole group at once (here: by position in the group)."""

    @hookimpl
    async def slime_group_reward(self, config, samples):
        return [float(i) for i in range(len(samples))]


def test_group_reward_scores_whole_groups(engines, tiny_checkpoint):
    _, router = engines
    config = _config(rollout_batch_size=2, group_rm=True)
    tokenizer = load_tokenizer(tiny_checkpoint)
    source = PromptDataSource(load_prompts(config, tokenizer, None)[0], 2)
    out = _run(load_plugins([], extra=[GroupRank()]), config, source, router)
    assert [[s.reward for s in g] for g in out.samples] == [[0.0, 1.0], [0.0, 1.0]]


class NewestFirst:
    @hookimpl
    def slime_buffer_filter(self, config, buffer, num_groups):
        chosen = buffer[-num_groups:]
        del buffer[-num_groups:]
        return chosen


def test_buffer_filter_hook_chooses_what_to_resume(tiny_checkpoint):
    config = _config()
    tokenizer = load_tokenizer(tiny_checkpoint)
    hooks = load_plugins([], extra=[NewestFirst()])
    source = hooks.slime_data_source(config=config, tokenizer=tokenizer, buffer_filter=buffer_filter(hooks, config))
    groups = source.get_samples(3)
    source.add_samples(groups)
    assert [g[0].group_index for g in source.get_samples(2)] == [1, 2]
    assert [g[0].group_index for g in source.buffer] == [0]
    default = load_plugins([])
    plain = default.slime_data_source(config=config, tokenizer=tokenizer, buffer_filter=buffer_filter(default, config))
    plain.add_samples(plain.get_samples(3))
    assert [g[0].group_index for g in plain.get_samples(2)] == [0, 1]


def test_a_filter_that_rejects_everything_is_reported_not_silent(caplog):
    from slimecore.rollout.groups import warn_if_starving

    drops = __import__("collections").Counter()
    with caplog.at_level("WARNING", logger="slimecore.rollout"):
        for _ in range(60):
            drops["zero_std_0.0"] += 1
            warn_if_starving(drops, 0, 3)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "dropped 30 groups (zero_std_0.0: 30) while 0 of 3" in warnings[0]
