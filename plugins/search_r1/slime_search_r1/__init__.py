"""Search-R1 multi-turn environment for slime-core (options so far)."""
