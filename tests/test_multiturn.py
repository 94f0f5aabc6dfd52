"""Multi-turn generation in the built-in generate hook, with a toy environment plugin
(``slime_observation``), against real engines behind the real router: tokens, loss masks and log-probs stay
aligned across turns, observation tokens are never trained, and the trainer's recomputed log-probs of the
model's own tokens equal the engine's."""

from __future__ import annotations

import asyncio

import torch

from slimecore import hookimpl
from slimecore.config import Config
from slimecore.data.source import PromptDataSource, load_prompts
from slimecore.hf_checkpoint import load_tokenizer
from slimecore.plugins import load_plugins
from slimecore.rollout.client import RolloutClient
from slimecore.rollout.hook_args import SampleHooks
from slimecore.rollout.manager import convert_samples
from slimecore.trainers.trainer import Trainer
from slimecore.types import Status


class CountingEnv:
    """Answers every model turn with an observation naming the turn; async, as real tools are."""

    def __init__(self):
        self.calls: list[tuple[int, str]] = []

    @hookimpl
    async def slime_observation(self, config, sample, text, turn):
        self.calls.append((turn, text))
        await asyncio.sleep(0)
        return f" <obs>turn {turn}</obs> "


def _rollout(config, hooks, router, tokenizer, checkpoint):
    source = PromptDataSource(load_prompts(config, tokenizer, None)[0], config.n_samples_per_prompt)
    client = RolloutClient(router.url, tokenizer=tokenizer)

    async def go():
        try:
            return await hooks.slime_rollout(config=config, rollout_id=0, data_source=source, client=client,
                                             sample_hooks=SampleHooks(hooks), evaluation=False)
        finally:
            await client.close()

    return [s for g in asyncio.run(go()).samples for s in g]


def test_observation_hook_makes_the_built_in_generate_multi_turn(engines, tiny_checkpoint):
    servers, router = engines
    tokenizer = load_tokenizer(tiny_checkpoint)
    # many stop ids so that turns end early on a stop token (a random model seldom writes a closing tag)
    config = Config.make(rollout_batch_size=2, n_samples_per_prompt=2, rollout_max_response_len=6, task_size=20,
                         apply_chat_template=True, max_turns=3, rollout_stop_token_ids=list(range(40, 300)),
                         hf_checkpoint=str(tiny_checkpoint), rm_type="compare")
    env = CountingEnv()
    samples = _rollout(config, load_plugins([], extra=[env]), router, tokenizer, tiny_checkpoint)
    assert len(samples) == 4 and env.calls
    observation_ids = {t for turn in range(3) for t in tokenizer(f" <obs>turn {turn}</obs> ",
                                                                add_special_tokens=False)["input_ids"]}
    multi = 0
    for s in samples:
        s.check_aligned()
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length == len(s.tokens) - s.prompt_length
        assert 1 <= s.metadata["turns"] <= 3
        masked = [i for i, m in enumerate(s.loss_mask) if m == 0]
        assert all(s.rollout_log_probs[i] == 0.0 for i in masked)  # tool tokens: log-prob 0, never trained
        assert {s.response_tokens[i] for i in masked} <= observation_ids
        assert len(masked) == sum(len(tokenizer(f" <obs>turn {t}</obs> ", add_special_tokens=False)["input_ids"])
                                  for t in range(s.metadata["turns"] - 1))
        multi += s.metadata["turns"] > 1 and s.status != Status.ABORTED
    assert multi >= 1
    # the trainer scores the same tokens: on the model's own tokens its log-probs equal the engine's
    data = convert_samples(load_plugins([]), config, samples)
    data["steps"] = [{"micro_batches": [list(range(len(samples)))]}]
    trainer = Trainer(config, load_plugins([], extra=[]), rank=0, world_size=1)
    recomputed = trainer.compute_log_probs(data)
    for s, lp in zip(samples, recomputed):
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        diff = (lp[mask] - torch.tensor(s.rollout_log_probs)[mask]).abs().max().item()
        assert diff < 1e-4, diff
