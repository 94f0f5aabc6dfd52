"""The built-in data source (slime's RolloutDataSourceWithBuffer), with its buffer checkpointed.

Prompts come from ``--prompt-data`` or a built-in task. ``get_samples(n)`` returns ``n`` groups of
``--n-samples-per-prompt`` copies, buffered groups (aborted partial rollouts) first. The state
(position, epoch, indices and the buffer itself) round-trips, so a resumed run draws exactly the
prompts an uninterrupted run would have and resumes the partial samples that slime loses on restart
(its state has no buffer, and #1558 restarted the order).
"""

from __future__ import annotations

import copy
import json
import logging
import random
from pathlib import Path

from slimecore.data.dataset import DataError, read_rows, to_prompts
from slimecore.data.tasks import get_task
from slimecore.types import BufferFilter, DataSource, Sample  # BufferFilter: the contract's, importable from here

log = logging.getLogger("slimecore.data")

TASK_PREFIX = "task:"
EVAL_TASK_ROWS = 64
# Eval rows of a built-in task use another seed than training rows. Small tasks have only a few thousand
# distinct questions, so the two sets may still share some: eval tracks progress, it is no held-out benchmark.
EVAL_SEED_OFFSET = 1_000_003


def pop_first(buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """Default buffer filter: take (and remove) the oldest ``num_groups`` groups."""
    taken = buffer[:num_groups]
    del buffer[:num_groups]
    return taken


def load_prompts(config, tokenizer, spec: str | None, *, input_key: str | None = None, label_key: str | None = None,
                 eval_set: bool = False) -> tuple[list[dict], int]:
    """Prompt records from a file spec, ``task:NAME``, or (spec None) the configured ``--task``.

    Returns ``(records, number dropped by --rollout-max-prompt-len)``. Built-in tasks are questions for
    an instruct model, so they use the tokenizer's chat template whenever it has one.
    """
    if spec is None or spec.startswith(TASK_PREFIX):
        task = get_task(spec[len(TASK_PREFIX):] if spec else config.task)
        n = EVAL_TASK_ROWS if eval_set else config.task_size
        seed = config.rollout_seed + (EVAL_SEED_OFFSET if eval_set else 0)
        rows = [(f"task:{task.name}, row {i}", row) for i, row in enumerate(task.make_rows(n, seed), start=1)]
        source, input_key, label_key = f"task:{task.name}", "input", "label"
        chat = bool(getattr(tokenizer, "chat_template", None))
    else:
        rows, source = read_rows(spec), spec
        input_key, label_key = input_key or config.input_key, label_key or config.label_key
        chat = config.apply_chat_template
    return prompts_from_rows(config, tokenizer, rows, source, input_key=input_key, label_key=label_key,
                             apply_chat_template=chat)


def prompts_from_rows(config, tokenizer, rows: list[tuple[str, dict]], source: str, *, input_key: str,
                      label_key: str | None, apply_chat_template: bool) -> tuple[list[dict], int]:
    """``load_prompts`` on rows already read (``(where, row)`` pairs, as ``read_rows`` gives them): for a plugin
    that rewrites the rows of its shipped data before they become prompts."""
    limit, limit_name = prompt_limit(config)
    records, filtered = to_prompts(rows, tokenizer, input_key=input_key, label_key=label_key,
                                   metadata_key=config.metadata_key, tool_key=config.tool_key,
                                   apply_chat_template=apply_chat_template,
                                   chat_template_kwargs=config.apply_chat_template_kwargs,
                                   max_prompt_len=limit, source=source, limit_name=limit_name)
    if not records:
        raise DataError(f"{source}: all {filtered} prompts are longer than {limit_name} {limit} tokens; "
                        "raise --rollout-max-prompt-len (within the model's context) or use shorter prompts")
    return records, filtered


def prompt_limit(config) -> tuple[int | None, str]:
    """The longest prompt an engine accepts, and where that bound comes from: ``--rollout-max-prompt-len``, else
    one less than the context (``--rollout-max-context-len`` or the model's ``max_position_embeddings``), as
    slime does; a longer prompt would be refused by the engine (HTTP 400) and stop the run."""
    if config.rollout_max_prompt_len is not None:
        return config.rollout_max_prompt_len, "--rollout-max-prompt-len"
    context, _ = context_len(config)
    if not context:
        return None, ""
    return context - 1, ("--rollout-max-context-len - 1 =" if config.rollout_max_context_len
                         else f"the model's context ({context}) - 1 =")


def context_len(config) -> tuple[int | None, str]:
    """Prompt + response tokens the engines hold, and where that comes from: ``--rollout-max-context-len``, else
    the model's ``max_position_embeddings`` (None when neither is known)."""
    if config.rollout_max_context_len:
        return config.rollout_max_context_len, "--rollout-max-context-len"
    model_config = Path(config.hf_checkpoint or "") / "config.json"
    if not config.hf_checkpoint or not model_config.is_file():
        return None, ""
    context = json.loads(model_config.read_text()).get("max_position_embeddings")
    return context, f"max_position_embeddings in {model_config}"


class PromptDataSource(DataSource):
    """Prompt records served as groups of ``n_samples_per_prompt`` samples, epoch after epoch.

    ``buffer_filter(buffer, num_groups)`` picks buffered groups to resume (removing them from ``buffer``);
    default :func:`pop_first`. With ``shuffle``, epoch ``e`` visits prompts in the order of
    ``random.Random(seed + e)``, so any position can be recomputed from ``(epoch, offset)`` alone.
    """

    def __init__(self, records: list[dict], n_samples_per_prompt: int, shuffle: bool = False, seed: int = 42,
                 buffer_filter: BufferFilter | None = None, num_filtered: int = 0):
        if not records:
            raise ValueError("PromptDataSource needs at least one prompt record")
        if n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")
        self.records, self.n_samples_per_prompt = records, n_samples_per_prompt
        self.shuffle, self.seed = shuffle, seed
        self.buffer_filter = buffer_filter or pop_first
        self.num_filtered = num_filtered  # prompts dropped at load time as too long (logged there)
        self.buffer: list[list[Sample]] = []
        self.epoch, self.offset, self.next_group_index, self.next_index = 0, 0, 0, 0
        self._order = self._epoch_order()

    @classmethod
    def from_config(cls, config, tokenizer, buffer_filter: BufferFilter | None = None) -> "PromptDataSource":
        """The training source: ``--prompt-data`` (or ``--task``), shuffled per ``--rollout-shuffle``."""
        records, filtered = load_prompts(config, tokenizer, config.prompt_data)
        return cls(records, config.n_samples_per_prompt, shuffle=config.rollout_shuffle, seed=config.rollout_seed,
                   buffer_filter=buffer_filter, num_filtered=filtered)

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def __len__(self) -> int:
        return len(self.records)

    def _new_group(self, record: dict) -> list[Sample]:
        group = []
        for _ in range(self.n_samples_per_prompt):
            # deep copies: a rollout may edit a sample's label/metadata in place without touching its siblings
            group.append(Sample(group_index=self.next_group_index, index=self.next_index, prompt=record["prompt"],
                                tokens=list(record["tokens"]), label=copy.deepcopy(record["label"]),
                                metadata=copy.deepcopy(record["metadata"])))
            self.next_index += 1
        self.next_group_index += 1
        return group

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        groups = self.buffer_filter(self.buffer, num_groups) if self.buffer else []
        if len(groups) > num_groups:
            raise ValueError(f"the buffer filter returned {len(groups)} groups for a request of {num_groups}; "
                             "a slime_buffer_filter must return at most num_groups groups")
        while len(groups) < num_groups:
            if self.offset >= len(self._order):  # ">=": a resume on a shorter prompt set starts a new epoch
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order()
            groups.append(self._new_group(self.records[self._order[self.offset]]))
            self.offset += 1
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer.extend(groups)

    def state_dict(self) -> dict:
        """JSON-serialisable; key names follow slime's rollout state, plus the buffer."""
        return {"epoch_id": self.epoch, "sample_offset": self.offset, "sample_group_index": self.next_group_index,
                "sample_index": self.next_index, "num_prompts": len(self.records),
                "buffer": [[s.to_dict() for s in group] for group in self.buffer]}

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != len(self.records):
            log.warning("resuming with %d prompts where the checkpoint had %d: the prompt order differs from the "
                        "interrupted run", len(self.records), state["num_prompts"])
        self.epoch, self.offset = state["epoch_id"], state["sample_offset"]
        self.next_group_index, self.next_index = state["sample_group_index"], state["sample_index"]
        self.buffer = [[Sample.from_dict(d) for d in group] for group in state["buffer"]]
        self._order = self._epoch_order()


def make_eval_source(config, tokenizer, spec: str) -> PromptDataSource:
    """An eval source (``--eval-prompt-data NAME SPEC``): every prompt once per eval, in file order."""
    records, filtered = load_prompts(config, tokenizer, spec, input_key=config.eval_input_key,
                                     label_key=config.eval_label_key, eval_set=True)
    return PromptDataSource(records, config.n_samples_per_eval_prompt, num_filtered=filtered)
