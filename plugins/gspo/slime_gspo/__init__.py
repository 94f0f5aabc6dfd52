"""GSPO for slime-core: GRPO's rewards and options with a sequence-level importance ratio."""
