"""What a hook may return, checked right after it returns (``slimecore.plugins.Hooks`` calls ``check`` for every
implementation it guards), so a wrong answer is reported naming the plugin and the hook that gave it instead of
failing later inside the core (``float('good')`` in the reward's bookkeeping, a 7-entry log-prob list in the
training batch) with neither named.

Each checked hook has one function here: ``(answer, arguments of the call) -> what is wrong, or None``. The
arguments are those the implementation takes (``impl.argnames``), so a check that needs one the implementation
did not ask for skips that part.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

from slimecore.errors import HookCallError, PluginError


class HookAnswerError(HookCallError):
    """A hook returned what its spec does not allow (``problem`` says what and what is expected)."""

    def __init__(self, plugin: str, hook: str, problem: str):
        PluginError.__init__(self, f"plugin {plugin!r}: {hook} returned {problem}")
        self.plugin, self.hook, self.problem, self.original = plugin, hook, problem, None
        self.cause_kind, self.cause_text, self.cause_traceback = "PluginError", f"{hook} returned {problem}", ""

    def __reduce__(self):
        return HookAnswerError, (self.plugin, self.hook, self.problem)


def _shown(value: Any) -> str:
    """``'good' (a str)``, ``a torch.Tensor of shape (4,)``: a wrong value as a message shows it."""
    shape = getattr(value, "shape", None)
    kind = type(value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__name__}"
    if shape is not None:
        return f"a {name} of shape {tuple(shape)}"
    text = repr(value)
    return f"{text[:60] + '...' if len(text) > 60 else text} (a {name})"


def _reward_problem(value: Any) -> str | None:
    """A reward is a real number, a dict of them (``--reward-key`` picks one) or None (no answer)."""
    if value is None or isinstance(value, numbers.Real):
        return None
    if isinstance(value, dict):
        wrong = {k: v for k, v in value.items() if not isinstance(v, (numbers.Real, str, type(None)))}
        if not wrong:
            return None
        verb = "is" if len(wrong) == 1 else "are"
        return f"a dict whose {', '.join(map(repr, wrong))} {verb} not a number ({_shown(next(iter(wrong.values())))})"
    hint = "; return .item() of a one-element tensor" if getattr(value, "shape", None) is not None else ""
    return f"{_shown(value)}{hint}"


def reward(answer: Any, args: dict) -> str | None:
    problem = _reward_problem(answer)
    return problem and f"{problem}; a reward is a float, a dict of floats (chosen by --reward-key) or None"


def group_reward(answer: Any, args: dict) -> str | None:
    samples = args.get("samples")
    if not isinstance(answer, (list, tuple)):
        return f"{_shown(answer)}; slime_group_reward returns a list with one reward per sample"
    if samples is not None and len(answer) != len(samples):
        return f"{len(answer)} rewards for a group of {len(samples)} samples; return one reward per sample"
    for number, value in enumerate(answer):
        problem = _reward_problem(value)
        if problem:
            return f"{problem} as reward {number}; a reward is a float, a dict of floats (--reward-key) or None"
    return None


def generate(answer: Any, args: dict) -> str | None:
    from slimecore.types import Sample, SampleError

    samples = answer if isinstance(answer, list) else [answer]
    if not samples or not all(isinstance(s, Sample) for s in samples):
        wrong = next((s for s in samples if not isinstance(s, Sample)), answer)
        return f"{_shown(wrong)}; slime_generate returns the Sample (or a non-empty list of Samples)"
    for sample in samples:
        try:
            sample.check_aligned()
        except SampleError as exc:
            return (f"{exc}; each response token needs one loss-mask entry and one log-prob (use "
                    "Sample.append_response_tokens, which keeps them aligned)")
    return None


def filter_group(answer: Any, args: dict) -> str | None:
    from slimecore.types import FilterResult

    if answer is None or isinstance(answer, (bool, FilterResult)):
        return None
    return f"{_shown(answer)}; a group filter returns a FilterResult, True / False (keep or drop) or None"


def post_process_rewards(answer: Any, args: dict) -> str | None:
    samples = args.get("samples")
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2
            and all(isinstance(part, (list, tuple)) for part in answer)):
        return f"{_shown(answer)}; slime_post_process_rewards returns (raw rewards, rewards): two lists of floats"
    if samples is not None and any(len(part) != len(samples) for part in answer):
        return (f"lists of {len(answer[0])} and {len(answer[1])} rewards for {len(samples)} samples; return one "
                "per sample in each")
    return None


CHECKS: dict[str, Callable[[Any, dict], str | None]] = {
    "slime_reward": reward,
    "slime_group_reward": group_reward,
    "slime_generate": generate,
    "slime_filter_group": filter_group,
    "slime_post_process_rewards": post_process_rewards,
}


def check(plugin: str, hook: str, answer: Any, args: dict) -> Any:
    """``answer`` when ``hook`` allows it, else a HookAnswerError naming ``plugin`` and ``hook``."""
    problem = CHECKS[hook](answer, args) if hook in CHECKS and answer is not None else None
    if problem:
        raise HookAnswerError(plugin, hook, problem)
    return answer
