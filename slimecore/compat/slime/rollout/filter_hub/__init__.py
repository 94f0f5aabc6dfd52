"""slime-core shim: ``slime.rollout.filter_hub``."""
