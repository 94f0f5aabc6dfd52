"""One start-up path: ``slimecore.loop.run`` called from Python refuses the same bad inputs as ``slime-core train``,
with the same message, before Ray starts (both go through ``slimecore.startup.prepare``); the driver's
``slime_startup`` and ``slime_shutdown`` are paired."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slimecore.config import ConfigError, parse_config
from slimecore.errors import PluginError
from slimecore.plugins import load_for_config, load_plugins
from slimecore.startup import driver
from slimecore_cli.main import cli

LOSS_PLUGIN = """
from slimecore import hookimpl

@hookimpl
def slime_loss(config, role, batch, outputs, reducer):
    raise AssertionError("never called: the run is refused at start-up")
"""


def _prompts(path, rows: int) -> str:
    path.write_text("".join(json.dumps({"input": f"{i} + 1 =", "label": str(i + 1)}) + "\n" for i in range(rows)))
    return str(path)


def _cases(tmp_path, tiny_checkpoint):
    """(argv, what the message says): one bad input per step of ``prepare``."""
    for name in ("loss_a", "loss_b"):
        (tmp_path / f"{name}.py").write_text(LOSS_PLUGIN)
    two = _prompts(tmp_path / "two.jsonl", 2)
    grpo = ["--plugin", "grpo", "--hf-checkpoint", str(tiny_checkpoint), "--log-dir", str(tmp_path / "run"),
            "--n-samples-per-prompt", "2", "--global-batch-size", "4"]
    one_step = ["--rollout-batch-size", "2", "--num-rollout", "1"]
    return [
        # 1. a plugin's slime_validate_config (the built-in reward's)
        ([*grpo, "--rm-type", "dapo", "--prompt-data", two, *one_step], "--rm-type dapo returns a dict"),
        # 2. the contract: two plugins answering a one-answer hook
        ([*grpo, "--plugin", str(tmp_path / "loss_a.py"), "--plugin", str(tmp_path / "loss_b.py"), "--prompt-data", two,
          *one_step], "all implement slime_loss, which takes one answer"),
        # 3. the reward sources
        ([*grpo, "--rm-type", "math", "--reward-weights", "1", "2", "--prompt-data", two, *one_step],
         "--reward-weights has 2 weight(s) but this run has 1 reward(s)"),
        # 4. finalize: the steps of an epoch, from the data source's size
        ([*grpo, "--prompt-data", two, "--rollout-batch-size", "4"],
         "the prompts (2) do not fill one step of --rollout-batch-size 4"),
        # 5. the preflight: a prompt file that is not there
        ([*grpo, "--prompt-data", str(tmp_path / "missing.jsonl"), *one_step], "missing.jsonl"),
    ]


def _cli_error(argv) -> str:
    result = CliRunner().invoke(cli, ["train", *argv], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    return line.removeprefix("error: ")


def _python_error(argv) -> str:
    """What README says a Python caller does: parse_config, load_for_config, loop.run."""
    from slimecore.loop import run

    specs = [value for flag, value in zip(argv, argv[1:]) if flag == "--plugin"]
    hooks = load_plugins(specs)
    config = parse_config(argv, specs, hooks.slime_options(), hooks.slime_implied_options(),
                          hooks.slime_quickstart_options())
    with pytest.raises((ConfigError, PluginError)) as caught:
        run(config, load_for_config(config))
    return str(caught.value)


def test_loop_run_refuses_what_the_cli_refuses_with_the_same_message(tmp_path, tiny_checkpoint):
    for argv, expected in _cases(tmp_path, tiny_checkpoint):
        from_cli, from_python = _cli_error(argv), _python_error(argv)
        assert expected in from_cli, (argv, from_cli)
        assert " ".join(from_python.split()) == " ".join(from_cli.split()), argv
    assert not (tmp_path / "run" / ".slimecore-run.pid").exists()  # nothing claimed the run folder


def test_driver_shutdown_pairs_startup_whatever_ends_the_run(tmp_path):
    events, recorder = tmp_path / "events.jsonl", str(Path(__file__).parent / "recorder_plugin.py")
    config = parse_config(["--plugin", recorder, "--events-file", str(events)], [recorder],
                          load_plugins([recorder]).slime_options())
    hooks = load_for_config(config)
    with pytest.raises(RuntimeError, match="the run failed"):
        with driver(config, hooks):
            raise RuntimeError("the run failed")
    seen = [(e["event"], e["process"]) for e in map(json.loads, events.read_text().splitlines())]
    assert seen == [("startup", "driver"), ("shutdown", "driver")]
