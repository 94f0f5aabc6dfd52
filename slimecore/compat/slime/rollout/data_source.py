"""slime-core shim of ``slime.rollout.data_source``: the ``DataSource`` base class a ``--data-source-path`` class
derives from, and the default buffer filter ``pop_first``."""

from __future__ import annotations

import abc

from slimecore.types import Sample


class DataSource(abc.ABC):
    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """Return num_samples groups."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]):
        """Take groups back (aborted ones)."""

    @abc.abstractmethod
    def save(self, rollout_id):
        """Save the state (slime-core calls it at each checkpoint, under ``args.save``)."""

    @abc.abstractmethod
    def load(self, rollout_id=None):
        """Load the state saved at ``rollout_id``."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of prompts."""


def pop_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    num_to_pop = min(len(buffer), num_samples)
    samples = buffer[:num_to_pop]
    del buffer[:num_to_pop]
    return samples


__all__ = ["DataSource", "pop_first"]
