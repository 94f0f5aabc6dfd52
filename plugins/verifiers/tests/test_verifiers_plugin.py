"""The plugin with the real verifiers package: discovery and contract, start-up checks before Ray, the data source,
and the runtime that runs harness programs on this interpreter."""

import asyncio

import pytest
from click.testing import CliRunner

from slime_verifiers import plugin
from slime_verifiers.runtime import LocalInterpreterRuntime, MissingProgramDependencies, script_dependencies
from slimecore.config import ConfigError, parse_config
from slimecore.plugins import installed_entry_points, load_plugins
from slimecore.testing.contract import check_plugin_contract
from slimecore_cli.main import cli

HOOKS = ["slime_agent", "slime_data_source", "slime_log_rollout", "slime_options", "slime_quickstart_options",
         "slime_validate_config"]


def _config(*argv):
    hooks = load_plugins(["verifiers"])
    config = parse_config(list(argv), ["verifiers"], hooks.slime_options(), hooks.slime_implied_options(),
                          hooks.slime_quickstart_options())
    hooks.slime_validate_config(config=config)
    return hooks, config


def test_discovered_with_its_hooks():
    assert "verifiers" in installed_entry_points()
    hooks = load_plugins(["verifiers"])
    info = next(p for p in hooks.plugins if p.name == "verifiers")
    assert info.hooks == HOOKS and info.distribution == "slime-core-verifiers"
    assert check_plugin_contract("verifiers") == HOOKS
    assert hooks.plugin_name(hooks.answerer("slime_data_source")) == "verifiers"
    result = CliRunner().invoke(cli, ["plugins"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    row = next(line for line in result.output.splitlines() if "slime-core-verifiers" in line)
    assert "agent, data_source, log_rollout, options, quickstart_options, validate_config" in row


@pytest.mark.parametrize("argv, message", [
    (["--vf-env", "no_such_taskset"], "taskset 'no_such_taskset' not found"),
    (["--vf-env-args", '{"num_taskz": 3}'], "num_taskz"),
    (["--vf-env-args", "[1]"], "must be a JSON object"),
    (["--vf-env-args", '{"num_tasks": 0}'], "has no tasks"),
    (["--vf-harness", "no_such_harness"], "harness 'no_such_harness' not found"),
    (["--vf-num-tasks", "0"], "--vf-num-tasks must be at least 1"),
    (["--prompt-data", "x.jsonl", "--rollout-batch-size", "2"], "drop --prompt-data"),
    (["--vf-env", "vf_two_agent_env"], "TwoAgentEnv, a multi-agent Env"),  # tests/vf_two_agent_env.py
    (["--vf-env", "vf_shared_tools_taskset"], "taskset-scoped \\(shared\\) tool servers"),
])
def test_bad_flags_are_start_up_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _config(*argv)


def test_the_cli_reports_them_before_ray_starts():
    result = CliRunner().invoke(cli, ["train", "--plugin", "verifiers", "--vf-env", "no_such_taskset"])
    assert result.exit_code == 2 and "no_such_taskset" in result.output


def test_one_prompt_group_per_task(tiny_hf_checkpoint):
    from slimecore.hf_checkpoint import load_tokenizer
    from slimecore.rollout.hook_args import buffer_filter

    hooks, config = _config("--hf-checkpoint", str(tiny_hf_checkpoint), "--vf-env-args", '{"num_tasks": 3}',
                            "--n-samples-per-prompt", "2")
    source = hooks.slime_data_source(config=config, tokenizer=load_tokenizer(str(tiny_hf_checkpoint)),
                                     buffer_filter=buffer_filter(hooks, config))
    env = plugin.environment(config)
    assert len(source) == 3 and config.rollout_max_response_len == plugin.QUICKSTART["rollout_max_response_len"]
    groups = source.get_samples(3)
    assert sorted(g[0].metadata["verifiers"]["task"] for g in groups) == [0, 1, 2]
    for group in groups:
        task = env.tasks[group[0].metadata["verifiers"]["task"]]
        assert len(group) == 2 and all(task.data.prompt in s.prompt for s in group)
        assert group[0].metadata["verifiers"]["key"] == task.key


def test_harness_programs_run_on_this_interpreter_and_missing_packages_are_named(tmp_path):
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

    assert "mcp==2.0.0" in script_dependencies(CHAT_PROGRAM_SOURCE)
    runtime = LocalInterpreterRuntime(name="slime-test-runtime")

    async def run(script):
        await runtime.start()
        try:
            argv = await runtime.prepare_uv_script(script)
            return await runtime.run([*argv], {})
        finally:
            await runtime.stop()

    ok = '# /// script\n# dependencies = ["openai"]\n# ///\nimport sys, openai\nprint(sys.executable)\n'
    import sys

    assert asyncio.run(run(ok)).stdout.strip() == sys.executable
    runtime = LocalInterpreterRuntime(name="slime-test-runtime-2")
    missing = '# /// script\n# dependencies = ["no-such-package-xyz>=1"]\n# ///\nprint(1)\n'
    with pytest.raises(MissingProgramDependencies, match="no-such-package-xyz>=1"):
        asyncio.run(run(missing))


def test_the_agent_follows_the_session_server():
    from types import SimpleNamespace

    _, config = _config("--vf-env-args", '{"num_tasks": 2}')
    env = plugin.environment(config)
    first = SimpleNamespace(base_url="http://127.0.0.1:1/v1", model="m")
    again = env.agent(first, {"max_tokens": 8})
    assert env.agent(first, {"max_tokens": 8}) is again and again.ctx.client.base_url == first.base_url
    moved = env.agent(SimpleNamespace(base_url="http://127.0.0.1:2/v1", model="m"), {"max_tokens": 8})
    assert moved is not again and moved.ctx.client.base_url == "http://127.0.0.1:2/v1"
    assert moved.config.harness.id == "null" and moved.config.sampling.max_tokens == 8
