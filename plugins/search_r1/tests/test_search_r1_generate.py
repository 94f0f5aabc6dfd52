"""The generate hook on a real embedded engine with a tiny model taught the Search-R1 format: searches, the
invalid-action reply, answers; tokens, loss mask and log-probs aligned across turns; observation tokens never
trained; the fsdp trainer's recomputed log-probs equal the engine's on every model token; the HTTP retriever;
the turn and context limits."""

from __future__ import annotations

import asyncio

import pytest
import torch

from search_r1_testkit import (CITIES, INVALID_FIRST, RetrievalServer, check_episode, search_data,  # noqa: F401
                               taught_checkpoint)
from slimecore.config import Config
from slimecore.rollout.groups import sampling_params
from slimecore.plugins import load_plugins
from slimecore.rollout.client import RolloutClient
from slimecore.rollout.hook_args import SampleHooks, buffer_filter
from slimecore.rollout.manager import convert_samples
from slimecore.testing import mask_runs
from slimecore.trainers.trainer import Trainer
from slimecore.rollout.schedule import build_dp_schedule, split_for_ranks
from slimecore.types import Status


@pytest.fixture(scope="module")
def engine(taught_checkpoint):
    from slimecore.testing.engines import embedded_engine

    with embedded_engine(taught_checkpoint, max_batch_size=8) as server:
        yield server


def _setup(checkpoint, search_data, temperature=0.0, max_turns=None, **core):
    corpus, qa = search_data
    hooks = load_plugins(["search_r1"])
    values = {o.name: o.default for o in hooks.slime_options()["search_r1"]}
    values |= {"search_corpus": str(corpus), "search_topk": 1}
    values |= {k: core.pop(k) for k in list(core) if k in values}
    config = Config.make(plugins=["search_r1"], plugin_values={"search_r1": values}, hf_checkpoint=str(checkpoint),
                         prompt_data=str(qa), label_key="label", apply_chat_template=True, rollout_batch_size=4,
                         n_samples_per_prompt=1, rollout_max_response_len=48, rollout_temperature=1.0,
                         max_turns=max_turns, **core)
    params = sampling_params(config)
    params["temperature"] = temperature  # 0: greedy, so each taught episode plays out as taught
    return hooks, config, params


def _rollout(engine, hooks, config, params, groups: int = 4):
    """Samples of ``groups`` prompts, generated and scored through the hooks, as the rollout manager does."""
    client = RolloutClient(engine.url, tokenizer=engine.tokenizer)
    source = hooks.slime_data_source(config=config, tokenizer=engine.tokenizer,
                                     buffer_filter=buffer_filter(hooks, config))
    samples = [s for group in source.get_samples(groups) for s in group]

    async def run():
        generate = SampleHooks(hooks).generate
        out = await asyncio.gather(*(generate(config=config, sample=s, sampling_params=params, client=client,
                                              evaluation=False) for s in samples))
        for s in out:
            s.reward = await hooks.slime_reward(config=config, sample=s)
        await client.close()
        return out

    return asyncio.run(run())


def test_taught_episodes_search_answer_and_recover_from_an_invalid_action(engine, taught_checkpoint, search_data):
    hooks, config, params = _setup(taught_checkpoint, search_data)
    samples = _rollout(engine, hooks, config, params)
    by_country = {next(c for c in CITIES if c in s.prompt): s for s in samples}
    for country, sample in by_country.items():
        actions = check_episode(sample, engine.tokenizer, search_data[0])
        stats = sample.metadata["search_r1"]
        if country == INVALID_FIRST:
            assert actions == ["invalid", "answer"] and stats["searches"] == 0 and stats["invalid_actions"] == 1
            assert sample.reward == pytest.approx(0.8)  # right answer, malformed episode: 1 - structure score
        else:
            assert actions == ["search", "answer"] and stats["searches"] == 1 and stats["invalid_actions"] == 0
            assert f"<information>Doc 1(Title: \"{CITIES[country]}\")" in sample.response
            assert sample.reward == 1.0 and stats["em"] == 1.0 and stats["valid_format"] == 1.0
        assert sample.status == Status.COMPLETED and sample.metadata["turns"] == 2
        assert sample.response.endswith(f"<answer> {CITIES[country]} </answer>")  # the stop ended the turn
    metrics = {}
    hooks.slime_log_rollout(config=config, rollout_id=0, samples=samples, metrics=metrics)
    assert metrics == {"search_r1/searches_per_sample": 0.75, "search_r1/invalid_actions_per_sample": 0.25,
                       "search_r1/em": 1.0, "search_r1/valid_format": 0.75, "search_r1/turns_per_sample": 2.0}


def test_trainer_log_probs_match_the_engine_on_model_tokens(engine, taught_checkpoint, search_data):
    hooks, config, params = _setup(taught_checkpoint, search_data, temperature=1.0, micro_batch_size=2)
    samples = _rollout(engine, hooks, config, params)
    assert sum(s.metadata["search_r1"]["searches"] for s in samples) >= 1
    for sample in samples:
        check_episode(sample, engine.tokenizer, search_data[0])
    data = convert_samples(hooks, config, samples)
    schedule = build_dp_schedule(data["rollout_ids"], [len(t) for t in data["tokens"]], len(samples), 1,
                                 config.micro_batch_size)
    part = split_for_ranks(data, schedule)[0]
    trainer = Trainer(config, hooks)
    recomputed = trainer.compute_log_probs(part)
    for lp, rollout, mask in zip(recomputed, part["rollout_log_probs"], part["loss_masks"]):
        mask = torch.tensor(mask, dtype=torch.bool)
        assert mask.any() and not mask.all()  # model turns and observations in every sample
        assert (lp[mask] - torch.tensor(rollout)[mask]).abs().max().item() < 1e-4


def test_search_url_sends_searches_to_a_retrieval_server(engine, taught_checkpoint, search_data):
    with RetrievalServer(search_data[0]) as server:
        hooks, config, params = _setup(taught_checkpoint, search_data, search_corpus=None, search_url=server.url)
        samples = _rollout(engine, hooks, config, params)
    queries = sorted(r["queries"][0] for r in server.requests)
    assert queries == sorted(f"capital of {c}" for c in CITIES if c != INVALID_FIRST)
    assert all(r["topk"] == 1 and r["return_scores"] is False for r in server.requests)
    for sample in samples:
        check_episode(sample, engine.tokenizer, search_data[0])  # the same documents as the local BM25


def test_max_turns_and_the_context_limit_end_episodes(engine, taught_checkpoint, search_data):
    hooks, config, params = _setup(taught_checkpoint, search_data, max_turns=1)
    for sample in _rollout(engine, hooks, config, params):
        assert sample.metadata["turns"] == 1 and sample.metadata["search_r1"]["searches"] == 0  # no search after it
        assert sample.loss_mask == [1] * sample.response_length and sample.status == Status.COMPLETED
    hooks, config, params = _setup(taught_checkpoint, search_data)
    full = _rollout(engine, hooks, config, params, groups=1)[0]  # France: search, documents, answer
    first_turn = mask_runs(full.loss_mask)[0][2]
    # room for the first turn but not for the documents it asks for: truncated, the documents left out
    hooks, config, params = _setup(taught_checkpoint, search_data,
                                   rollout_max_context_len=full.prompt_length + first_turn + 3)
    sample = _rollout(engine, hooks, config, params, groups=1)[0]
    assert sample.status == Status.TRUNCATED and sample.response.endswith("</search>")
    assert sample.response_tokens == full.response_tokens[:first_turn] and sample.loss_mask == [1] * first_turn
    # room for less than the first turn: the turn itself is cut
    hooks, config, params = _setup(taught_checkpoint, search_data, rollout_max_context_len=full.prompt_length + 5)
    sample = _rollout(engine, hooks, config, params, groups=1)[0]
    assert sample.status == Status.TRUNCATED and sample.response_tokens == full.response_tokens[:5]
