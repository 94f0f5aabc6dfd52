"""One session's turns, kept as exact tokens, and the training samples they become.

Every turn records the prompt ids the engine was sent, its output ids and log-probs, and its finish
reason. The prompt of a new request is built so that nothing the model wrote is ever re-tokenised:

- find the recorded turn whose history plus answer (as canonical messages) is the longest prefix of the
  request's messages, with the same tools;
- the new prompt is that turn's ``prompt_ids + output_ids``, the template's closing tokens the model did
  not write itself (``ChatTemplate.glue``), then the template's rendering of the new messages only (the
  text the full rendering adds after the rendering of the matched prefix, tokenised on its own);
- when no recorded turn matches (the client rewrote, compacted or dropped its history) or the template does
  not render the prefix as a prefix, the request is rendered from scratch and starts a new branch: a fork.

Turns therefore form a tree (a turn's parent is the turn its prompt extends). At the end, each path from a
root to a leaf is one sample: ``tokens`` = the leaf's prompt + output, the prompt part is the root's prompt,
model tokens have loss mask 1 and the engine's log-probs, template, user, tool and system tokens mask 0 and
log-prob 0. A turn shared by several paths (``n`` > 1, a retried request) is trained on its first path only.
All samples of one session share one ``rollout_id``, so the trainer's loss aggregation counts them as one
rollout, and one ``group_index``.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

from slimecore.agents.chat import ChatTemplate
from slimecore.types import Sample, Status

_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


def message_key(message: dict) -> tuple:
    """What a message contributes to the rendered prompt, for matching a client's history against the record
    (tool-call ids and SDK-added fields do not count)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or ())
    return message["role"], message.get("content") or "", calls


@dataclass
class Turn:
    """One model call of a session, exactly as the engine saw and answered it."""

    index: int
    parent: int | None  # the turn whose prompt + output this prompt extends; None: rendered from scratch
    key: tuple  # message_key of the request's messages, then of the answer returned
    tools_key: str
    prompt_ids: list[int]
    output_ids: list[int]
    log_probs: list[float]
    finish: str  # "stop" | "length" | "abort"
    weight_version: str | None = None
    text: str = ""

    @property
    def end_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class Prompt:
    """The prompt for a request: its ids and the turn it extends (None: a fresh rendering)."""

    ids: list[int]
    parent: int | None
    messages_key: tuple
    tools_key: str


@dataclass
class Trajectory:
    """The turns of one session (thread-safe: the session server appends, the rollout reads at the end)."""

    template: ChatTemplate
    turns: list[Turn] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> Prompt:
        keys = tuple(message_key(m) for m in messages)
        tools_key = json.dumps(tools, sort_keys=True)
        with self.lock:
            candidates = [t for t in self.turns if t.tools_key == tools_key and t.finish != "abort"
                          and len(t.key) <= len(keys) and keys[:len(t.key)] == t.key]
        if candidates:
            parent = max(candidates, key=lambda t: (len(t.key), t.index))
            depth = len(parent.key)
            full = self.template.render(messages, tools, add_generation_prompt=True)
            prefix = self.template.render(messages[:depth], tools, add_generation_prompt=False)
            if full.startswith(prefix):
                ids = [*parent.prompt_ids, *parent.output_ids, *self.template.glue(parent.output_ids),
                       *self.template.encode(full[len(prefix):])]
                return Prompt(ids, parent.index, keys, tools_key)
        text = self.template.render(messages, tools, add_generation_prompt=True)
        return Prompt(self.template.encode(text), None, keys, tools_key)

    def record(self, prompt: Prompt, output_ids: list[int], log_probs: list[float], finish: str, answer: dict,
               weight_version: str | None = None, text: str = "") -> Turn:
        if len(output_ids) != len(log_probs):
            raise ValueError(f"{len(output_ids)} output ids but {len(log_probs)} log-probs")
        with self.lock:
            turn = Turn(len(self.turns), prompt.parent, prompt.messages_key + (message_key(answer),), prompt.tools_key,
                        list(prompt.ids), list(output_ids), list(log_probs), finish, weight_version, text)
            self.turns.append(turn)
        return turn

    def paths(self) -> list[list[Turn]]:
        """Root-to-leaf paths of the turn tree, in the order their leaves were generated."""
        with self.lock:
            turns = list(self.turns)
        parents = {t.parent for t in turns if t.parent is not None}
        paths = []
        for leaf in (t for t in turns if t.index not in parents):
            path, node = [], leaf
            while node is not None:
                path.append(node)
                node = turns[node.parent] if node.parent is not None else None
            paths.append(path[::-1])
        return paths

    def to_samples(self, base: Sample, tokenizer=None) -> list[Sample]:
        """One sample per path with at least one turn not trained on an earlier path. The first sample is
        ``base`` itself (its prompt tokens replaced by what the agent sent); the others are copies of its
        identity (group, index, prompt, label, metadata). All share ``rollout_id`` (``base.rollout_id`` or
        its ``index``)."""
        trained: set[int] = set()
        rollout_id = base.rollout_id if base.rollout_id is not None else base.index
        samples = []
        for path in self.paths():
            root, leaf = path[0], path[-1]
            tokens = leaf.end_ids
            start = len(root.prompt_ids)
            mask = [0] * (len(tokens) - start)
            log_probs = [0.0] * (len(tokens) - start)
            for turn in path:
                if turn.index in trained:
                    continue
                trained.add(turn.index)
                at = len(turn.prompt_ids) - start
                mask[at:at + len(turn.output_ids)] = [1] * len(turn.output_ids)
                log_probs[at:at + len(turn.output_ids)] = turn.log_probs
            if not any(mask):
                continue
            sample = base if not samples else Sample(
                group_index=base.group_index, index=base.index, prompt=base.prompt, label=base.label,
                metadata=dict(base.metadata), session_id=base.session_id)
            sample.rollout_id = rollout_id
            sample.tokens, sample.response_length = list(tokens), len(tokens) - start
            sample.loss_mask, sample.rollout_log_probs = mask, log_probs
            sample.response = tokenizer.decode(tokens[start:]) if tokenizer is not None else leaf.text
            sample.status = _STATUS[leaf.finish]
            sample.weight_versions = [t.weight_version for t in path if t.weight_version is not None]
            sample.metadata.update({"turns": len(path), "session_turns": len(self.turns),
                                    "session_samples": 0, "final_text": leaf.text})
            sample.check_aligned()
            samples.append(sample)
        for sample in samples:
            sample.metadata["session_samples"] = len(samples)
        return samples
