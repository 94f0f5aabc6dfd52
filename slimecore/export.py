"""The trained model as an HF checkpoint any HF tool loads: ``AutoModelForCausalLM``, ``AutoTokenizer``,
``pipeline("text-generation")``, vLLM, SGLang.

Both backends hand over HF-named full weights (``named_weights``: fsdp's own, LoRA merged; megatron's through
the model bridge's export), so one writer serves both. The folder is what ``save_pretrained`` writes:
safetensors (sharded above 5 GB, with an index), ``config.json`` with the weights' dtype, ``generation_config.json``
and the tokenizer with its chat template, all taken from ``--hf-checkpoint``. It is written to a temporary
folder and renamed, so a crash never leaves a half-written model under the final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch


def write_hf_model(weights: dict[str, torch.Tensor], source: str, directory: str | Path) -> Path:
    """Write ``weights`` (HF names) with ``source``'s config, generation config and tokenizer to ``directory``."""
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    directory = Path(directory)
    config = AutoConfig.from_pretrained(source)
    if getattr(config, "tie_word_embeddings", False):
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}  # tied: the embedding is the head
    config.dtype = next(iter(weights.values())).dtype
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _quiet_hub():
        save_torch_state_dict(weights, tmp, metadata={"format": "pt"})
    config.save_pretrained(tmp)
    try:
        generation = GenerationConfig.from_pretrained(source)
    except OSError:  # the checkpoint ships none: the model config's generation defaults, as save_pretrained does
        generation = GenerationConfig.from_model_config(config)
    generation.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(source).save_pretrained(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


@contextlib.contextmanager
def _quiet_hub():
    """No per-shard progress bar: the run's own display says what is being written."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()
