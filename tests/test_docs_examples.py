"""Every `slime-core ...` command shown in README.md, docs/ and the plugins' READMEs parses with the real command line: `train` through
the parser `slime-core train` uses (plugins loaded, their options included, the config validated), the other
commands through click. A flag renamed or removed in the code fails here, naming the file and line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from slimecore.config import ConfigError, parse_config
from slimecore.plugins import PluginError, installed_entry_points
from slimecore_cli.help import train_help
from slimecore_cli.main import cli, train_plugins

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("plugins/*/README.md"))]
# Shapes of a command rather than commands: alternatives, an optional part, an arrow of a diagram, a flag named
# to show the error a mistyped one gets (--no-such-flag). A bare "..." (more flags of the user's) is left out
# and the rest parsed.
SHAPE = re.compile(r"\[[^\]@]*\]|\||\s->\s|--no-such-")


def examples() -> list[tuple[str, str]]:
    """(where, command, inline) for each `slime-core` command of a shell code block (continuation lines joined,
    the shell around it and a trailing comment dropped) and each inline code span that is one."""
    found = []
    for path in DOCS:
        text = path.read_text()
        lines = text.splitlines()
        block = shell = False
        i = 0
        while i < len(lines):
            line, start = lines[i], i
            if line.lstrip().startswith("```"):
                block = not block
                shell = block and line.strip()[3:] in ("", "bash", "sh", "shell", "console")
            elif shell:
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i].strip()
                command = _command(line)
                if command:
                    found.append((f"{path.relative_to(ROOT)}:{start + 1}", command, False))
            i += 1
        for match in re.finditer(r"`(slime-core [^`]+)`", text):
            line = text[:match.start()].count("\n") + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", match.group(1), True))
    return found


def _command(line: str) -> str | None:
    """The `slime-core ...` part of a shell line: after `&&`, `$ ` or `ray job submit ... --`, before ` # `."""
    line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
    at = line.find("slime-core ")
    if at < 0 or (at and line[at - 1] not in " ($"):
        return None
    prefix = line[:at]
    if prefix.strip() and not re.search(r"(&&|\$|--)\s*$", prefix):
        return None  # a word in a sentence, not a command
    return line[at:]


def parse(command: str, inline: bool) -> None:
    """Parse ``command`` (``slime-core ...``) as the CLI would, without running it: ``train`` with the parser it
    uses (the plugins' options included; not the plugins' own checks of what a value names, such as an
    importable module), the others with click. ``inline``: a command named in a sentence, which may leave out
    a required option."""
    argv = [arg for arg in shlex.split(command)[1:] if arg != "..."]
    if argv[0] == "train":
        argv, specs, hooks, declared = train_plugins(argv[1:])
        if {"--help", "-h", "--help-all"} & set(argv):
            train_help(hooks, declared, every="--help-all" in argv)
            return
        parse_config(argv, specs, declared, hooks.slime_implied_options(), hooks.slime_quickstart_options())
        return
    ctx = cli.make_context("slime-core", argv, resilient_parsing=inline)
    args = ctx._protected_args + ctx.args
    command_obj = cli
    while isinstance(command_obj, click.Group) and args:
        name, command_obj, args = command_obj.resolve_command(ctx, args)
        ctx = command_obj.make_context(name, args, parent=ctx, resilient_parsing=inline)
        args = (ctx._protected_args + ctx.args) if isinstance(command_obj, click.Group) else []


def test_every_cli_example_in_the_readme_and_docs_parses(tmp_path, monkeypatch):
    pytest.importorskip("slime_grpo", reason="the plugins are installed by scripts/setup.sh")
    monkeypatch.chdir(tmp_path)
    # the files the examples name as their own: a one-file plugin and a data file, as the README makes them
    for name in ("my_reward.py", "my_agent_plugin.py"):
        (tmp_path / name).write_text("from slimecore import hookimpl\n")
    (tmp_path / "sglang.yaml").write_text("chunked_prefill_size: 4096\n")  # docs/engines.md's --sglang-config
    (tmp_path / "runs" / "X").mkdir(parents=True)  # a run folder's config.yaml (README: runs/X/config.yaml)
    (tmp_path / "runs" / "X" / "config.yaml").write_text("plugin: [grpo]\nrollout_batch_size: 4\n")
    shown = examples()
    assert len(shown) > 20, shown  # the extraction finds the README's quick start, tables and docs' commands
    installed = set(installed_entry_points())
    failures, parsed = [], 0
    for where, command, inline in shown:
        if SHAPE.search(command):
            continue
        plugins = re.findall(r"--plugin\s+(\S+)", command)
        if any(p not in installed and not p.endswith(".py") for p in plugins):
            continue  # a plugin named for illustration that this environment does not install
        try:
            parse(command, inline)
            parsed += 1
        except (ConfigError, PluginError, click.ClickException, SystemExit, ValueError) as exc:
            failures.append(f"{where}: {command}\n    {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)
    assert parsed > 15
