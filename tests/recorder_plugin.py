"""A test plugin that records which processes load it and which lifecycle hooks run."""

import json
import os

from slimecore import hookimpl
from slimecore.config import Option


def _write(config, **event):
    with open(config.plugin("recorder_plugin").events_file, "a") as f:
        f.write(json.dumps({**event, "pid": os.getpid()}) + "\n")


@hookimpl
def slime_options():
    return [Option("events_file", str, None, "Where the recorder appends its events.")]


@hookimpl
def slime_startup(config, process):
    _write(config, event="startup", process=process)


@hookimpl
def slime_shutdown(config, process):
    _write(config, event="shutdown", process=process)


@hookimpl
def slime_process_sample(config, sample):
    sample.metadata["seen_by_recorder"] = True


@hookimpl
def slime_log_rollout(config, rollout_id, samples, metrics):
    metrics["recorder/all_samples_processed"] = float(all(s.metadata.get("seen_by_recorder") for s in samples))


@hookimpl
def slime_rollout_data_postprocess(config, rollout_id, batch):
    _write(config, event="postprocess", rollout_id=rollout_id, samples=len(batch["tokens"]),
           has_advantages="advantages" in batch)


@hookimpl
def slime_step_end(config, rollout_id, metrics):
    metrics["recorder/step_end"] = float(rollout_id)
