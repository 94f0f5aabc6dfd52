"""slime-core shim of ``slime.utils.types``: ``Sample`` is slime-core's own, with slime's field names, statuses
(``Sample.Status.COMPLETED`` ...) and methods (``get_reward_value(args)``, ``append_response_tokens(args,
tokens=..., log_probs=..., meta_info=...)``). slime's ``spec_info`` / ``prefix_cache_info`` are not kept."""

from slimecore.types import Sample

__all__ = ["Sample"]
