"""Shared test set-up: no hub, no Ray auth prompt, one thread per process; engine/Ray fixtures."""

import os

for _key, _value in {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1",
                     "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _value)

from fixtures_engine import *  # noqa: E402,F401,F403  (ray_session, tiny_checkpoint, engine fixtures)
from agent_toolmodel import tool_checkpoint  # noqa: E402,F401  (a tiny model taught to call a tool)
