"""``slime-core runs`` and ``slime-core plot``: reading finished (and running) runs from their folders."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from slimecore.runs import RUNS_ROOT, list_run_dirs, plugin_label, resolve_run, run_info

console = Console(stderr=True, soft_wrap=True)
ROOT = click.option("--root", default=str(RUNS_ROOT), show_default=True, type=click.Path(file_okay=False),
                    help="Folder holding the run folders.")


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}")
    raise SystemExit(2)


def _reward(value) -> str:
    return "-" if value is None else f"{value:.3f}"


@click.group(invoke_without_command=True)
@ROOT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def runs(ctx, root, as_json):
    """List the runs under --root: start date, plugins, steps, final reward. `slime-core runs show RUN` for one."""
    if ctx.invoked_subcommand:
        return
    rows = [run_info(path) for path in list_run_dirs(Path(root))]
    if as_json:
        click.echo(json.dumps([{k: v for k, v in r.items() if k != "config"} for r in rows], indent=1))
        return
    if not rows:
        console.print(f"no runs under {root}/ yet: `slime-core train ...` makes one")
        return
    Console().print(runs_table(rows, root, Console().width))


def runs_table(rows: list[dict], root: str, width: int) -> Table:
    """The runs as a table that fits ``width`` columns: names whole (they are what `runs show` takes), the
    plugins, then the state and the start, dropped when it does not fit."""
    from slimecore.display import fit_table

    table = Table(title=f"runs in {root}/ (`slime-core runs show NAME`, `slime-core plot NAME`; --json: all)")
    for column in ("run", "started", "plugins", "steps", "final reward", "state"):
        table.add_column(column, no_wrap=column == "run")
    for r in rows:
        steps = f"{r['steps']}/{r['num_rollout']}" if r["num_rollout"] else str(r["steps"])
        state = "finished" if r["finished"] and r["summary"].get("completed") else \
            "stopped" if r["finished"] else "running or killed"
        table.add_row(escape(r["name"]), r["started"], escape(plugin_label(list(map(str, r["plugins"])))), steps,
                      _reward(r["final_reward"]), state)
    return fit_table(table, width, drop=("plugins", "state", "started"))


@runs.command("show")
@click.argument("run")
@ROOT
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (the run's row of `runs --json` "
              "with its config).")
def show(run, root, as_json):
    """A run's summary (steps, reward first -> last quarter, time, paths) and its config.yaml."""
    from slimecore.display import RunDisplay

    try:
        info = run_info(resolve_run(run, Path(root)))
    except FileNotFoundError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(info, indent=1, default=str))
        return
    out = Console()
    RunDisplay(out, None, live=False).summary({**info["summary"], "paths": {"run": info["path"],
                                                                          **info["summary"].get("paths", {})}})
    config = Path(info["path"]) / "config.yaml"
    if config.is_file():
        out.print(f"[bold]{escape(str(config))}[/]")
        if out.is_terminal:  # highlighted and wrapped, never cut at the terminal's edge
            out.print(Syntax(config.read_text(), "yaml", background_color="default", word_wrap=True))
        else:  # a pipe or a file: the file as it is, to copy or to replay
            click.echo(config.read_text(), nl=False)


@click.command()
@click.argument("run", default="latest")
@click.option("--metric", "metrics", multiple=True, help="A metrics.jsonl key or an alias (reward, length, "
              "step_time, kl); repeat for several panels. Default: reward, response length, step time, KL.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="PNG to write. Default: curves.png in the run folder.")
@ROOT
def plot(run, metrics, output, root):
    """Draw a run's curves by step into a PNG (RUN: a run folder, a name under --root, or latest)."""
    from slimecore.plotting import plot_run

    try:
        path = plot_run(resolve_run(run, Path(root)), output, list(metrics))
    except (FileNotFoundError, ValueError) as exc:
        _fail(exc)
    console.print(f"wrote {path}")
