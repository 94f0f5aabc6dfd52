"""reasoning-gym tasks as a slime-core plugin (see plugin.py and the README)."""
