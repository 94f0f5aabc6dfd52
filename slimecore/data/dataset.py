"""Prompt files like slime's: ``.jsonl`` or ``.parquet``, optionally sliced with ``path@[start:end]``; also a
local Hugging Face ``datasets`` directory (``Dataset.save_to_disk``) or a folder of ``.parquet`` / ``.arrow``
shards (a dataset repository's layout), read with pyarrow alone: ``datasets`` need not be installed.

``read_rows`` gives ``(where, row)`` pairs, ``where`` being ``"file, line N"`` (jsonl) or ``"file, row N"``
(parquet), so every later complaint can point at the row. ``to_prompts`` turns rows into prompt records
``{"prompt", "tokens", "label", "metadata"}``: the chat template is applied when asked, metadata is parsed,
tools are kept in ``metadata["tools"]`` (where slime's multi-turn code looks for them) and prompts longer
than ``--rollout-max-prompt-len`` tokens are dropped, counted and logged.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from slimecore.errors import DataError

log = logging.getLogger("slimecore.data")

# Only a trailing "@[...]" is a slice, so paths that contain "@" elsewhere still work.
_SLICE_SUFFIX = re.compile(r"^(?P<path>.+)@\[(?P<inside>[^\]]*)\]$")
_SLICE_INSIDE = re.compile(r"^\s*(?P<start>-?\d*)\s*:\s*(?P<end>-?\d*)\s*$")
SUFFIXES = (".jsonl", ".parquet")


def parse_spec(spec: str) -> tuple[Path, slice]:
    """``data.jsonl@[10:-5]`` -> ``(Path("data.jsonl"), slice(10, -5))``; python slice semantics."""
    match = _SLICE_SUFFIX.match(spec)
    if match is None:
        if "@[" in spec:
            raise DataError(f"--prompt-data {spec!r}: bad slice; write path@[start:end], e.g. data.jsonl@[0:1000]")
        return Path(spec), slice(None)
    inside = _SLICE_INSIDE.match(match["inside"])
    if inside is None:
        raise DataError(f"--prompt-data {spec!r}: bad slice [{match['inside']}]; write path@[start:end] with "
                        "integers (either may be empty or negative), e.g. data.jsonl@[0:1000] or data.jsonl@[-100:]")
    start, end = (int(inside[k]) if inside[k] else None for k in ("start", "end"))
    return Path(match["path"]), slice(start, end)


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    rows = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                                "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one "
                                "JSON object, e.g. {\"input\": \"...\", \"label\": \"...\"}") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object, got a {type(row).__name__}; each line must be "
                                "one object with the prompt under --input-key")
            rows.append((where, row))
    return rows


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except pa.ArrowException as exc:
        raise DataError(f"{path}: cannot be read as parquet ({exc}); check the file or give a .jsonl") from None
    return [(f"{path}, row {number}", row) for number, row in enumerate(table.to_pylist(), start=1)]


def _read_arrow(path: Path) -> "pyarrow.Table":
    """One ``.arrow`` shard: the IPC stream format ``datasets`` writes, or the IPC file format."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).read_all()


def _dataset_shards(directory: Path) -> list[Path]:
    """The data files of a dataset directory, in row order.

    - ``save_to_disk`` of a ``Dataset``: ``state.json`` lists the ``.arrow`` shards;
    - ``save_to_disk`` of a ``DatasetDict``: ``dataset_dict.json`` names the splits, each a sub-directory (a
      single split is used; with several, the user names one);
    - any other folder: its ``.parquet`` files, else its ``.arrow`` files, searched recursively (a dataset
      repository's ``data/train-00000-of-00002.parquet`` ...), in name order.
    """
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text()).get("splits") or []
        if len(splits) != 1:
            raise DataError(f"{directory} is a saved DatasetDict with splits {', '.join(splits)}; point --prompt-data "
                            f"at one of them, e.g. {directory / (splits[0] if splits else 'train')}")
        return _dataset_shards(directory / splits[0])
    if (directory / "state.json").is_file():
        files = json.loads((directory / "state.json").read_text()).get("_data_files") or []
        return [directory / f["filename"] for f in files]
    for suffix in (".parquet", ".arrow"):
        shards = sorted(p for p in directory.rglob(f"*{suffix}") if p.is_file())
        if shards:
            return shards
    raise DataError(f"{directory} is a directory but holds no dataset: no state.json / dataset_dict.json "
                    "(datasets' save_to_disk) and no .parquet or .arrow files; point --prompt-data at a .jsonl / "
                    ".parquet file or such a directory")


def _read_dataset_dir(directory: Path) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for shard in _dataset_shards(directory):
        try:
            table = pq.read_table(shard) if shard.suffix == ".parquet" else _read_arrow(shard)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{shard} (in the dataset directory {directory}) cannot be read: {exc}") from None
        rows += [(f"{shard}, row {number}", row) for number, row in enumerate(table.to_pylist(), start=1)]
    return rows


def read_rows(spec: str) -> list[tuple[str, dict]]:
    """``(where, row)`` pairs of a ``.jsonl`` / ``.parquet`` file or a dataset directory, after the optional
    ``@[start:end]`` slice (over all of a directory's rows, in order)."""
    path, part = parse_spec(spec)
    if path.is_dir():
        rows = _read_dataset_dir(path)
    elif not path.is_file():
        raise DataError(f"prompt file {path} does not exist (from --prompt-data {spec!r}); check the path, or "
                        "omit --prompt-data to train on the built-in --task")
    elif path.suffix not in SUFFIXES:
        raise DataError(f"prompt file {path}: unknown extension {path.suffix!r}; use .jsonl (one JSON object per "
                        "line) or .parquet")
    else:
        rows = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    if not rows:
        raise DataError(f"prompt file {path} has no rows; fill it (one JSON object per line) or point "
                        "--prompt-data at another file")
    past = [bound for bound in (part.start, part.stop) if bound is not None and abs(bound) > len(rows)]
    if past:
        raise DataError(f"--prompt-data {spec!r}: the slice reaches row {past[0]} but {path} has {len(rows)} rows; "
                        f"give bounds within -{len(rows)}..{len(rows)} (an open end, e.g. @[{part.start or 0}:], "
                        "takes the rest)")
    chosen = rows[part]
    if not chosen:
        raise DataError(f"--prompt-data {spec!r}: the slice selects none of the {len(rows)} rows; "
                        f"use a range within 0..{len(rows)}")
    return chosen


def json_field(row: dict, key: str, where: str, kind: type):
    """``row[key]`` as a ``kind`` (dict or list); a JSON string of one is decoded (parquet often stores them so)."""
    value = row.get(key)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise DataError(f"{where}: {key!r} is a string but not JSON; give a JSON {kind.__name__} "
                            "or a string holding one") from None
    if value is not None and not isinstance(value, kind):
        raise DataError(f"{where}: {key!r} must be a {kind.__name__} (or a JSON string of one), "
                        f"got {_described(value)}")
    return value


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def _chat_messages(prompt: list, where: str, input_key: str) -> None:
    for number, message in enumerate(prompt, start=1):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise DataError(f"{where}: {input_key!r} message {number} has role {role!r}; chat messages need a role "
                            f"among {', '.join(CHAT_ROLES)}")
        if message.get("content") is None and not message.get("tool_calls"):
            raise DataError(f"{where}: {input_key!r} message {number} ({role}) has no 'content'; give its text")


def parse_row(where: str, row: dict, *, input_key: str, label_key: str | None, metadata_key: str | None,
              tool_key: str | None, apply_chat_template: bool) -> tuple[list[dict] | str, object, dict, list | None]:
    """One row's ``(prompt: chat messages or plain text, label, metadata, tools)``; a DataError names the row."""
    if input_key not in row:
        raise DataError(f"{where}: no key {input_key!r} (keys present: {sorted(row)}); set --input-key to the "
                        "key holding the prompt")
    if label_key and label_key not in row:
        raise DataError(f"{where}: no key {label_key!r} (keys present: {sorted(row)}); set --label-key to the "
                        "key holding the answer, or leave it unset for unlabelled prompts")
    metadata = dict((json_field(row, metadata_key, where, dict) or {}) if metadata_key else {})
    tools = json_field(row, tool_key, where, list) if tool_key else None
    if tools is not None:
        metadata["tools"] = tools
    prompt = row[input_key]
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) and prompt:
        _chat_messages(prompt, where, input_key)
        if not apply_chat_template:
            raise DataError(f"{where}: {input_key!r} is a list of chat messages; add --apply-chat-template "
                            "so the tokenizer's template renders them")
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: {input_key!r} must be a string or a list of chat messages ({{\"role\", "
                        f"\"content\"}} objects), got {_described(prompt)}; point --input-key at the prompt text")
    return prompt, (row[label_key] if label_key else None), metadata, tools


def _described(value) -> str:
    """``a list of 3 int`` / ``an empty list`` / ``a float``: what a row holds, for a message (a parquet list column
    arrives as a Python list of its element type)."""
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(item).__name__ for item in value})
        return f"a list of {len(value)} {' / '.join(kinds)} values" if value else "an empty list"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def to_prompts(rows: list[tuple[str, dict]], tokenizer, *, input_key: str, label_key: str | None,
               metadata_key: str | None, tool_key: str | None, apply_chat_template: bool,
               chat_template_kwargs: dict | None = None, max_prompt_len: int | None = None,
               source: str = "prompts", limit_name: str = "--rollout-max-prompt-len") -> tuple[list[dict], int]:
    """Rows -> prompt records; returns ``(records, number dropped as longer than max_prompt_len)``.

    ``input`` is a string (wrapped as one user message for the chat template) or a list of chat messages
    (which needs ``apply_chat_template``). Token ids are computed without extra special tokens: the text
    is exactly what the engine sees, so ``tokens`` and the engine's prompt agree. ``limit_name`` says where
    ``max_prompt_len`` comes from, for the log line.
    """
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{source}: --apply-chat-template is set but the tokenizer has no chat template; "
                        "drop the flag or use a checkpoint whose tokenizer_config has one")
    texts, labels, metadatas = [], [], []
    for where, row in rows:
        prompt, label, metadata, tools = parse_row(where, row, input_key=input_key, label_key=label_key,
                                                   metadata_key=metadata_key, tool_key=tool_key,
                                                   apply_chat_template=apply_chat_template)
        if apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            try:
                prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                       add_generation_prompt=True, **(chat_template_kwargs or {}))
            except Exception as exc:  # jinja raises its own errors from inside the template
                raise DataError(f"{where}: the tokenizer's chat template failed on this row "
                                f"({type(exc).__name__}: {exc}); fix the messages or --apply-chat-template-kwargs")
        texts.append(prompt)
        labels.append(label)
        metadatas.append(metadata)
    # One batched call: much faster than one tokenizer call per row for the 10k-prompt built-in tasks.
    token_ids = tokenizer(texts, add_special_tokens=False).input_ids if texts else []
    records, filtered = [], 0
    for text, ids, label, metadata in zip(texts, token_ids, labels, metadatas):
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            filtered += 1
            continue
        records.append({"prompt": text, "tokens": list(ids), "label": label, "metadata": metadata})
    if filtered:
        log.warning("%s: dropped %d of %d prompts longer than %s %d tokens", source, filtered, len(texts),
                    limit_name, max_prompt_len)
    return records, filtered
