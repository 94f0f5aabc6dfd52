"""Run-time checks that stop a run: the log-prob parity stop (``--max-logprob-mismatch``). The weight-sync
sentinel's tests sit with the weight sync (tests/test_weight_sync.py)."""

from __future__ import annotations

import json

import pytest
from test_fsdp_trainer import PolicyGradient, _config, _data, _part

from slimecore import hookimpl
from slimecore.parity import LogprobMismatchError
from slimecore.plugins import load_plugins
from slimecore.trainers.trainer import Trainer


class FirstStepMeasure(PolicyGradient):
    """Asks for no recomputed log-probs: the mismatch is measured in the first optimizer step's forward."""

    @hookimpl
    def slime_train_inputs(self, config, role):
        return []

    @hookimpl
    def slime_loss(self, config, role, batch, outputs, reducer):
        loss = reducer([lp * a for lp, a in zip(outputs["log_probs"], batch["advantages"])])
        return loss, {"pg_loss": loss.detach()}


@pytest.mark.parametrize("plugin", [PolicyGradient, FirstStepMeasure])
def test_forced_logprob_gap_stops_the_step_with_both_vectors_dumped(tiny_checkpoint, tmp_path, plugin):
    config = _config(tiny_checkpoint, max_logprob_mismatch=0.05, log_dir=str(tmp_path))
    trainer = Trainer(config, load_plugins([], extra=[plugin()], defaults=False), rank=0, world_size=1,
                      backend="fsdp")
    data = _data(n=4)
    data["loss_masks"] = [[1] * n for n in data["response_lengths"]]
    engine = [lp.tolist() for lp in trainer.compute_log_probs(_part(data))]  # parity: the engine scored as the trainer
    data["rollout_log_probs"] = [list(lp) for lp in engine]
    assert trainer.train(6, _part(data))["train/train_rollout_logprob_abs_diff"] < 1e-5  # no stop at parity

    trainer = Trainer(config, load_plugins([], extra=[plugin()], defaults=False), rank=0, world_size=1,
                      backend="fsdp")  # the same weights again
    data["rollout_log_probs"][2] = [x - 0.5 for x in engine[2]]  # the engine scored sample 2 differently
    with pytest.raises(LogprobMismatchError, match=r"^step 7: train/train_rollout_logprob_abs_diff .* > "
                                                   r"--max-logprob-mismatch 0\.05") as stopped:
        trainer.train(7, _part(data))
    dump = tmp_path / "logprob_mismatch" / "step7_rank0.jsonl"
    assert str(dump) in str(stopped.value)
    (row,) = [json.loads(line) for line in dump.read_text().splitlines()]  # only the offending sample
    assert row["step"] == 7 and row["index"] == 2 and row["response_length"] == data["response_lengths"][2]
    assert {"prompt", "response", "reward", "rollout_log_probs", "train_log_probs"} <= set(row)
    assert row["rollout_log_probs"] == pytest.approx(data["rollout_log_probs"][2])
    assert row["train_log_probs"] == pytest.approx(engine[2], abs=1e-5)
    assert row["logprob_mismatch"] == pytest.approx(0.5, abs=1e-4)


# -- policy-version provenance -------------------------------------------------------------------------------
def test_partial_rollout_sample_spans_the_two_versions_that_generated_it(embedded_engine, tiny_checkpoint, tmp_path):
    """A sample cut off under weights v1 and continued after v2 arrived (the built-in generate hook's partial-rollout
    continuation) records one span per version, each as long as what that version generated; its staleness counts
    from v1; the span list reaches samples.jsonl and the debug dump's dict."""
    import asyncio

    from slimecore.config import Config
    from slimecore.defaults.rollout import slime_generate
    from slimecore.rollout.client import RolloutClient
    from slimecore.rollout.manager import convert_samples
    from slimecore.runs import write_samples
    from slimecore.types import Sample

    config = Config.make(hf_checkpoint=str(tiny_checkpoint), log_dir=str(tmp_path), log_samples=-1)
    norm = dict(embedded_engine.model.state_dict())["model.norm.weight"].clone()
    sample = Sample(index=0, tokens=[5, 6, 7, 8])
    params = {"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}

    async def generate(max_new_tokens: int) -> None:
        client = RolloutClient(embedded_engine.url)
        await slime_generate(config=config, sample=sample, sampling_params={**params, "max_new_tokens": max_new_tokens},
                             client=client, observation=None, agent=None)
        await client.close()

    embedded_engine.load_weights({"model.norm.weight": norm}, "1", complete=False)
    asyncio.run(generate(3))  # cut off after 3 tokens under v1
    embedded_engine.load_weights({"model.norm.weight": norm * 1.5}, "2", complete=False)
    asyncio.run(generate(8))  # the continuation: 5 more under v2
    assert sample.weight_version_spans == [["1", 3], ["2", 5]] and sample.response_length == 8
    assert sample.weight_versions == ["1", "2"] and sample.oldest_weight_version() == "1"
    sample.reward = 1.0
    assert convert_samples(load_plugins([]), config, [sample])["weight_versions"] == ["1"]  # staleness from v1
    assert Sample.from_dict(sample.to_dict()).weight_version_spans == [["1", 3], ["2", 5]]  # the debug dump
    write_samples(config, 4, [sample])
    (row,) = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert row["weight_versions"] == [["1", 3], ["2", 5]]
    embedded_engine.load_weights({"model.norm.weight": norm}, "default", complete=False)


# -- reproducible sampling -------------------------------------------------------------------------------
def test_same_seed_runs_sample_the_same_tokens_on_one_and_two_engines(tiny_checkpoint, tmp_path):
    """Two runs of two steps with the same seeds (the second step sampled after a weight sync) generate the same
    tokens, whether one engine serves the run or two. The weight check runs at every sync meanwhile (the default)
    and passes; each sample's tokens come from the weights of its step."""
    import subprocess
    import sys

    import torch

    pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")

    def run(name: str, *extra: str) -> list[list[int]]:
        log_dir = tmp_path / name
        args = [sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--hf-checkpoint",
                str(tiny_checkpoint), "--task", "compare", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
                "--rollout-max-response-len", "8", "--lr", "1e-3", "--num-rollout", "2", "--log-dir", str(log_dir),
                "--no-use-tensorboard", "--apply-chat-template", "--log-samples", "-1",
                "--save-debug-rollout-data", str(log_dir / "dump" / "{rollout_id}.pt"), *extra]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        rows = [json.loads(line) for line in (log_dir / "samples.jsonl").read_text().splitlines()]
        assert all(r["weight_versions"] and r["weight_versions"][0][0] == str(r["step"]) for r in rows)
        return [s["tokens"] for step in (0, 1) for s in torch.load(log_dir / "dump" / f"{step}.pt")["samples"]]

    first = run("a")
    assert run("b") == first
    assert run("two_engines", "--rollout-num-gpus", "2") == first


# -- flags ----------------------------------------------------------------------------------------------------
def test_check_flags_and_sglang_determinism_pass_through():
    from slimecore.config import ConfigError, parse_config

    base = ["--prompt-data", "x.jsonl", "--rollout-batch-size", "4"]
    config = parse_config(base + ["--check-weights", "first", "--max-logprob-mismatch", "0.1",
                                  "--sglang-enable-deterministic-inference", "--sglang-attention-backend", "triton"],
                          [], {})
    assert config.check_weights == "first" and config.max_logprob_mismatch == 0.1
    assert config.sglang_args == {"enable_deterministic_inference": True, "attention_backend": "triton"}
    defaults = parse_config(base, [], {})
    assert defaults.check_weights == "every" and defaults.max_logprob_mismatch is None
    with pytest.raises(SystemExit):  # argparse: "argument --check-weights: invalid choice: 'sometimes' (choose ...)"
        parse_config(base + ["--check-weights", "sometimes"], [], {})
    with pytest.raises(ConfigError, match="--max-logprob-mismatch must be > 0"):
        parse_config(base + ["--max-logprob-mismatch", "0"], [], {})


# -- the sentinel's comparison for SGLang engines (their server cannot run here) ------------------------------
def test_sglang_engines_compare_the_tensors_they_keep_by_name_and_agree_with_each_other():
    """An SGLang engine reports its fused tensors (qkv_proj) under its own names: only the trainer's names it
    reports (the 1-D norms) are compared; a stale norm is named; engines of one layout must agree."""
    import torch

    from slimecore.weight_check import WeightCheckError, check_answers, checker_response, checksum_info, checksums

    norm, q = torch.ones(4), torch.randn(4, 4)
    expected = checksums([("model.norm.weight", norm), ("model.layers.0.self_attn.q_proj.weight", q)], only_1d=True)
    assert list(expected) == ["model.norm.weight"]
    fused = torch.cat([q, q, q])
    served = checker_response([checksum_info([("model.norm.weight", norm),
                                              ("model.layers.0.self_attn.qkv_proj.weight", fused)])])
    assert check_answers(expected, {"http://a": served, "http://b": served}, "3", every_name=False) == 1
    stale = checker_response([checksum_info([("model.norm.weight", norm * 2),
                                             ("model.layers.0.self_attn.qkv_proj.weight", fused)])])
    with pytest.raises(WeightCheckError, match=r"engine http://b does not hold the weights v3 .*first model\.norm"):
        check_answers(expected, {"http://a": served, "http://b": stale}, "3", every_name=False)
    other = checker_response([checksum_info([("model.norm.weight", norm),
                                             ("model.layers.0.self_attn.qkv_proj.weight", fused + 1)])])
    with pytest.raises(WeightCheckError, match="engines report different weights"):
        check_answers(expected, {"http://a": served, "http://b": other}, "3", every_name=False)
    with pytest.raises(WeightCheckError, match="did not report a weight checksum.*--check-weights never"):
        check_answers(expected, {"http://a": {"error": {"message": "Not Found"}}}, "3", every_name=False)
