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
