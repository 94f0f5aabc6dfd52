"""The shipped example OpenEnv environment: guess a secret number with higher/lower feedback (``server.app``)."""
