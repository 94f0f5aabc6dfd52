"""How a failure reaches the user: one message, with the plugin, hook and process it came from.

An exception raised in a Ray actor crosses to the driver pickled. Every project exception pickles (a
class with extra ``__init__`` arguments says how in ``__reduce__``), so the driver sees the original class
and message instead of Ray's ``UnserializableException``. ``describe`` unwraps what Ray adds around it
(``RayTaskError``, an actor that died in its constructor) and names the process; the CLI prints that once,
at the end, with the full traceback only under ``--log-level debug``.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass

class ConfigError(ValueError):
    """A bad flag, value, file key or combination; the message names it and says what to do.
    ``slimecore.config.ConfigError`` is this class."""


class DataError(ValueError):
    """A prompt file that cannot be used as it is; the message names the file, line and key, and the fix.
    ``slimecore.data.dataset.DataError`` is this class."""


class CheckpointError(FileNotFoundError):
    """A checkpoint that is missing or incomplete; the message names the path, what is missing and the fix.
    ``slimecore.hf_checkpoint.CheckpointError`` is this class."""


class ConvertError(ConfigError):
    """The checkpoint, the HF config and the expected shape disagree; the message lists every difference.
    ``slimecore.convert.ConvertError`` is this class."""


class FilterStarvedError(RuntimeError):
    """Group filters dropped groups for ``--max-filter-rounds`` over-sampling rounds without filling a step.
    ``slimecore.defaults.rollout.FilterStarvedError`` is this class."""


class PluginError(RuntimeError):
    """A plugin could not be found, loaded, checked or called. The message says what to do.
    ``slimecore.plugins.PluginError`` is this class."""


class HookCallError(PluginError):
    """A plugin raised inside a hook. ``slimecore.plugins.HookCallError`` is this class."""

    def __init__(self, plugin: str, hook: str, exc: BaseException):
        self.plugin, self.hook, self.original = plugin, hook, exc
        self.cause_kind, self.cause_text = type(exc).__name__, str(exc)
        self.cause_traceback = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        super().__init__(f"plugin {plugin!r} raised in {hook}: {self.cause_kind}: {self.cause_text}")

    def __reduce__(self):
        # crosses Ray pickled; the plugin's own exception may not pickle, so it travels as text
        return _restore_hook_call_error, (self.plugin, self.hook, self.cause_kind, self.cause_text,
                                          self.cause_traceback)


def _restore_hook_call_error(plugin: str, hook: str, kind: str, text: str, trace: str) -> HookCallError:
    error = HookCallError.__new__(HookCallError)
    PluginError.__init__(error, f"plugin {plugin!r} raised in {hook}: {kind}: {text}")
    error.plugin, error.hook, error.original = plugin, hook, None
    error.cause_kind, error.cause_text, error.cause_traceback = kind, text, trace
    return error


# exception classes whose message is already written for the user (what happened and what to do)
MESSAGES_FOR_USERS = {"ConfigError", "PluginError", "DataError", "RewardFailureError", "FilterStarvedError",
                      "CheckpointError", "ConvertError", "RemoteRewardError", "WeightCheckError",
                      "LogprobMismatchError"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# "ray::RolloutManager.generate() (pid=123, ip=..., actor_id=..., repr=...)"
_RAY_PROCESS = re.compile(r"ray::(?P<name>[^\s(]+)\(\)\s*\(pid=(?P<pid>\d+)")


@dataclass
class Failure:
    """What the driver tells the user about an error: ``message`` (cause and remedy), where it came from."""

    message: str
    kind: str  # the original exception's class name
    process: str | None = None  # "RolloutManager.generate (pid 123)"
    plugin: str | None = None
    hook: str | None = None
    remote_traceback: str | None = None

    def text(self) -> str:
        origin = [f"plugin {self.plugin!r}" if self.plugin else "", f"hook {self.hook}" if self.hook else "",
                  f"process {self.process}" if self.process else ""]
        where = ", ".join(part for part in origin if part)
        kind = "" if self.kind in MESSAGES_FOR_USERS else f"{self.kind}: "
        named = where and (self.plugin or self.process != "driver")  # a dead actor's text may name no process
        return f"{kind}{self.message}" + (f"\n  (from {where})" if named else "")


def _process(text: str) -> str | None:
    match = _RAY_PROCESS.search(_ANSI.sub("", text or ""))
    name = ".".join(match["name"].split(".")[-2:]) if match else ""  # Class.method, without a qualifying path
    return f"{name} (pid {match['pid']})" if match else None


def _exception_tail(traceback_text: str) -> tuple[str, str]:
    """(class name, message) of the last exception in a formatted traceback (a dead actor's error text)."""
    lines = _ANSI.sub("", traceback_text).rstrip().splitlines()
    start = 0
    for i, line in enumerate(lines):  # the exception text follows the last frame and its source/caret lines
        if line.startswith("  File "):
            start = i + 1
            while start < len(lines) and lines[start].startswith(("    ", "\t")):
                start += 1
    tail = "\n".join(lines[start:]).strip() or (lines[-1] if lines else "")
    kind, _, message = tail.partition(": ")
    if not message or " " in kind:
        return "RayActorError", tail
    return kind.rsplit(".", 1)[-1], message


def describe(exc: BaseException) -> Failure:
    """The user-facing account of ``exc``, with Ray's wrapping removed."""
    import ray.exceptions as rex

    process = "driver"
    if isinstance(exc, rex.RayTaskError):  # its text starts "ray::Class.method() (pid=N, ...)", then the traceback
        process = _process(str(exc)) or "a Ray worker"
        exc = exc.cause
    elif isinstance(exc, rex.RayActorError) and getattr(exc, "error_msg", None):
        text = _ANSI.sub("", exc.error_msg)
        if "creation task" in text:  # the constructor raised: Ray keeps only the formatted traceback
            kind, message = _exception_tail(text)
            return Failure(message, kind, _process(text), remote_traceback=text)
        return Failure(text.strip(), type(exc).__name__, _process(text))
    if getattr(exc, "cause_kind", None) is not None:  # HookCallError: the plugin's own exception, as text
        return Failure(exc.cause_text, exc.cause_kind, process, exc.plugin, exc.hook, exc.cause_traceback)
    return Failure(str(exc), type(exc).__name__, process, remote_traceback=format_exception(exc))


def format_exception(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


class RewardFailureError(RuntimeError):
    """More than ``--max-reward-failure-fraction`` of a step's samples failed to be scored."""


def check_reward_failures(config, samples: list, rollout_id: int) -> None:
    """Stop the run when too many of a step's samples are FAILED: a reward that fails on (nearly) every
    sample would otherwise train on nothing, or on the few that happened to pass, while printing reward 0."""
    from slimecore.types import Status

    failed = [s for s in samples if s.status == Status.FAILED]
    if not samples or len(failed) / len(samples) <= config.max_reward_failure_fraction:
        return
    shown = "\n".join(f"  sample {s.index}: {s.metadata.get('reward_error', 'marked FAILED')}" for s in failed[:3])
    raise RewardFailureError(
        f"rollout {rollout_id}: {len(failed)} of {len(samples)} samples failed to be scored, more than "
        f"--max-reward-failure-fraction {config.max_reward_failure_fraction:g}. First failures (tracebacks in the log "
        f"above):\n{shown}\nFix the reward (or its service: --rm-url, --rm-type), or raise "
        "--max-reward-failure-fraction to train on what remains")
