"""Multi-turn tool calling for generate hooks: slime's ``examples/search-r1`` loop, made reusable.

One episode is one ``Sample`` whose response alternates model turns and tool observations::

    prompt | model turn 1 | observation 1 | model turn 2 | ... | model turn n
             mask 1, engine log-probs      mask 0, log-prob 0.0

- Model turns go token in, token out: each request sends the sample's tokens so far as ``input_ids``,
  and the engine's output tokens and log-probs are appended exactly as returned (no trimming, no
  re-tokenisation). The tokens the engine conditioned on are therefore the tokens the trainer scores.
  (slime's example sends ``prompt + response`` as text, so the engine re-tokenises the history and the
  recorded tokens can differ from what the log-probs were computed on.)
- A turn stops at the closing tag of a tool call (``stop`` strings, ``no_stop_trim``), so the tag is
  in the output tokens and the parser sees the call as the last thing in the text.
- Observations are tokenised on their own (``tokenizer(text, add_special_tokens=False)``, as slime
  does) and appended with ``trainable=False``: loss mask 0, log-prob 0.0.

``run_turns`` is the loop; ``parse_tag_call``, ``run_tool`` and ``append_observation`` are its parts,
usable on their own. An environment supplies one ``on_turn(text, turn)`` callback that parses the
model's turn, runs its tool and returns the observation text (or None when the episode is over).
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from slimecore.types import Sample, Status

OnTurn = Callable[[str, int], "str | None | Awaitable[str | None]"]


@dataclass(frozen=True)
class ToolCall:
    """A call found in the model's text: the tag name and the text between the tags (stripped)."""

    name: str
    content: str


def parse_tag_call(text: str, names: Sequence[str]) -> ToolCall | None:
    """The first ``<name>...</name>`` in ``text`` with ``name`` in ``names`` (Search-R1's
    ``<(search|answer)>(.*?)</\\1>``, across lines), or None when the text holds no complete call."""
    if not names:
        raise ValueError("parse_tag_call needs at least one tag name")
    pattern = r"<(" + "|".join(re.escape(n) for n in names) + r")>(.*?)</\1>"
    match = re.search(pattern, text, re.DOTALL)
    return ToolCall(match.group(1), match.group(2).strip()) if match else None


async def run_tool(tool: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a sync or async tool. A sync tool runs in a worker thread, so a slow one (a blocking HTTP
    call, a big index) does not stall the other samples' generation on the event loop."""
    if inspect.iscoroutinefunction(tool):
        return await tool(*args, **kwargs)
    result = await asyncio.to_thread(tool, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def append_observation(sample: Sample, text: str, tokenizer: Any, max_response_len: int | None = None
                       ) -> list[int] | None:
    """Tokenise ``text`` (no special tokens added) and append it to the response as non-trainable
    tokens (loss mask 0, log-prob 0.0); returns the appended token ids. When the response would then
    exceed ``max_response_len`` tokens, nothing is appended and None is returned."""
    tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if max_response_len is not None and sample.response_length + len(tokens) > max_response_len:
        return None
    sample.append_response_tokens(tokens, trainable=False, text=text)
    return tokens


async def run_turns(sample: Sample, client: Any, sampling_params: dict, on_turn: OnTurn, *, max_turns: int,
                    stop: Sequence[str] = (), tokenizer: Any = None, max_response_len: int | None = None) -> Sample:
    """Generate up to ``max_turns`` model turns, appending ``on_turn``'s observation after each but the last.

    ``sampling_params["max_new_tokens"]`` bounds each model turn, as in slime's example.
    ``max_response_len`` (optional) bounds the whole response, observations included: a turn gets at
    most the tokens left, and an observation that does not fit ends the episode as TRUNCATED without
    being appended. ``stop`` strings are added to any in ``sampling_params``; ``no_stop_trim`` is forced
    on so the stop text stays in the tokens. ``tokenizer`` (default ``client.tokenizer``) tokenises
    observations. ``on_turn(text, turn)`` (sync or async; ``turn`` counts from 0) gets the text of a
    model turn and returns the observation to append, or None to end the episode (a final answer).

    The episode also ends when a turn finishes by length (TRUNCATED) or is aborted (ABORTED, returned at
    once). No tool runs after the last turn: no model turn would read its output. The status of the last
    model turn stands otherwise (COMPLETED). ``sample.metadata["turns"]`` is the number of model turns.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if sample.response_length:
        raise ValueError(f"sample {sample.index} already has {sample.response_length} response tokens; run_turns "
                         "starts an episode from the prompt (partial rollout cannot resume a tool episode)")
    tokenizer = tokenizer if tokenizer is not None else getattr(client, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("run_turns needs a tokenizer for observations: pass tokenizer= or a client that has one")
    params = dict(sampling_params)
    given = params.get("stop") or []
    params["stop"] = list(dict.fromkeys([*([given] if isinstance(given, str) else given), *stop]))
    params["no_stop_trim"] = True
    per_turn = params.get("max_new_tokens")
    sample.metadata["turns"] = 0
    for turn in range(max_turns):
        left = None if max_response_len is None else max_response_len - sample.response_length
        if left is not None and left <= 0:
            sample.status = Status.TRUNCATED
            break
        params["max_new_tokens"] = left if per_turn is None else (per_turn if left is None else min(per_turn, left))
        out = await client.generate(input_ids=sample.tokens, sampling_params=params, return_logprob=True)
        meta = out["meta_info"]
        entries = meta["output_token_logprobs"]
        sample.append_response_tokens([e[1] for e in entries], [e[0] for e in entries], trainable=True,
                                      text=out.get("text", ""), finish_reason=meta["finish_reason"],
                                      weight_version=meta.get("weight_version"))
        client.keep_routed_experts(sample, meta)
        sample.metadata["turns"] = turn + 1
        if sample.status in (Status.ABORTED, Status.TRUNCATED) or turn == max_turns - 1:
            break
        observation = on_turn(out.get("text", ""), turn)
        if inspect.isawaitable(observation):
            observation = await observation
        if observation is None:
            break
        if append_observation(sample, observation, tokenizer, max_response_len) is None:
            sample.status = Status.TRUNCATED
            break
    return sample
