"""Shared test set-up: no hub, no Ray auth prompt, one thread per process; engine/Ray fixtures."""

import os

for _key, _value in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
                     "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

from fixtures_engine import *  # noqa: E402,F401,F403  (ray_session, tiny_checkpoint, engine fixtures)
from agent_toolmodel import tool_checkpoint  # noqa: E402,F401  (a tiny model taught to call a tool)


def pytest_collection_modifyitems(config, items):
    """pytest-timeout's limit per test (``timeout`` in pyproject.toml) scales with SLIMECORE_TEST_TIMEOUT_SCALE,
    as every wait inside the tests does; a test's own ``timeout`` mark is left as it is."""
    import pytest

    from slimecore.testing import timeout

    limit = float(config.getini("timeout") or 0)
    if not limit or timeout(1) == 1:
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(timeout(limit)))
