"""pytest fixtures shipped with slime-core for plugin authors (auto-loaded through the ``pytest11``
entry point). Import-light: torch and transformers load only when a fixture is used.

- ``slimecore_hooks(*plugins, defaults=True)``: the Hooks facade with these plugins active;
- ``make_sample(**fields)``: a Sample with a prompt and, optionally, a response;
- ``tiny_hf_checkpoint``: a random tiny Qwen2 model and tokenizer in a temporary directory;
- ``tiny_engine``: an embedded engine serving it (SGLang's HTTP API at ``tiny_engine.url``), one per module;
  ``slimecore.testing.engines.embedded_engine(checkpoint)`` serves any other checkpoint;
- ``agent_sessions``: OpenAI / Anthropic session endpoints in front of ``tiny_engine``
  (``slimecore.testing.sessions``): ``agent_sessions.open()`` gives an ``AgentSession`` for a ``slime_agent``
  hook, ``agent_sessions.finish(session)`` its samples.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def slimecore_hooks():
    from slimecore.plugins import load_plugins

    def build(*plugins, defaults: bool = True):
        specs = [p for p in plugins if isinstance(p, str)]
        objects = [p for p in plugins if not isinstance(p, str)]
        return load_plugins(specs, extra=objects, defaults=defaults)

    return build


@pytest.fixture
def make_sample():
    from slimecore.types import Sample

    def build(prompt_tokens=(1, 2, 3), response_tokens=(), log_probs=None, **fields):
        sample = Sample(tokens=list(prompt_tokens), **fields)
        if response_tokens:
            lps = list(log_probs) if log_probs is not None else [-1.0] * len(response_tokens)
            sample.append_response_tokens(list(response_tokens), lps, finish_reason="stop")
        return sample

    return build


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    from slimecore.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("slimecore-tiny"))


@pytest.fixture(scope="module")
def tiny_engine(tiny_hf_checkpoint):
    from slimecore.testing.engines import embedded_engine

    with embedded_engine(tiny_hf_checkpoint, max_batch_size=8) as server:
        yield server


@pytest.fixture(scope="module")
def agent_sessions(tiny_engine, tiny_hf_checkpoint):
    from slimecore.testing.sessions import agent_sessions

    with agent_sessions(tiny_engine.url, tiny_hf_checkpoint) as sessions:
        yield sessions
