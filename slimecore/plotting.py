"""A run's curves as one PNG: ``slime-core plot RUN`` and ``curves.png`` in every run folder.

The default panels are the reward, the response length, the step time (with its rollout / train / weight-sync
parts) and the KL, by step; ``--metric`` picks any keys of ``metrics.jsonl`` instead (one panel each).
"""

from __future__ import annotations

from pathlib import Path

from slimecore.runs import read_metrics

# panel title -> the metrics.jsonl keys drawn in it (those a run logged)
PANELS: dict[str, list[str]] = {
    "reward": ["rollout/raw_reward"],
    "response length (tokens)": ["rollout/response_length"],
    "step time (s)": ["perf/step_time", "perf/rollout_time", "perf/actor_train_time", "perf/update_weights_time"],
    "KL": ["train/ppo_kl", "train/kl_loss"],
}
ALIASES = {"reward": "reward", "length": "response length (tokens)", "response_length": "response length (tokens)",
           "step_time": "step time (s)", "time": "step time (s)", "kl": "KL"}


def panels_for(metrics: list[str] | None, records: list[dict]) -> dict[str, list[str]]:
    """The panels to draw: the defaults, or one per ``--metric`` (a key of metrics.jsonl or an alias)."""
    if not metrics:
        return PANELS
    logged = sorted({k for r in records for k in r})
    chosen: dict[str, list[str]] = {}
    for name in metrics:
        if name in ALIASES:
            chosen[ALIASES[name]] = PANELS[ALIASES[name]]
        elif name in logged:
            chosen[name] = [name]
        else:
            import difflib

            hint = difflib.get_close_matches(name, logged + list(ALIASES), n=3)
            raise ValueError(f"metric {name!r} was never logged by this run" + (f"; close: {', '.join(hint)}" if hint
                             else "") + f"; aliases: {', '.join(ALIASES)}; every key is in metrics.jsonl")
    return chosen


def plot_run(run_dir: str | Path, output: str | Path | None = None, metrics: list[str] | None = None) -> Path:
    """Draw ``run_dir``'s metrics by step into ``output`` (default ``run_dir/curves.png``); return its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}: no finished step in metrics.jsonl yet, nothing to plot")
    panels = panels_for(metrics, records)
    columns = 2 if len(panels) > 1 else 1
    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.4 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels.items()):
        drawn = 0
        for key in keys:
            points = [(r["rollout/step"] + 1, r[key]) for r in records if key in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(xs) <= 40 else None, markersize=3, label=key.split("/", 1)[-1])
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
        elif drawn > 1:
            ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(run_dir.resolve().name, fontsize=10)
    fig.tight_layout()
    output = Path(output) if output else run_dir / "curves.png"
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
