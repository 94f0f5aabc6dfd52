"""slimecore.rollout."""
