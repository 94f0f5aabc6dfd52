"""slime-core shim: ``slime.backends.megatron_utils``."""
