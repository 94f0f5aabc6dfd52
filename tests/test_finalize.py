"""``slimecore.finalize``: the derived settings, computed once for the CLI and the Python API alike."""

from __future__ import annotations

import pytest

from slimecore.config import Config, ConfigError, parse_config
from slimecore.data.tasks import write_task_jsonl
from slimecore.finalize import finalize
from slimecore.plugins import load_for_config
from slimecore.trainers.fsdp import lr_lambda


def _epochs_only(prompts, checkpoint) -> list[str]:
    return ["--prompt-data", str(prompts), "--label-key", "label", "--hf-checkpoint", str(checkpoint),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-steps-per-rollout", "2",
            "--num-epoch", "3", "--lr", "1e-3", "--lr-decay-style", "linear"]


def test_num_epoch_alone_gives_the_lr_schedule_its_length(tiny_checkpoint, tmp_path):
    """10 prompts, 4 per step: 2 steps an epoch, 3 epochs, 2 optimizer steps per rollout. The schedule must
    span those 12 optimizer steps; without a length it stays at --lr after warm-up, whatever the decay style."""
    prompts = write_task_jsonl("compare", tmp_path / "p.jsonl", 10, seed=0)
    config = parse_config(_epochs_only(prompts, tiny_checkpoint), [], {})
    assert finalize(config, load_for_config(config)) is config
    assert (config.num_rollout, config.train_iters) == (6, 12)
    factor = lr_lambda(config)
    assert [factor(it) for it in (0, 6, 12)] == pytest.approx([1.0, 0.5, 0.0])
    config.num_rollout = 1  # a second call changes nothing: the CLI finalizes, then loop.run calls it again
    assert finalize(config, load_for_config(config)).train_iters == 12


def test_the_python_api_is_completed_as_the_cli_is(tiny_checkpoint, tmp_path):
    prompts = write_task_jsonl("compare", tmp_path / "p.jsonl", 10, seed=0)
    cli = parse_config(_epochs_only(prompts, tiny_checkpoint), [], {})
    api = Config.make(prompt_data=str(prompts), label_key="label", hf_checkpoint=str(tiny_checkpoint),
                      rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=4, num_epoch=3, lr=1e-3,
                      lr_decay_style="linear")
    for config in (cli, api):
        finalize(config, load_for_config(config))
    assert (api.num_rollout, api.train_iters, api.hf_checkpoint) == (cli.num_rollout, cli.train_iters,
                                                                    cli.hf_checkpoint)
    given = Config.make(prompt_data=str(prompts), hf_checkpoint=str(tiny_checkpoint), rollout_batch_size=4,
                        num_rollout=5, num_epoch=3)
    assert (finalize(given, load_for_config(given)).num_rollout, given.train_iters) == (5, 5)  # flags win


def test_too_few_prompts_for_one_step_is_an_error(tiny_checkpoint, tmp_path):
    prompts = write_task_jsonl("compare", tmp_path / "p.jsonl", 3, seed=0)
    config = Config.make(prompt_data=str(prompts), hf_checkpoint=str(tiny_checkpoint), rollout_batch_size=4)
    with pytest.raises(ConfigError, match=r"the prompts \(3\) do not fill one step of --rollout-batch-size 4"):
        finalize(config, load_for_config(config))
