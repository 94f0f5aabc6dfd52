"""The ``slime-core`` command line: train, plugins, hooks, data."""

from __future__ import annotations

import inspect
import json
import logging
import signal
import sys

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import slimecore
from slimecore.startup import prepare, validate

from slimecore.config import (CORE_BY_NAME, ConfigError, flag_text,
                              parse_config, prescan)
from slimecore.plugins import (SPECS, PluginError, installed_entry_points, load_plugins,
                               normalize_spec)

console = Console(stderr=True, soft_wrap=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(slimecore.__version__, prog_name="slime-core")
def cli():
    """slime-core: RL post-training with a minimal core; algorithms, models and environments are plugins."""


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {exc}")
    sys.exit(2)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                               "help_option_names": []})
@click.pass_context
def train(ctx):
    """Run RL (or SFT) training. `slime-core train --plugin grpo --help` lists every option,
    including those of the named plugins."""
    try:
        loaded = train_plugins(list(ctx.args))
        if {"--help", "-h", "--help-all"} & set(loaded[0]):
            from slimecore_cli.help import train_help, train_help_json

            every = "--help-all" in loaded[0]
            if "--json" in loaded[0]:  # the same options as objects (train_help_json's keys)
                click.echo(json.dumps(train_help_json(loaded[2], loaded[3], every), indent=1, default=str))
            else:
                click.echo(train_help(loaded[2], loaded[3], every=every), nl=False)
            return
        config, hooks, implied = train_config(loaded)
        _banner(config, hooks, implied)  # the first line within a second or two: the checks below take longer
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # other libraries: warnings only
        logging.getLogger("slimecore").setLevel(config.log_level.upper())
        # every check before Ray, the same as slimecore.loop.run's (slimecore.startup): a bad input fails within
        # seconds, before the loop's imports (Ray and the rest)
        prepared = prepare(config, hooks)
    except (ConfigError, PluginError, FileNotFoundError, ValueError) as exc:
        _fail(exc)
    from slimecore.display import RunDisplay
    from slimecore.loop import interrupted_by, run

    run_dir = prepared.run_dir
    console.print(f"run folder: {run_dir} (config.yaml replays this run: slime-core train --config "
                  f"{run_dir / 'config.yaml'})", highlight=False)
    display = RunDisplay(console, config.num_rollout, config.log_level)
    try:
        with display:
            run(config, hooks, on_step=display.step, on_stage=display.stage)
    except KeyboardInterrupt as exc:
        import ray

        ray.shutdown()  # Ray's log monitor stops: no line the killed actors left is printed after the message
        name = interrupted_by(exc)
        console.print(f"[bold red]interrupted ({name}):[/] the step in flight was abandoned; engines, router and "
                      "actors were stopped" + (f"; resume with --load {config.save}" if config.save else ""))
        sys.exit(128 + getattr(signal, name, signal.SIGINT))
    except Exception as exc:
        _report(exc, config.log_level == "debug")
    display.summary(json.loads((run_dir / "summary.json").read_text()))


def _banner(config, hooks, implied: dict) -> None:
    """The run's first lines: the plugins and their versions, what they imply, the quick-start values used."""
    versions = ", ".join(escape(f"{p.name}{' ' + p.version if p.version else ''} [{p.origin}]") for p in hooks.plugins)
    console.print(f"slime-core {slimecore.__version__} | plugins: {versions}")
    for plugin, values in implied.items():
        if values:
            flags = " ".join(flag_text(CORE_BY_NAME[k], v) for k, v in values.items())
            console.print(f"plugin {plugin!r} runs with {flags}")
    if config.recommended_applied:
        settings = " ".join(flag_text(CORE_BY_NAME[k], v) for k, v in config.recommended_applied.items())
        console.print(f"{config.recommended_by}: using its quick-start settings {settings} (set any flag to override)")


def train_plugins(argv: list[str]) -> tuple:
    """The plugins a ``slime-core train`` command line names (``--plugin``, a ``--config`` file's ``plugin:``,
    slime's ``--advantage-estimator``), loaded: ``(argv, specs, hooks, declared options)``."""
    from slimecore.defaults.slime_compat import algorithm_plugin, estimator_argv

    specs, _ = prescan(argv)
    specs = [normalize_spec(s) for s in specs]
    argv, specs, estimator = algorithm_plugin(_normalized_plugin_args(argv), specs)
    hooks = load_plugins(specs)
    declared = hooks.slime_options()
    return estimator_argv(argv, declared, estimator), specs, hooks, declared


def train_config(loaded: tuple) -> tuple:
    """``slime-core train``'s parser on what ``train_plugins`` loaded: the Config, checked by every plugin's
    ``slime_validate_config`` (files and the model are checked later); ``(config, hooks, implied options)``."""
    argv, specs, hooks, declared = loaded
    implied = hooks.slime_implied_options()
    config = parse_config(argv, specs, declared, implied, hooks.slime_quickstart_options())
    if (config.train_backend == "megatron" and not hooks.implementers("slime_model_bridge") and "models" not in specs
            and "models" in installed_entry_points()):  # slime's scripts name no bridge plugin: the installed one
        named = {normalize_spec(s) for s in prescan(argv)[0]}  # (a plugin the command line names is not named twice)
        extra = [a for s in specs if s not in named for a in ("--plugin", s)]
        return train_config(train_plugins([*argv, *extra, "--plugin", "models"]))
    validate(config, hooks)
    return config, hooks, implied


def _report(exc: Exception, debug: bool) -> None:
    """The error that stopped a run, once: its original message and where it came from (plugin, hook, process);
    the traceback only under --log-level debug."""
    from slimecore.errors import describe, format_exception
    from slimecore.plugins import HookCallError

    failure = describe(exc)
    if debug:
        console.print(escape(failure.remote_traceback or format_exception(exc)), highlight=False)
    console.print(f"[bold red]error:[/] {escape(failure.text())}", highlight=False)
    if not debug:
        console.print("(--log-level debug prints the traceback)", style="dim")
    startup = isinstance(exc, (ConfigError, PluginError)) and not isinstance(exc, HookCallError)
    sys.exit(2 if startup else 1)  # 2: the run was refused before it started, as for a bad flag


def _normalized_plugin_args(argv: list[str]) -> list[str]:
    out, take = [], False
    for arg in argv:
        out.append(normalize_spec(arg) if take else arg)
        take = arg == "--plugin"
    return out


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def plugins(as_json):
    """List installed plugins (entry-point group `slimecore`) and the built-in defaults, with their hooks."""
    from slimecore_cli.plugin_list import cache_file, plugin_rows

    def importing(names):
        console.print(f"importing {len(names)} plugin(s) to read their hooks ({', '.join(names)}); kept in "
                      f"{cache_file()} until they change", style="dim", highlight=False)

    rows = plugin_rows(on_import=importing)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    Console().print(plugins_table(rows, Console().width))


def plugins_table(rows: list[dict], width: int) -> Table:
    """The plugins as a table that fits ``width`` columns (the distribution dropped when it does not)."""
    from slimecore.display import fit_table

    table = Table(title="slime-core plugins (--json: every field)")
    for column in ("plugin", "distribution", "hooks", "origin"):
        table.add_column(column)
    for row in rows:
        table.add_row(escape(f"{row['name']} {row['version']}"), row["distribution"],
                      ", ".join(h.removeprefix("slime_") for h in row["hooks"]),
                      row["origin"] if row["origin"] != "error" else f"[red]{escape(row['location'])}[/]")
    return fit_table(table, width, drop=("distribution",))


@cli.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def hooks(name, as_json):
    """Show every hook spec with its documentation (or just NAME)."""
    if name and not any(name in (h, h.removeprefix("slime_")) for h in SPECS):
        _fail(ValueError(f"no hook named {name!r}; `slime-core hooks` lists them"))
    kinds = {"all": "all implementations", "one": "one answer", "first": "first answer"}
    rows = [{"name": hook, "signature": str(inspect.signature(fn)), "answers": kinds[fn.slime_kind],
             "required": fn.slime_required, "async": fn.slime_async, "doc": inspect.getdoc(fn)}
            for hook, fn in SPECS.items() if not name or name in (hook, hook.removeprefix("slime_"))]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    out = Console()
    for row in rows:
        flags = [row["answers"]] + (["required"] if row["required"] else []) + (["async"] if row["async"] else [])
        out.print(f"[bold cyan]{row['name']}[/]{escape(row['signature'])}  [dim]({', '.join(flags)})[/]")
        out.print(row["doc"] + "\n", soft_wrap=True, highlight=False, markup=False)


@cli.command()
@click.option("--task", default="arithmetic", show_default=True,
              help="Built-in task, or a data set an installed plugin ships (e.g. search_r1_qa).")
@click.option("-n", "--num", default=1000, show_default=True, help="Number of rows (a shipped data set: at most).")
@click.option("--seed", default=0, show_default=True)
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Output .jsonl path (required unless --list).")
@click.option("--list", "listing", is_flag=True, help="List the built-in tasks and the installed plugins' data sets.")
@click.option("--json", "as_json", is_flag=True, help="With --list: machine-readable output.")
def data(task, num, seed, output, listing, as_json):
    """Write a built-in task's prompts and labels, or a plugin's shipped data set, to a jsonl file (usable
    with --prompt-data)."""
    from slimecore.data.tasks import TASKS, write_task_jsonl

    if listing:  # each row: name, kind (task | dataset), description, plugin, path
        rows = [{"name": t.name, "kind": "task", "description": t.description, "plugin": None, "path": None}
                for t in TASKS.values()]
        rows += [{"name": name, "kind": "dataset", "description": None, "plugin": plugin, "path": path}
                 for name, (plugin, path) in sorted(_plugin_datasets().items())]
        if as_json:
            click.echo(json.dumps(rows, indent=1))
            return
        for row in rows:
            what = row["description"] or f"data set of plugin {row['plugin']!r}: {row['path']}"
            click.echo(f"{row['name']:<16} {what}")
        return
    if output is None:
        raise click.UsageError("Missing option '-o' / '--output' (or give --list).")
    if task in TASKS:
        write_task_jsonl(task, output, num, seed)
        console.print(f"wrote {num} rows of task {task!r} to {output} (keys: input, label, metadata)")
        return
    shipped = _plugin_datasets()
    if task not in shipped:
        _fail(ValueError(f"unknown task {task!r}; built-in tasks: {', '.join(sorted(TASKS))}; data sets of installed "
                         f"plugins: {', '.join(sorted(shipped)) or 'none'}"))
    from pathlib import Path

    from slimecore.data.dataset import DataError, read_rows

    plugin, path = shipped[task]
    try:
        rows = [row for _, row in read_rows(path)[:num]]
    except DataError as exc:
        _fail(ValueError(f"data set {task!r} of plugin {plugin!r}: {exc}"))
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    console.print(f"wrote {len(rows)} rows of data set {task!r} (plugin {plugin!r}) to {output} "
                  f"(keys: {', '.join(rows[0]) if rows else 'none'})")


def _plugin_datasets() -> dict[str, tuple[str, str]]:
    """Data sets that installed plugins ship (``slime_datasets``): name -> (plugin, path)."""
    found: dict[str, tuple[str, str]] = {}
    for name in sorted(installed_entry_points()):
        try:
            answers = load_plugins([name], defaults=False).slime_datasets()
        except PluginError as exc:
            console.print(f"[yellow]warning:[/] plugin {name!r} could not be loaded, so its data sets are not "
                          f"listed: {exc}")
            continue
        for answer in answers:
            for dataset, path in answer.items():
                found.setdefault(dataset, (name, str(path)))
    return found


@cli.command()
@click.option("--plugin", "specs", multiple=True, default=("models",), show_default=True,
              help="Bridge plugins whose presets to list.")
@click.option("--show", "--args", "show", default=None,
              help="Print one preset's Megatron flags (slime's MODEL_ARGS for scripts/models/NAME.sh).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def models(specs, show, as_json):
    """Model presets of the bridge plugins, with their Megatron shapes (as slime's scripts/models/*.sh)."""
    from slimecore.convert import presets

    try:
        found = presets(load_plugins(list(specs)))
    except PluginError as exc:
        _fail(exc)
    if show is not None:
        if show not in found:
            _fail(ValueError(f"no preset {show!r}; known: {', '.join(sorted(found)) or 'none'}"))
        click.echo(" ".join(found[show][1].megatron_args()))
        return
    if as_json:
        click.echo(json.dumps([{"preset": name, "plugin": plugin, "architecture": b.architecture,
                                "slime_model_file": file, "megatron_args": b.megatron_args()}
                               for name, (plugin, b, file) in sorted(found.items())],
                              indent=2))
        return
    from slimecore.display import fit_table

    table = Table(title="model presets (`slime-core models --show NAME` prints the Megatron flags)")
    table.add_column("preset", no_wrap=True)
    for column in ("architecture", "layers", "hidden", "ffn", "heads / kv", "experts (top-k)", "slime file"):
        table.add_column(column)
    for name, (plugin, b, file) in sorted(found.items()):
        experts = f"{b.num_experts} ({b.moe_router_topk})" if getattr(b, "num_experts", None) else "-"
        heads = f"{b.num_attention_heads} / " + ("MLA" if getattr(b, "kv_lora_rank", None) else str(b.num_query_groups))
        table.add_row(name, b.architecture.removesuffix("ForCausalLM"), str(b.num_layers), str(b.hidden_size),
                      str(b.ffn_hidden_size), heads, experts, file or "-")
    Console().print(fit_table(table, Console().width, drop=("ffn", "architecture", "hidden")))


@cli.group()
def convert():
    """Convert checkpoints between HF safetensors and Megatron torch_dist, through the model bridge. Every
    mismatch between the checkpoint, config.json and the shape you expect is reported before anything is built."""


@convert.command("hf-to-megatron", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--hf-checkpoint", required=True, help="HF checkpoint directory.")
@click.option("--save", required=True, help="Output directory (torch_dist/ and megatron_checkpoint.json).")
@click.option("--model", "preset", default=None, help="A preset (`slime-core models`) config.json must match.")
@click.option("--tensor-model-parallel-size", "tp", default=1, show_default=True)
@click.option("--pipeline-model-parallel-size", "pp", default=1, show_default=True)
@click.option("--expert-model-parallel-size", "ep", default=1, show_default=True)
@click.option("--plugin", "specs", multiple=True, default=("models",), show_default=True, help="Bridge plugins.")
@click.pass_context
def hf_to_megatron(ctx, hf_checkpoint, save, preset, tp, pp, ep, specs):
    """HF -> torch_dist. Extra arguments are slime-style MODEL_ARGS (--num-layers 28 ...), checked against
    config.json. Runs on one process, or under torchrun for TP/PP/EP > 1."""
    from slimecore.convert import hf_to_megatron as run

    try:
        out = run(hf_checkpoint, save, load_plugins(list(specs)), preset, ctx.args, tp, pp, ep)
    except (ConfigError, PluginError, FileNotFoundError) as exc:
        _fail(exc)
    console.print(f"wrote {out}/torch_dist and {out}/megatron_checkpoint.json")


@convert.command("megatron-to-hf")
@click.option("--load", required=True, help="torch_dist checkpoint directory (hf-to-megatron output, a "
              "megatron-backend checkpoint such as SAVE/iter_0000009/actor, or a Megatron-LM checkpoint root: "
              "slime's tools/convert_hf_to_torch_dist.py output).")
@click.option("--hf-checkpoint", required=True, help="HF directory of the trained model: its config.json and "
              "tokenizer are copied next to the weights.")
@click.option("--output", required=True, help="Output HF directory.")
@click.option("--plugin", "specs", multiple=True, default=("models",), show_default=True, help="Bridge plugins.")
def megatron_to_hf(load, hf_checkpoint, output, specs):
    """torch_dist -> HF safetensors, after checking that the checkpoint's model shape is config.json's."""
    from slimecore.convert import megatron_to_hf as run

    try:
        out = run(load, hf_checkpoint, output, load_plugins(list(specs)))
    except (ConfigError, PluginError, FileNotFoundError) as exc:
        _fail(exc)
    console.print(f"wrote HF safetensors, config and tokenizer to {out}")


from slimecore_cli.runs import plot, runs  # noqa: E402  (after `cli`, which they join)

cli.add_command(runs)
cli.add_command(plot)
