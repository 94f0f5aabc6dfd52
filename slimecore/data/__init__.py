"""Prompts: files (``dataset``), built-in generated tasks (``tasks``) and the checkpointed data source (``source``)."""
