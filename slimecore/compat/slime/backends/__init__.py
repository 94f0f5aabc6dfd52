"""slime-core shim: ``slime.backends``."""
