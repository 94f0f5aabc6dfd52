"""The command line: version, help everywhere, plugins and hooks listings, data, start-up errors."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from slimecore_cli.main import cli
from slimecore.testing import timeout as scaled


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_version_and_help_on_every_command():
    assert "slime-core, version" in run("--version").output
    for command in ([], ["plugins"], ["hooks"], ["data"]):
        result = run(*command, "--help")
        assert result.exit_code == 0 and "Usage" in result.output


def test_train_help_lists_plugin_options():
    # the real command in its own process: what a user types, untouched by plugins other tests loaded here
    result = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--help"],
                            capture_output=True, text=True, timeout=scaled(60), env={**os.environ, "COLUMNS": "100"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--rollout-batch-size INT" in result.stdout and "--eps-clip FLOAT" in result.stdout
    assert "\nalgorithm plugin:\n" in result.stdout and "(grpo) [default 0.2]" in result.stdout


def test_plugins_and_hooks_listings():
    rows = json.loads(run("plugins", "--json").stdout)  # stderr may say which plugins it imports
    names = {r["name"]: r for r in rows}
    assert names["slimecore.defaults.reward"]["hooks"] == ["slime_group_reward", "slime_log_rollout", "slime_options",
                                                           "slime_reward", "slime_shutdown", "slime_validate_config"]
    assert "slime_loss" in names["slimecore.defaults.slime_compat"]["hooks"]  # the slime adapter is built in
    assert "slime_loss" in names["grpo"]["hooks"] and names["grpo"]["origin"] == "entry point"
    table = run("plugins").output
    assert "grpo" in table and "entry point" in table and "built-in" in table
    hooks = run("hooks", "reward").output
    assert "slime_reward" in hooks and "Called in: rollout" in hooks
    assert run("hooks", "nope").exit_code == 2


def test_data_writes_a_task_file(tmp_path):
    out = tmp_path / "compare.jsonl"
    assert run("data", "--task", "compare", "-n", "5", "-o", str(out)).exit_code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and {"input", "label", "metadata"} <= set(rows[0])
    assert run("data", "--task", "chess", "-o", str(out)).exit_code == 2


@pytest.mark.parametrize("args,expected", [
    (["--plugin", "grpoo"], "unknown plugin 'grpoo'"),
    (["--plugin", "grpo", "--rollout-bach-size", "2"], "did you mean --rollout-batch-size"),
    (["--plugin", "grpo", "--kl-coef", "0.1", "--kl-loss-coef", "0.1", "--use-kl-loss"], "mutually exclusive"),
    (["--rollout-batch-size", "2"], "no active plugin implements slime_compute_advantages"),
    (["--plugin", "grpo", "--hf-checkpoint", "/nonexistent/model"], "never downloads"),
])
def test_train_startup_errors_exit_2_before_ray(args, expected):
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", *args], capture_output=True, text=True,
                          timeout=scaled(120))
    assert proc.returncode == 2, proc.stderr
    assert expected in " ".join(proc.stderr.split())
    assert "Started a local Ray instance" not in proc.stderr
