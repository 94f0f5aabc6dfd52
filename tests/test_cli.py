"""The command line: version, help everywhere, plugins and hooks listings, data, start-up errors."""

import importlib.util
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


def test_every_listing_has_a_json_form(tmp_path):
    """Each listing's --json parses, with its documented keys (README, "Using it")."""
    run_dir = tmp_path / "runs" / "20261128-093000-grpo"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("plugin: [grpo]\nnum_rollout: 2\nlr: 1.0e-06\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/raw_reward": 0.5}) + "\n")
    listings = {  # command: keys of each row (one object for `runs show`)
        ("plugins", "--json"): {"name", "distribution", "version", "hooks", "origin", "location"},
        ("hooks", "--json"): {"name", "signature", "answers", "required", "async", "doc"},
        ("runs", "--root", str(tmp_path / "runs"), "--json"): {"name", "path", "started", "plugins", "steps",
                                                              "num_rollout", "final_reward", "finished", "summary"},
        ("runs", "show", run_dir.name, "--root", str(tmp_path / "runs"), "--json"): {"name", "config", "summary"},
        ("data", "--list", "--json"): {"name", "kind", "description", "plugin", "path"},
    }
    if importlib.util.find_spec("slime_models"):  # the models plugin (scripts/setup.sh installs it)
        listings[("models", "--json")] = {"preset", "plugin", "architecture", "slime_model_file", "megatron_args"}
    outputs = {args: (lambda r: (r.exit_code, r.stdout))(run(*args)) for args in listings}
    option_keys = {"flag", "name", "section", "type", "choices", "nargs", "default", "quickstart", "implied", "plugins",
                   "target", "help"}
    for args in (("--plugin", "grpo", "--help"), ("--help-all",)):  # own process, as test_train_help_... says why
        proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", *args, "--json"], capture_output=True,
                              text=True, timeout=scaled(60))
        listings[args], outputs[args] = option_keys, (proc.returncode, proc.stdout)
    for args, keys in listings.items():
        code, out = outputs[args]
        assert code == 0, (args, out[-2000:])
        rows = json.loads(out)
        rows = rows if isinstance(rows, list) else [rows]
        assert rows and all(keys <= set(row) for row in rows), (args, rows[0])
    options = {row["flag"]: row for row in json.loads(outputs[("--plugin", "grpo", "--help")][1])}
    assert options["--eps-clip"]["default"] == 0.2 and options["--eps-clip"]["plugins"] == ["grpo"]
    assert options["--eps-clip"]["type"] == "float" and options["--eps-clip"]["section"] == "algorithm plugin"
    every = json.loads(outputs[("--help-all",)][1])
    assert {"core", "advanced"} <= {row["section"] for row in every} and len(every) > len(options)
    assert json.loads(outputs[("runs", "show", run_dir.name, "--root", str(tmp_path / "runs"), "--json")][1]
                      )["config"]["lr"] == 1e-6
    assert {"compare", "arithmetic"} <= {row["name"] for row in json.loads(outputs[("data", "--list", "--json")][1])}


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
