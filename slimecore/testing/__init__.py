"""slimecore.testing: what plugin authors test with (fixtures in ``pytest_plugin``, ``tiny``, ``engines``,
``distributed``, ``contract``) and small helpers for checking samples."""

from __future__ import annotations

import os


def mask_runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` of each run of equal values in a loss mask: a multi-turn sample's model turns
    (1) and observations (0), in order."""
    found, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            found.append((mask[start], start, i))
            start = i
    return found


def timeout(seconds: float) -> float:
    """A test's wait or time limit, scaled by ``SLIMECORE_TEST_TIMEOUT_SCALE`` (default 1): set it, e.g. to 3,
    where the machine is busy, instead of editing the limits of single tests."""
    return seconds * float(os.environ.get("SLIMECORE_TEST_TIMEOUT_SCALE", "1") or 1)
