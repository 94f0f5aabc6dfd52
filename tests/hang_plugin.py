"""Test plugin: the train rank's per-step hook never returns at the step given by --hang-at-step, as a
rank stuck in a collective or a deadlocked data loader would."""

import time

from slimecore import hookimpl
from slimecore.config import Option


@hookimpl
def slime_options():
    return [Option("hang_at_step", int, -1, "Step at which every train rank hangs.")]


@hookimpl
def slime_rollout_data_postprocess(config, rollout_id):
    if rollout_id == config.plugin("hang_plugin").hang_at_step:
        time.sleep(3600)
