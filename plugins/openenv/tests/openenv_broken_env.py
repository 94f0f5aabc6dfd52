"""Test environments that misbehave: ``crashing_app`` raises in step; ``exiting_app`` kills its server process on
the first step (as an environment that segfaults or runs out of memory would); ``tool_app`` has an action with two
required fields, which a text reply cannot fill."""

import os

from openenv.core.env_server import Action, create_app

from slime_openenv.guess.server import GuessAction, GuessEnvironment, GuessObservation


class CrashingEnvironment(GuessEnvironment):
    def step(self, action, timeout_s=None, **kwargs):
        raise ValueError("the board is on fire")


class ExitingEnvironment(GuessEnvironment):
    def step(self, action, timeout_s=None, **kwargs):
        os._exit(3)


class ToolAction(Action):
    tool: str
    arguments: str


crashing_app = create_app(CrashingEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)
exiting_app = create_app(ExitingEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)
tool_app = create_app(GuessEnvironment, ToolAction, GuessObservation, max_concurrent_envs=8)
