"""The SFT loss: a hand-computed case, the trainer's loss against an independent HF forward, and identical loss
and gradients (1e-6) whatever the micro-batching and with 2 DP ranks instead of 1. The batches are real: multi-turn,
system and tool conversations read, masked and converted by the plugin's data source and the rollout manager's
``convert_samples``, as a run does."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from slimecore.config import Config
from slimecore.hf_checkpoint import load_tokenizer
from slimecore.ops.reducers import make_sample_mean_reducer, make_token_mean_reducer
from slimecore.plugins import load_plugins
from slimecore.rollout.hook_args import buffer_filter
from slimecore.testing.distributed import run_ranks
from slimecore.rollout.manager import convert_samples
from slimecore.trainers.trainer import Trainer
from slimecore.rollout.schedule import build_dp_schedule, split_for_ranks
from slime_sft.plugin import sft_loss

CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "7"}],
    [{"role": "system", "content": "Answer with only the number."},
     {"role": "user", "content": "Which is larger: 12 or 40?"}, {"role": "assistant", "content": "40"},
     {"role": "user", "content": "And 9 or 2?"}, {"role": "assistant", "content": "9"}],
    [{"role": "user", "content": "Search apple."}, {"role": "assistant", "content": "search apple"},
     {"role": "tool", "content": "apple: a fruit"}, {"role": "assistant", "content": "The answer is a fruit."}],
    [{"role": "user", "content": "Sort 5, 1, 3."}, {"role": "assistant", "content": "1, 3, 5"}],
    [{"role": "user", "content": "Repeat this word exactly: river"}, {"role": "assistant", "content": "river"},
     {"role": "user", "content": "Again, with a period."}, {"role": "assistant", "content": "river."}],
    [{"role": "user", "content": "How many times does the letter 'p' appear in 'apple'?"},
     {"role": "assistant", "content": "Let me think step by step. The answer is 2."}],
    [{"role": "user", "content": "What is 10 - 1?"}, {"role": "assistant", "content": "9", "step_loss_mask": 0},
     {"role": "user", "content": "What is 10 - 2?"}, {"role": "assistant", "content": "8"}],
]


def test_sft_loss_by_hand():
    log_probs = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5])]
    masks = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0])]
    # per conversation: (1 + 3) / 2 = 2 and 0.5 / 1; mean over the step's 2 conversations: 1.25
    loss, metrics = sft_loss(log_probs, make_sample_mean_reducer(masks, [2.0, 1.0], num_rollouts_step=2))
    assert loss.item() == pytest.approx(1.25) and metrics == {}
    # --calculate-per-token-loss: (1 + 3 + 0.5) / 3 tokens
    assert sft_loss(log_probs, make_token_mean_reducer(masks, num_tokens_step=3))[0].item() == pytest.approx(1.5)


def _config(checkpoint, prompt_data: str, **kw) -> Config:
    return Config.make(plugins=["sft"], plugin_values={"sft": {"sft_max_len": None}}, hf_checkpoint=str(checkpoint),
                       prompt_data=prompt_data, input_key="messages", lr=1e-3, engines=False,
                       rollout_batch_size=len(CONVERSATIONS), global_batch_size=len(CONVERSATIONS), **kw)


def _train_data(checkpoint, directory) -> tuple[Config, dict]:
    """The column dict the rollout manager hands the trainer for one step over CONVERSATIONS."""
    path = directory / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    config = _config(checkpoint, str(path))
    hooks = load_plugins(["sft"])
    source = hooks.slime_data_source(config=config, tokenizer=load_tokenizer(checkpoint),
                                     buffer_filter=buffer_filter(hooks, config))
    samples = [s for group in source.get_samples(len(source)) for s in group]
    return config, convert_samples(hooks, config, samples)


@pytest.fixture(scope="module")
def train_data(tiny_hf_checkpoint, tmp_path_factory):
    return _train_data(tiny_hf_checkpoint, tmp_path_factory.mktemp("sft-data"))


def _part(data, dp_size=1, rank=0, micro_batch_size=8, max_tokens=None):
    schedule = build_dp_schedule(data["rollout_ids"], [len(t) for t in data["tokens"]], len(data["tokens"]), dp_size,
                                 micro_batch_size, max_tokens)
    return split_for_ranks(copy.deepcopy(data), schedule)[rank]


def _train(config, data, dp_size=1, rank=0, **part_kw):
    torch.manual_seed(0)
    trainer = Trainer(config, load_plugins(["sft"]), rank=rank, world_size=dp_size)
    metrics = trainer.train(0, _part(data, dp_size, rank, **part_kw))
    return metrics, torch.cat([p.grad.reshape(-1) for p in trainer.backend.params])


def _config_like(config, **kw) -> Config:
    values = config.to_dict()
    values["values"].update(kw)
    return Config.from_dict(values)


@pytest.mark.parametrize("per_token", [False, True], ids=["sample-mean", "token-mean"])
def test_trainer_loss_is_the_nll_of_the_trained_tokens(tiny_hf_checkpoint, train_data, per_token):
    from transformers import AutoModelForCausalLM

    config, data = train_data
    masks = [torch.tensor(m, dtype=torch.float64) for m in data["loss_masks"]]
    assert all(0 < m.sum() < len(m) for m in masks[1:3])  # multi-turn: untrained turns inside the response
    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_checkpoint), dtype=torch.float32).eval()
    nll = []  # -log p of every response token, from one plain forward per conversation
    with torch.no_grad():
        for tokens, r in zip(data["tokens"], data["response_lengths"]):
            logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].double(), -1)  # (T, V)
            nll.append(-logp[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0][-r:])  # (R,)
    if per_token:
        expected = sum((x * m).sum() for x, m in zip(nll, masks)) / sum(m.sum() for m in masks)
    else:
        expected = sum((x * m).sum() / m.sum() for x, m in zip(nll, masks)) / len(masks)
    metrics, _ = _train(_config_like(config, calculate_per_token_loss=per_token), data)
    assert metrics["train/loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert metrics["train/grad_norm"] > 0


@pytest.mark.parametrize("per_token", [False, True], ids=["sample-mean", "token-mean"])
def test_micro_batching_does_not_change_the_loss_or_gradients(train_data, per_token):
    config, data = train_data
    config = _config_like(config, calculate_per_token_loss=per_token)
    m1, g1 = _train(config, data, micro_batch_size=8)
    assert len(_part(data, micro_batch_size=8)["steps"][0]["micro_batches"]) == 1
    for part_kw in ({"micro_batch_size": 2}, {"micro_batch_size": None, "max_tokens": 60}):
        assert len(_part(data, **part_kw)["steps"][0]["micro_batches"]) > 2
        m, g = _train(config, data, **part_kw)
        for key in ("train/loss", "train/grad_norm"):
            assert m[key] == pytest.approx(m1[key], abs=1e-6), (key, part_kw)
        assert (g - g1).abs().max().item() < 1e-6, part_kw


def _per_rank(rank, world, config_dict, data):
    config = Config.from_dict(config_dict)
    results = {}
    for per_token in (False, True):
        metrics, grads = _train(_config_like(config, calculate_per_token_loss=per_token), data, dp_size=world,
                                rank=rank, micro_batch_size=1)
        results[per_token] = (metrics["train/loss"], metrics["train/grad_norm"], grads.numpy())
    return results


def test_two_dp_ranks_give_the_same_loss_and_gradients_as_one(train_data):
    config, data = train_data
    expected = {per_token: _train(_config_like(config, calculate_per_token_loss=per_token), data, micro_batch_size=3)
                for per_token in (False, True)}
    for by_mode in run_ranks(_per_rank, config.to_dict(), data):
        for per_token, (loss, norm, grads) in by_mode.items():
            metrics, want = expected[per_token]
            assert loss == pytest.approx(metrics["train/loss"], abs=1e-6), per_token
            assert norm == pytest.approx(metrics["train/grad_norm"], abs=1e-6), per_token
            assert (torch.from_numpy(grads) - want).abs().max().item() < 1e-6, per_token
