"""Verifiers environments as a slime-core plugin (see plugin.py)."""
