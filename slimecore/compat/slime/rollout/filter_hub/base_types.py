"""slime-core shim of ``slime.rollout.filter_hub.base_types``: ``DynamicFilterOutput`` is slime-core's
``FilterResult`` (the same fields: ``keep``, ``reason``, ``keep_when_insufficient``)."""

from slimecore.types import FilterResult as DynamicFilterOutput

__all__ = ["DynamicFilterOutput"]
