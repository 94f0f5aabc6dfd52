"""slime-core shim of ``slime.rollout.base_types``: what slime rollout functions return."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slimecore.types import Sample


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] = None


def call_rollout_fn(fn, *args, evaluation: bool, **kwargs):
    """Call a slime rollout function; a bare list (train) or dict (eval) is wrapped, as slime does."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if not isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        output = RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)
    return output


__all__ = ["RolloutFnTrainOutput", "RolloutFnEvalOutput", "call_rollout_fn"]
