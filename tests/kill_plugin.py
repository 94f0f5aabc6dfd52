"""Test plugin: SIGKILLs the whole training run right after the step given by --kill-after-step
(after that step's checkpoint was written), as a crash or an OOM killer would."""

import os
import signal

from slimecore import hookimpl
from slimecore.config import Option


@hookimpl
def slime_options():
    return [Option("kill_after_step", int, -1, "Step after which the run kills itself.")]


@hookimpl
def slime_step_end(config, rollout_id):
    if rollout_id == config.plugin("kill_plugin").kill_after_step:
        os.killpg(os.getpgrp(), signal.SIGKILL)
