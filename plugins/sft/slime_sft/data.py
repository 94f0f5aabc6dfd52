"""Conversations for SFT and the data source that serves them, encoded and masked.

Rows come from ``--prompt-data`` (jsonl/parquet, ``path@[a:b]``): ``--input-key`` holds an OpenAI-style
message list (slime's SFT data uses ``--input-key messages``), ``--tool-key`` (default ``tools``) the tool
schemas handed to the chat template, ``--metadata-key`` and ``--label-key`` are kept on the sample. Without
``--prompt-data`` the built-in ``--task`` gives one conversation per row: the question as the user turn and
the correct answer as the assistant turn.

Every row is checked when the run starts (in the driver, before Ray) and encoded when the data source is
built, so a bad row stops the run at once with its file and line, not hours in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slimecore.data.dataset import DataError, json_field, read_rows
from slimecore.data.source import PromptDataSource
from slimecore.data.tasks import get_task
from slimecore.types import Sample, Status
from slime_sft.masks import ConversationEncoder, check_messages, trainable_response

log = logging.getLogger("slime_sft")


@dataclass
class Conversation:
    where: str  # "file, line N" or "task:NAME, row N": every error about this conversation names it
    messages: list[dict]
    tools: list | None = None
    label: Any = None
    metadata: dict = field(default_factory=dict)


def read_conversations(config) -> list[Conversation]:
    """The run's conversations, each checked with ``check_messages`` (DataError names the file and line)."""
    if config.prompt_data is None:
        task = get_task(config.task)
        return [Conversation(f"task:{task.name}, row {n}", [{"role": "user", "content": row["input"]},
                                                             {"role": "assistant", "content": row["label"]}],
                             label=row["label"], metadata=row["metadata"])
                for n, row in enumerate(task.make_rows(config.task_size, config.rollout_seed), start=1)]
    key, conversations = config.input_key, []
    for where, row in read_rows(config.prompt_data):
        if key not in row:
            raise DataError(f"{where}: no key {key!r} (keys present: {sorted(row)}); set --input-key to the key "
                            "holding the conversation (slime's SFT data uses --input-key messages)")
        messages = json_field(row, key, where, list)
        check_messages(messages, where, key)
        tools = json_field(row, config.tool_key, where, list) if config.tool_key else None
        metadata = dict((json_field(row, config.metadata_key, where, dict) or {}) if config.metadata_key else {})
        if tools is not None:
            metadata["tools"] = tools
        if config.label_key and config.label_key not in row:
            raise DataError(f"{where}: no key {config.label_key!r} (keys present: {sorted(row)}); fix --label-key "
                            "or leave it unset (SFT does not need labels)")
        label = row[config.label_key] if config.label_key else None
        conversations.append(Conversation(where, messages, tools, label, metadata))
    return conversations


def stop_token_ids(checkpoint: str, tokenizer) -> set[int]:
    """The model's EOS ids from its HF config, tokenizer and generation_config: the ids the engine stops at."""
    from transformers import AutoConfig, GenerationConfig

    sources = [tokenizer.eos_token_id, AutoConfig.from_pretrained(checkpoint).eos_token_id]
    if (Path(checkpoint) / "generation_config.json").is_file():
        sources.append(GenerationConfig.from_pretrained(checkpoint).eos_token_id)
    return {t for s in sources for t in (s if isinstance(s, list) else [s]) if t is not None}


class SFTDataSource(PromptDataSource):
    """Encoded conversations, one sample per group, drawn in order (or shuffled per epoch with
    ``--rollout-shuffle``) epoch after epoch; position and epoch are checkpointed like the prompt source's.
    Each sample arrives complete: tokens, ``response_length`` from the first trained token, its loss mask,
    reward 0, status COMPLETED (TRUNCATED when ``max_len`` cut it)."""

    @classmethod
    def load(cls, config, tokenizer, max_len: int | None = None, encoder: ConversationEncoder | None = None
             ) -> "SFTDataSource":
        encoder = encoder or ConversationEncoder(tokenizer, stop_token_ids(config.hf_checkpoint, tokenizer),
                                                 config.apply_chat_template_kwargs)
        records, dropped = [], 0
        for conv in read_conversations(config):
            response = trainable_response(*encoder.encode(conv.messages, conv.tools, conv.where), max_len)
            if response is None:
                dropped += 1
                continue
            tokens, response_length, loss_mask, truncated = response
            records.append({"prompt": conv.messages, "tokens": tokens, "label": conv.label, "metadata": conv.metadata,
                            "response_length": response_length, "loss_mask": loss_mask, "truncated": truncated})
        if dropped:
            log.warning("dropped %d of %d conversations with no trained token within --sft-max-len %s",
                        dropped, dropped + len(records), max_len)
        if not records:
            raise DataError(f"every conversation ({dropped}) loses all its assistant tokens to --sft-max-len "
                            f"{max_len}; raise it")
        return cls(records, 1, shuffle=config.rollout_shuffle, seed=config.rollout_seed, num_filtered=dropped)

    def _new_group(self, record: dict) -> list[Sample]:
        group = super()._new_group(record)
        for sample in group:
            sample.response_length, sample.loss_mask = record["response_length"], list(record["loss_mask"])
            sample.status = Status.TRUNCATED if record["truncated"] else Status.COMPLETED
            sample.reward = 0.0
        return group
