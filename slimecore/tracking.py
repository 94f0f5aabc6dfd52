"""Metrics sinks: a JSONL file (always), TensorBoard (default on), Weights & Biases (when asked and installed).

Metric names follow slime's (``rollout/raw_reward``, ``perf/step_time``, ``train/pg_loss`` ...), and
each record carries ``rollout/step`` and ``train/step`` axes so dashboards carry over.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from slimecore.config import Config


class Tracker:
    def __init__(self, config: Config, active_plugins: list[str] | None = None):
        self.dir = Path(config.log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
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
        (self.dir / "config.json").write_text(json.dumps(
            {**config.to_dict(), "active_plugins": active_plugins or []}, indent=1, default=str))

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

    def close(self) -> None:
        self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
