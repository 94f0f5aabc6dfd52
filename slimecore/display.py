"""What ``slime-core train`` shows while it runs, and the summary at the end.

On a terminal: a live bar over the steps with the ETA, the stage running now (generate / train / sync / save /
eval / export) and the last step's reward, response length and step time; each finished step also leaves a
line above the bar. When the output is not a terminal (a log file, CI, ``| tee``) the same step lines are printed
plainly, with no control characters, after a line per stage of the start-up and the first step (the long
waits); ``--log-level debug`` adds a line per stage of every step, ``warning`` keeps only the summary.
"""

from __future__ import annotations

import logging
import sys

from typing import Sequence

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Column, Table
from rich.text import Text

STAGES = {"generate": "generating", "train": "training", "sync": "syncing weights", "save": "saving a checkpoint",
          "eval": "evaluating", "export": "writing the final model"}
STEP_KEYS = [("reward", "rollout/raw_reward"), ("len", "rollout/response_length"), ("loss", "train/loss"),
             ("kl", "train/ppo_kl"), ("lp_diff", "train/train_rollout_logprob_abs_diff")]
TIME_KEYS = [("rollout", "perf/rollout_time"), ("train", "perf/actor_train_time"), ("step", "perf/step_time")]


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}h" if hours else "") + (f"{rest // 60}m" if seconds >= 60 else "") + f"{rest % 60:02d}s"


def step_line(rollout_id: int, total: int, metrics: dict, eta: float | None) -> str:
    parts = [f"{name}={metrics[key]:.4g}" for name, key in STEP_KEYS if key in metrics]
    parts += [f"{name} {metrics[key]:.1f}s" for name, key in TIME_KEYS if key in metrics]
    parts += [f"{k}={v:.3f}" for k, v in metrics.items() if k.startswith("eval/") and not k.endswith("ratio")]
    if eta is not None:
        parts.append(f"ETA {duration(eta)}")
    return f"[bold]step {rollout_id + 1}/{total}[/] " + "  ".join(parts)


def fit_table(table: Table, width: int, drop: Sequence[str] = ()) -> Table:
    """Make ``table`` fit ``width`` terminal columns without cutting a word: each column is at least as wide as
    its longest word, so a cell wraps between words and is never shortened to "…"; while the table would still
    be wider than ``width``, the columns named in ``drop`` (by header) go, in that order, then the rightmost
    ones but the first (``--json`` has them all). The room left goes to the columns needing least first, so short cells stay on one line. Returns
    ``table``, changed in place."""
    def lines(column) -> list[str]:
        cells = [column.header, *column._cells]
        return [line for t in cells for line in (t.plain if isinstance(t, Text) else Text.from_markup(str(t)).plain)
                .splitlines()]

    def room() -> int:  # the cells' width, borders and padding taken off
        return width - table._extra_width - sum(2 for _ in table.columns)

    words = {id(c): max((cell_len(w) for line in lines(c) for w in line.split()), default=1) for c in table.columns}
    headers = list(drop) + [c.header for c in reversed(table.columns[1:]) if c.header not in drop]
    for header in headers:  # the named columns, then (a last resort) the rightmost ones
        if sum(words[id(c)] for c in table.columns) <= room():
            break
        table.columns[:] = [c for c in table.columns if c.header != header]
    natural = {id(c): max((cell_len(line) for line in lines(c)), default=1) for c in table.columns}
    if sum(natural.values()) <= room():
        return table  # fits as it is
    spare = max(0, room() - sum(words[id(c)] for c in table.columns))
    by_need = sorted(table.columns, key=lambda c: natural[id(c)] - words[id(c)])
    for column in by_need:  # the columns needing least are made whole first; the widest wraps
        key = id(column)
        extra = min(natural[key] - words[key], spare)
        column.width, column.overflow = words[key] + extra, "fold"
        spare -= extra
    return table


def _reroute_log_handlers(streams: tuple, target) -> list[tuple[logging.StreamHandler, object]]:
    """Point the console log handlers made before the bar (Ray's, the driver's) at ``target``, the live
    display's stream, so that their lines go above the bar instead of through it; return what to restore."""
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    moved = []
    for handler in {h for lg in loggers for h in lg.handlers}:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) \
                and handler.stream in streams:
            moved.append((handler, handler.setStream(target)))
    return moved


class RunDisplay:
    """The loop's ``on_stage`` / ``on_step`` callbacks, drawn live or as plain lines."""

    def __init__(self, console: Console, total: int | None, level: str = "info", live: bool | None = None):
        self.console, self.total = console, total
        self.level = logging.getLevelName(level.upper())
        self.live = console.is_terminal and sys.stdout.isatty() if live is None else live
        self.step_times: list[float] = []
        self.progress: Progress | None = None
        self.task = None
        self.rerouted: list = []
        self.seen_step = False  # until the first step ends, plain output says each stage it waits for

    def __enter__(self) -> "RunDisplay":
        if self.live:
            whole = Column(no_wrap=True)  # the step count, the times: never cut; the bar and the last step's
            self.progress = Progress(  # figures give way on a narrow terminal (80 columns)
                SpinnerColumn(), TextColumn("[bold]{task.fields[stage]:<24}", table_column=Column(no_wrap=True)),
                BarColumn(bar_width=None, table_column=Column(ratio=1, min_width=5)),
                MofNCompleteColumn(table_column=whole), TimeElapsedColumn(table_column=whole),
                TextColumn("{task.fields[eta]}", table_column=whole),
                TextColumn("{task.fields[last]}", table_column=Column(ratio=2, no_wrap=True, overflow="ellipsis")),
                console=self.console, redirect_stdout=True, redirect_stderr=True, expand=True)
            streams = (sys.stdout, sys.stderr)
            self.progress.start()  # from here sys.stdout / sys.stderr print above the bar
            self.rerouted = _reroute_log_handlers(streams, sys.stderr)
            self.task = self.progress.add_task("steps", total=self.total, stage="starting engines and trainers",
                                               eta="", last="")
        elif self.level <= logging.INFO:  # the start-up's wait, said once in plain output too
            self.console.print("starting engines and trainers (Ray, the router, the model on every process)",
                               highlight=False)
        return self

    def __exit__(self, *exc) -> None:
        if self.progress:
            for handler, stream in self.rerouted:
                handler.setStream(stream)
            self.progress.update(self.task, stage="done" if exc[0] is None else "stopped")
            self.progress.stop()

    def stage(self, name: str, rollout_id: int) -> None:
        words = STAGES.get(name, name)
        label = f"step {rollout_id + 1}: {words}" if name != "export" else words
        if self.progress:
            self.progress.update(self.task, stage=label)
        elif self.level <= logging.DEBUG or (self.level <= logging.INFO and (not self.seen_step or name == "export")):
            self.console.print(f"[dim]{escape(label)}[/]", highlight=False)  # the first step's and the end's waits

    def eta(self, done: int, total: int) -> float | None:
        """Mean step time so far times the steps left (start-up is not a step)."""
        if not self.step_times:
            return None
        return sum(self.step_times) / len(self.step_times) * (total - done)

    def step(self, rollout_id: int, total: int, metrics: dict) -> None:
        self.seen_step = True
        if "perf/step_time" in metrics:
            self.step_times.append(metrics["perf/step_time"])
        eta = self.eta(rollout_id + 1, total)
        if self.level <= logging.INFO:
            self.console.print(step_line(rollout_id, total, metrics, eta), highlight=False)
        if self.progress:
            last = "  ".join(f"{name} {metrics[key]:.3g}" for name, key in
                             [("reward", "rollout/raw_reward"), ("len", "rollout/response_length")] if key in metrics)
            if "perf/step_time" in metrics:
                last += f"  step {metrics['perf/step_time']:.1f}s"
            self.progress.update(self.task, total=total, completed=rollout_id + 1, last=last,
                                 eta=f"ETA {duration(eta)}" if eta is not None else "")

    def summary(self, summary: dict) -> None:
        """The end-of-run table (steps, reward first -> last quarter, the whole command's time), then where
        everything is, one path a line outside the table so that no path is ever split (copy it whole)."""
        table = Table(title="run " + ("finished" if summary.get("completed") else "stopped"), show_header=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        table.add_row("steps", str(summary["steps"]))
        if "reward_first_quarter" in summary:
            first, last = summary["reward_first_quarter"], summary["reward_last_quarter"]
            table.add_row("reward (first -> last quarter)", f"{first:.3f} -> {last:.3f} ({last - first:+.3f})")
        wall = summary.get("wall_seconds")
        if wall is not None:
            table.add_row("time (whole command)", duration(wall) + (
                f" (median step {summary['step_time_median']:.1f}s)" if "step_time_median" in summary else ""))
        self.console.print(fit_table(table, self.console.width))
        paths = summary.get("paths", {})
        for key, label in [("run", "run folder"), ("final_model", "trained model (HF)"), ("curves", "curves"),
                           ("samples", "samples"), ("metrics", "metrics"), ("checkpoints", "checkpoints")]:
            if key in paths:
                self.console.print(f"[bold]{label}:[/] {escape(paths[key])}", highlight=False, soft_wrap=True)
        if "final_model" in paths:
            self.console.print(f"load it: AutoModelForCausalLM.from_pretrained({paths['final_model']!r}); look at "
                               f"the curves: slime-core plot {paths['run']} (or open {paths.get('curves', '')})",
                               highlight=False, soft_wrap=True)
