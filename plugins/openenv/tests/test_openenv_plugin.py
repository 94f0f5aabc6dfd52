"""The plugin with the real openenv-core package: discovery and contract, start-up checks before Ray (the app
imported and its schemas read, or the URL's), the data source, and the server process it starts."""

import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from slime_openenv import plugin
from slime_openenv.environment import ServerProcess
from slimecore.config import ConfigError, parse_config
from slimecore.plugins import installed_entry_points, load_plugins
from slimecore.testing.contract import check_plugin_contract
from slimecore_cli.main import cli

sys.path.insert(0, str(Path(__file__).parent))  # openenv_broken_env

HOOKS = ["slime_agent", "slime_data_source", "slime_log_rollout", "slime_options", "slime_quickstart_options",
         "slime_shutdown", "slime_validate_config"]


def _config(*argv):
    hooks = load_plugins(["openenv"])
    config = parse_config(list(argv), ["openenv"], hooks.slime_options(), hooks.slime_implied_options(),
                          hooks.slime_quickstart_options())
    hooks.slime_validate_config(config=config)
    return hooks, config


def test_discovered_with_its_hooks():
    assert "openenv" in installed_entry_points()
    hooks = load_plugins(["openenv"])
    info = next(p for p in hooks.plugins if p.name == "openenv")
    assert info.hooks == HOOKS and info.distribution == "slime-core-openenv"
    assert check_plugin_contract("openenv") == HOOKS
    assert hooks.plugin_name(hooks.answerer("slime_data_source")) == "openenv"
    result = CliRunner().invoke(cli, ["plugins"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    row = next(line for line in result.output.splitlines() if "slime-core-openenv" in line)
    assert "agent, data_source, log_rollout, options, quickstart_options, shutdown, validate_config" in row


@pytest.mark.parametrize("argv, message", [
    (["--openenv-app", "no_such_env.server:app"], "cannot import 'no_such_env.server': ModuleNotFoundError"),
    (["--openenv-app", "slime_openenv.guess.server"], "must be MODULE:ATTRIBUTE"),
    (["--openenv-app", "slime_openenv.guess.server:nope"], "has no attribute 'nope'"),
    (["--openenv-app", "slime_openenv.plugin:NAME"], "is not an OpenEnv server app"),
    (["--openenv-app", "openenv_broken_env:tool_app"], "name the one the model's reply fills"),
    (["--openenv-app", "openenv_broken_env:tool_app", "--openenv-action-field", "tool"], "also requires \\['arguments'\\]"),
    (["--openenv-action-field", "text"], "'text' is not a string field of GuessAction .*\\['message'\\]"),
    (["--openenv-observation-field", "board"], "'board' is not a field of GuessObservation"),
    (["--openenv-url", "http://127.0.0.1:1"], "cannot read /schema"),
    (["--openenv-url", "http://127.0.0.1:1", "--openenv-app", "slime_openenv.guess.server:app"], "not both"),
    (["--openenv-reset-args", "[1]"], "must be a JSON object"),
    (["--openenv-reset-args", '{"seed": 1}'], "must not set 'seed'"),
    (["--openenv-episodes", "0"], "--openenv-episodes must be at least 1"),
    (["--prompt-data", "x.jsonl", "--rollout-batch-size", "2"], "drop --prompt-data"),
])
def test_bad_flags_are_start_up_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _config(*argv)


def test_the_cli_reports_them_before_ray_starts():
    result = CliRunner().invoke(cli, ["train", "--plugin", "openenv", "--openenv-app", "no_such_env:app"])
    assert result.exit_code == 2 and "plugin openenv" in result.output and "no_such_env" in result.output


def test_one_prompt_group_per_reset_seed(tiny_hf_checkpoint):
    from slimecore.hf_checkpoint import load_tokenizer
    from slimecore.rollout.hook_args import buffer_filter

    hooks, config = _config("--hf-checkpoint", str(tiny_hf_checkpoint), "--openenv-episodes", "3",
                            "--n-samples-per-prompt", "2")
    source = hooks.slime_data_source(config=config, tokenizer=load_tokenizer(str(tiny_hf_checkpoint)),
                                     buffer_filter=buffer_filter(hooks, config))
    env = plugin.environment(config)
    assert (env.action_field, env.observation_field) == ("message", "text")
    assert len(source) == 3 and config.rollout_max_response_len == plugin.QUICKSTART["rollout_max_response_len"]
    groups = source.get_samples(3)
    assert sorted(g[0].metadata["openenv"]["seed"] for g in groups) == [0, 1, 2]
    assert all(len(g) == 2 and g[0].metadata == g[1].metadata for g in groups)


def test_a_running_server_is_used_by_url_and_its_process_stopped():
    server = ServerProcess(plugin.EXAMPLE_APP).start()
    try:
        _, config = _config("--openenv-url", server.url)
        env = plugin.environment(config)
        assert env.url() == server.url and env.server is None  # nothing started for a URL
        assert (env.action_field, env.observation_field) == ("message", "text")
    finally:
        server.stop()
    with pytest.raises(httpx.HTTPError):
        httpx.get(server.url + "/health", timeout=2.0)


def test_the_server_stops_itself_when_the_process_that_started_it_is_killed():
    import os
    import signal
    import subprocess
    import time

    from slimecore.testing import timeout

    starter = subprocess.Popen(
        [sys.executable, "-c", "import time; from slime_openenv.environment import ServerProcess; "
         f"s = ServerProcess({plugin.EXAMPLE_APP!r}).start(); print(s.url, s.process.pid, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        url, pid = starter.stdout.readline().split()
        assert httpx.get(url + "/health", timeout=5.0).status_code == 200
    finally:
        starter.send_signal(signal.SIGKILL)  # as Ray kills a failed actor: no shutdown hook runs
        starter.wait()
    def running() -> bool:  # a zombie left for a non-reaping init counts as gone
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + timeout(15)
    while time.monotonic() < deadline and running():
        time.sleep(0.2)
    assert not running(), "the orphaned OpenEnv server kept running"
