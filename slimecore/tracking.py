"""Metrics sinks: a JSONL file (always), TensorBoard (default on), Weights & Biases (when asked and installed).

Metric names follow slime's (``rollout/raw_reward``, ``perf/step_time``, ``train/pg_loss`` ...), and
each record carries ``rollout/step`` and ``train/step`` axes so dashboards carry over.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import ray

from slimecore.config import Config
from slimecore.plotting import plot_run
from slimecore.raytools import session_logs
from slimecore.runs import (config_yaml, create_run_dir, link_ray_logs, read_metrics, record_command, summarize,
                            write_summary)


class Tracker:
    """The run folder's sinks (``slimecore.runs``): makes the folder and its ``config.yaml``; ``close`` adds
    ``curves.png`` and ``summary.json``."""

    def __init__(self, config: Config, active_plugins: list[str] | None = None):
        self.dir = create_run_dir(config)
        self.config, self.start = config, record_command(self.dir)  # the summary's time counts the whole command
        if ray.is_initialized():
            link_ray_logs(self.dir, session_logs())
        self.jsonl = (self.dir / "metrics.jsonl").open("a")
        self.tb = self.wandb = None
        if config.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        if config.use_wandb:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("--use-wandb needs the wandb package: pip install 'slime-core[wandb]'") from None
            self.wandb = wandb.init(project=config.wandb_project, group=config.wandb_group, mode=config.wandb_mode,
                                    config=config.to_dict(), dir=str(self.dir))
        loaded = "".join(f"#   {p}\n" for p in active_plugins or [])
        (self.dir / "config.yaml").write_text(config_yaml(config) + (f"# plugins loaded:\n{loaded}" if loaded else ""))

    def log(self, metrics: dict[str, float], rollout_id: int) -> None:
        record = {"rollout/step": rollout_id, "train/step": rollout_id, "time": time.time()}
        record.update({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)})
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb:
            for key, value in record.items():
                if key != "time":
                    self.tb.add_scalar(key, value, rollout_id)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(record)

    def close(self, completed: bool, final_model: Path | None = None) -> dict:
        """Close the sinks, draw ``curves.png`` and write ``summary.json``; return the summary."""
        self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        paths = {"run": str(self.dir), "metrics": str(self.dir / "metrics.jsonl")}
        if final_model:
            paths["final_model"] = str(final_model)
        if self.config.save:
            paths["checkpoints"] = str(self.config.save)
        if (self.dir / "samples.jsonl").is_file():
            paths["samples"] = str(self.dir / "samples.jsonl")
        if read_metrics(self.dir):
            paths["curves"] = str(plot_run(self.dir))
        summary = summarize(self.dir, time.time() - self.start, paths)
        summary["completed"] = completed
        write_summary(self.dir, summary)
        return summary
