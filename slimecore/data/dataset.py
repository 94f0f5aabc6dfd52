"""Prompt files like slime's: ``.jsonl`` or ``.parquet``, optionally sliced with ``path@[start:end]``.

Rows become prompt records ``{"prompt", "label", "metadata"}``; every problem is reported with the file,
line and key, and what to do about it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

log = logging.getLogger("slimecore.data")
_SLICE = re.compile(r"^(?P<path>.+)@\[(?P<start>-?\d*):(?P<end>-?\d*)\]$")


class DataError(ValueError):
    """A prompt file that cannot be used as it is; the message names the file, line and key."""


def parse_spec(spec: str) -> tuple[Path, slice]:
    """``data.jsonl@[10:-5]`` -> (Path, slice(10, -5))."""
    if "@" in spec:
        match = _SLICE.match(spec)
        if not match:
            raise DataError(f"--prompt-data {spec!r}: bad slice; write path@[start:end], e.g. data.jsonl@[0:1000]")
        start = int(match["start"]) if match["start"] else None
        end = int(match["end"]) if match["end"] else None
        return Path(match["path"]), slice(start, end)
    return Path(spec), slice(None)


def read_rows(spec: str) -> list[tuple[int, dict]]:
    """(line number, row) pairs of a jsonl/parquet file, after the slice."""
    path, part = parse_spec(spec)
    if not path.is_file():
        raise DataError(f"prompt file {path} does not exist (from {spec!r})")
    if path.suffix == ".jsonl" or path.suffix == ".json":
        rows = []
        with path.open() as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}, line {number}: invalid JSON ({exc.msg} at column {exc.colno}); "
                                    "each line must be one JSON object") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}, line {number}: expected a JSON object, got {type(row).__name__}")
                rows.append((number, row))
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = list(enumerate(pq.read_table(path).to_pylist(), start=1))
    else:
        raise DataError(f"prompt file {path}: unknown extension {path.suffix!r}; use .jsonl or .parquet")
    if not rows:
        raise DataError(f"prompt file {path} has no rows")
    return rows[part]


def to_prompts(rows: list[tuple[int, dict]], source: str, tokenizer, *, input_key: str, label_key: str | None,
               metadata_key: str | None, tool_key: str | None, apply_chat_template: bool,
               chat_template_kwargs: dict | None = None, max_prompt_len: int | None = None) -> tuple[list[dict], int]:
    """Rows -> prompt records (text, token ids, label, metadata); returns (records, number filtered as too long)."""
    records, filtered = [], 0
    for number, row in rows:
        where = f"{source}, line {number}"
        if input_key not in row:
            raise DataError(f"{where}: no key {input_key!r} (keys: {sorted(row)}); set --input-key to the prompt's key")
        if label_key and label_key not in row:
            raise DataError(f"{where}: no key {label_key!r} (keys: {sorted(row)}); set --label-key or drop it")
        metadata = row.get(metadata_key) if metadata_key else None
        if isinstance(metadata, str):
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError:
                raise DataError(f"{where}: {metadata_key!r} is a string but not JSON; give an object") from None
        if metadata is not None and not isinstance(metadata, dict):
            raise DataError(f"{where}: {metadata_key!r} must be an object, got {type(metadata).__name__}")
        prompt = row[input_key]
        if apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            tools = row.get(tool_key) if tool_key else None
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                                 **(chat_template_kwargs or {}))
        elif isinstance(prompt, str):
            text = prompt
        else:
            raise DataError(f"{where}: {input_key!r} is a list of messages; add --apply-chat-template")
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            filtered += 1
            continue
        records.append({"prompt": text, "tokens": ids, "label": row.get(label_key) if label_key else None,
                        "metadata": dict(metadata or {})})
    if filtered:
        log.warning("%s: dropped %d prompts longer than --rollout-max-prompt-len %s", source, filtered, max_prompt_len)
    return records, filtered
