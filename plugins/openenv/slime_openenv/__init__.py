"""OpenEnv environments for slime-core (see ``slime_openenv.plugin``)."""
