"""slime-core shim: ``slime.rollout``."""
