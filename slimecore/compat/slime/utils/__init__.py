"""slime-core shim: ``slime.utils``."""
