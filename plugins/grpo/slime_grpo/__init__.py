"""GRPO for slime-core: group-normalised rewards, a clipped surrogate, optional KL and entropy terms."""
