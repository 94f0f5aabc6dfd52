"""The plugin manager: discovery, start-up errors (each naming the plugin/hook and the remedy), calls."""

from __future__ import annotations

import asyncio
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slimecore import hookimpl
from slimecore.config import Config
from slimecore.plugins import HookCallError, PluginError, installed_entry_points, load_plugins
from slimecore.types import Sample

ROOT = Path(__file__).resolve().parents[1]


def write_plugin(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text("from slimecore import hookimpl\n" + textwrap.dedent(body))
    return str(path)


def test_unknown_plugin_lists_installed_and_says_what_to_do():
    with pytest.raises(PluginError) as err:
        load_plugins(["grpoo"])
    message = str(err.value)
    assert "unknown plugin 'grpoo'" in message and "did you mean 'grpo'" in message
    assert "Installed plugins:" in message and "slime-core plugins" in message


def test_import_failure_names_plugin_and_cause(tmp_path):
    spec = write_plugin(tmp_path, "broken", "import does_not_exist_anywhere\n")
    with pytest.raises(PluginError) as err:
        load_plugins([spec])
    assert "broken" in str(err.value) and "does_not_exist_anywhere" in str(err.value)
    assert "Fix the error in the plugin" in str(err.value)


def test_missing_file_plugin(tmp_path):
    with pytest.raises(PluginError, match="does not exist"):
        load_plugins([str(tmp_path / "nope.py")])


def test_misspelled_hook_suggests_the_right_name(tmp_path):
    spec = write_plugin(tmp_path, "typo", """
        @hookimpl
        async def slime_rewrad(config, sample):
            return 1.0
    """)
    with pytest.raises(PluginError) as err:
        load_plugins([spec])
    assert "'typo'" in str(err.value) and "slime_rewrad" in str(err.value) and "did you mean 'slime_reward'" in str(err.value)


def test_undecorated_hook_is_an_error(tmp_path):
    spec = write_plugin(tmp_path, "plain", """
        async def slime_reward(config, sample):
            return 1.0
    """)
    with pytest.raises(PluginError, match="without @slimecore.hookimpl"):
        load_plugins([spec])


def test_parameter_not_in_spec(tmp_path):
    spec = write_plugin(tmp_path, "badargs", """
        @hookimpl
        async def slime_reward(config, sample, tokenizer):
            return 1.0
    """)
    with pytest.raises(PluginError) as err:
        load_plugins([spec])
    assert "badargs" in str(err.value) and "tokenizer" in str(err.value) and "slime-core hooks" in str(err.value)


def test_required_hook_without_answer():
    hooks = load_plugins([])  # defaults only: nothing answers slime_loss / slime_compute_advantages
    with pytest.raises(PluginError) as err:
        hooks.check()
    assert "slime_compute_advantages" in str(err.value) and "--plugin grpo" in str(err.value)
    hooks.check(skip_required=["slime_compute_advantages", "slime_loss"])


def test_two_plugins_answering_a_one_answer_hook(tmp_path):
    # (slime_reward is the exception: several reward plugins are combined, see tests/test_reward_weights.py)
    body = "@hookimpl\ndef slime_post_process_rewards(config, samples):\n    return [], []\n"
    a, b = write_plugin(tmp_path, "post_a", body), write_plugin(tmp_path, "post_b", body)
    hooks = load_plugins([a, b])
    with pytest.raises(PluginError) as err:
        hooks.check(skip_required=["slime_compute_advantages", "slime_loss"])
    assert "'post_b'" in str(err.value) and "'post_a'" in str(err.value) and "slime_post_process_rewards" in str(err.value)
    assert "activate only one" in str(err.value)


def test_a_plugin_replaces_the_default_and_errors_name_plugin_and_hook(tmp_path):
    spec = write_plugin(tmp_path, "custom", """
        @hookimpl
        async def slime_reward(config, sample):
            if sample.label == "boom":
                raise RuntimeError("reward service down")
            return 0.25
    """)
    hooks = load_plugins([spec])
    assert hooks.plugin_name(hooks.answerer("slime_reward")) == "custom"
    config = Config.make()
    assert asyncio.run(hooks.slime_reward(config=config, sample=Sample(label="x"))) == 0.25
    with pytest.raises(HookCallError) as err:
        asyncio.run(hooks.slime_reward(config=config, sample=Sample(label="boom")))
    assert err.value.plugin == "custom" and err.value.hook == "slime_reward" and "reward service down" in str(err.value)


def test_sync_hook_error_and_none_answer(tmp_path):
    class Bad:
        @hookimpl
        def slime_post_process_rewards(self, config, samples):
            raise KeyError("label")

    hooks = load_plugins([], extra=[Bad()])
    with pytest.raises(HookCallError, match="raised in slime_post_process_rewards: KeyError"):
        hooks.slime_post_process_rewards(config=Config.make(), samples=[])

    class Silent:
        @hookimpl
        def slime_post_process_rewards(self, config, samples):
            return None  # pluggy's firstresult: None passes the call on, here to the built-in default

        @hookimpl
        def slime_loss(self, config, role, batch, outputs, reducer):
            return None  # ... and here to nobody

    silent = load_plugins([], extra=[Silent()])
    assert silent.slime_post_process_rewards(config=Config.make(), samples=[Sample(reward=1.0)]) == ([1.0], [1.0])
    with pytest.raises(PluginError, match="plugin 'Silent': slime_loss returned None; it must return an answer"):
        silent.slime_loss(config=Config.make(), role="actor", batch={}, outputs={}, reducer=sum)


def test_file_plugin_is_called_when_active():
    spec = str(ROOT / "examples" / "my_reward.py")
    hooks = load_plugins([spec])
    assert hooks.plugin_name(hooks.answerer("slime_reward")) == "my_reward"
    sample = Sample(label="42", response="It is 42")
    assert asyncio.run(hooks.slime_reward(config=Config.make(), sample=sample)) == 1.0


def _install_example():
    if "my_reward" not in installed_entry_points():
        # a regular (not editable) install lands in site-packages, importable from this process at once
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-c",
                        str(ROOT / ".ci" / "constraints.txt"), str(ROOT / "examples" / "my-reward-plugin")],
                       check=True)
        importlib.invalidate_caches()


def test_pip_installed_plugin_is_discovered_listed_and_called():
    _install_example()
    assert "my_reward" in installed_entry_points()
    listing = subprocess.run([sys.executable, "-m", "slimecore_cli", "plugins", "--json"], capture_output=True,
                             text=True, check=True)
    import json

    rows = {row["name"]: row for row in json.loads(listing.stdout)}
    assert rows["my_reward"]["distribution"] == "my-reward-plugin"
    assert rows["my_reward"]["hooks"] == ["slime_options", "slime_reward"]
    hooks = load_plugins(["my_reward"])
    options = hooks.slime_options()["my_reward"]
    config = Config.make(plugin_values={"my_reward": {o.name: o.default for o in options} | {"length_penalty": 0.01}})
    got = asyncio.run(hooks.slime_reward(config=config, sample=Sample(label="7", response="7 apples")))
    assert got == pytest.approx(1.0 - 0.08)


def test_allow_and_deny_lists(monkeypatch):
    monkeypatch.setenv("SLIMECORE_BLOCK_PLUGINS", "grpo")
    assert "grpo" not in installed_entry_points()
    with pytest.raises(PluginError, match="unknown plugin 'grpo'"):
        load_plugins(["grpo"])
    monkeypatch.delenv("SLIMECORE_BLOCK_PLUGINS")
    monkeypatch.setenv("SLIMECORE_LOAD_PLUGINS", "grpo")
    assert list(installed_entry_points()) == ["grpo"]


def test_hook_tracing(monkeypatch, capsys):
    monkeypatch.setenv("SLIMECORE_TRACE_HOOKS", "1")
    hooks = load_plugins([])
    hooks.slime_post_process_rewards(config=Config.make(), samples=[Sample(reward=1.0)])
    assert "[slimecore hook] slime_post_process_rewards -> slimecore.defaults.rollout" in capsys.readouterr().err


class LlamaBridge:
    @hookimpl
    def slime_model_bridge(self, config, hf_config):
        return "llama-bridge" if hf_config.architectures == ["LlamaForCausalLM"] else None


class QwenBridge:
    @hookimpl
    def slime_model_bridge(self, config, hf_config):
        return "qwen-bridge" if hf_config.architectures == ["Qwen2ForCausalLM"] else None


def test_first_answer_hooks_let_several_plugins_coexist():
    """slime_model_bridge: each bridge plugin answers for the architectures it knows."""
    import types

    hooks = load_plugins([], extra=[LlamaBridge(), QwenBridge()])
    hooks.check(skip_required=["slime_compute_advantages", "slime_loss"])  # no conflict: first answer wins
    arch = lambda name: types.SimpleNamespace(architectures=[name])  # noqa: E731
    assert hooks.slime_model_bridge(config=Config.make(), hf_config=arch("Qwen2ForCausalLM")) == "qwen-bridge"
    assert hooks.slime_model_bridge(config=Config.make(), hf_config=arch("LlamaForCausalLM")) == "llama-bridge"
    assert hooks.slime_model_bridge(config=Config.make(), hf_config=arch("GPT2LMHeadModel")) is None


class Doubling:
    @hookimpl(wrapper=True)
    def slime_post_process_rewards(self, config, samples):
        raw, rewards = yield
        return raw, [2 * r for r in rewards]


class FirstBridge:
    @hookimpl(tryfirst=True)
    def slime_model_bridge(self, config, hf_config):
        return "first"


class LaterBridge:
    @hookimpl
    def slime_model_bridge(self, config, hf_config):
        return "later"


def test_pluggy_wrappers_and_ordering_decide():
    """The facade calls pluggy: a plugin's wrapper sees and replaces the answer (here the built-in default's,
    which pluggy calls last), and tryfirst beats pluggy's later-registered-first order."""
    hooks = load_plugins([], extra=[Doubling(), FirstBridge(), LaterBridge()])
    config = Config.make()
    assert hooks.slime_post_process_rewards(config=config, samples=[Sample(reward=1.5)]) == ([1.5], [3.0])
    assert hooks.slime_model_bridge(config=config, hf_config=None) == "first"
    assert [hooks.plugin_name(i) for i in hooks.implementers("slime_model_bridge")] == ["FirstBridge", "LaterBridge"]


def test_a_wrapper_that_raises_is_named():
    class BrokenWrapper:
        @hookimpl(wrapper=True)
        def slime_post_process_rewards(self, config, samples):
            yield
            raise ValueError("wrapper bug")

    hooks = load_plugins([], extra=[BrokenWrapper()])
    with pytest.raises(HookCallError) as err:
        hooks.slime_post_process_rewards(config=Config.make(), samples=[])
    assert err.value.plugin == "BrokenWrapper" and err.value.hook == "slime_post_process_rewards"


def test_two_agent_plugins_are_a_startup_error():
    class AgentA:
        @hookimpl
        async def slime_agent(self, config, sample, session):
            return None

    class AgentB(AgentA):
        pass

    hooks = load_plugins([], extra=[AgentA(), AgentB()])
    with pytest.raises(PluginError, match="plugins 'AgentB', 'AgentA' all implement slime_agent"):
        hooks.check(skip_required=["slime_compute_advantages", "slime_loss"])
