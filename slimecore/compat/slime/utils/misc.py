"""slime-core shim of ``slime.utils.misc``: ``load_function`` (dotted path, cached)."""

from slimecore.defaults.slime_compat import load_function

__all__ = ["load_function"]
