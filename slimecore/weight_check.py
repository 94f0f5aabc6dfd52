"""The weight-sync sentinel: after a sync every engine reports a checksum of what it serves, compared with the
checksum of what the trainer sent (``--check-weights``).

The engines answer SGLang's own ``/weights_checker`` (``CheckWeightsReqInput``: ``{"action": "checksum"}``):
``{"success", "message", "ranks": [ChecksumInfo, one per TP rank], "per_engine_checksum"}``, where a rank's
``ChecksumInfo`` is ``{"checksums": {name: 16 hex digits}, "per_gpu_checksum", "parallelism_info"}``,
``per_gpu_checksum`` the SHA-256 over the sorted (name, checksum) pairs and ``per_engine_checksum`` the SHA-256
over the ranks' ``per_gpu_checksum`` in rank order.

A tensor's checksum is the engine's: SGLang hashes CUDA tensors with its own kernel
(``sglang.srt.managers.mm_utils.tensor_hash``), which the trainer calls on its CUDA tensors; the embedded CPU
engine and a CPU trainer use xxh3-64 of the tensor's bytes (10x cheaper than SGLang's SHA-256 CPU path: a
SmolLM2 checksum takes ~0.06 s on one core, ``benchmarks/weight_check.py``).

What is compared:
- the embedded engine holds the trainer's HF-named tensors as they are, so every tensor the trainer sent is
  compared;
- an SGLang engine fuses (``qkv_proj``, ``gate_up_proj``), shards and pads its tensors, so only the tensors
  it holds under the HF name and shape are compared: the 1-D ones (norm weights, which every training step
  moves, so a sync that answered 200 without transferring is still caught); and every engine of the same
  layout must report the same ``per_engine_checksum``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("slimecore.weights")

CHECK_WEIGHTS = ("every", "first", "never")
# SGLang leaves these out of its checksum (non-persistent buffers recomputed at load, not weights)
NON_WEIGHT_PATTERNS = ("cos_sin_cache", "inv_freq", "freqs_cis", "_weight_fp32")
SHOWN = 5  # differing tensors named in the error


class WeightCheckError(RuntimeError):
    """After a sync an engine does not hold the weights the trainer sent; the message names the engine, the
    weight version and the first differing tensors."""


def tensor_checksum(tensor: torch.Tensor) -> str | None:
    """16 hex digits: SGLang's own hash for a CUDA tensor (what an SGLang engine reports; None where this process
    cannot import sglang, and the tensor is then not compared), xxh3-64 of the bytes for a CPU tensor (what the
    embedded engine reports)."""
    if tensor.is_cuda:
        try:
            from sglang.srt.managers.mm_utils import tensor_hash
        except ImportError:
            return None
        return f"{tensor_hash(tensor):016x}"
    import torch
    import xxhash

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_hexdigest(data)


def checksums(named: Iterable[tuple[str, torch.Tensor]], only_1d: bool = False) -> dict[str, str]:
    """``{name: tensor_checksum}``, a tensor listed under two names (tied embeddings) hashed once; ``only_1d``:
    the tensors an SGLang engine keeps under their HF name."""
    names, unique = {}, {}
    for name, tensor in named:
        if not only_1d or tensor.dim() == 1:
            names[name] = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
            unique.setdefault(names[name], tensor)
    # the hash releases the GIL: the tensors are hashed on every core (memory-bound; on a 2-core machine
    # SmolLM2's 540 MB took ~30 ms instead of ~75 ms while other processes ran)
    sums = dict(zip(unique, _hash_pool().map(tensor_checksum, unique.values())))
    return {name: sums[key] for name, key in names.items() if sums[key] is not None}


@functools.lru_cache(maxsize=1)
def _hash_pool():
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="slimecore-checksum")


def is_weight(name: str) -> bool:
    return not any(pattern in name for pattern in NON_WEIGHT_PATTERNS)


def checksum_info(named: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """One rank's ``ChecksumInfo`` (SGLang's shape) for a single-rank CPU engine."""
    sums = checksums((n, t) for n, t in named if is_weight(n))
    digest = hashlib.sha256()
    for name in sorted(sums):
        digest.update(name.encode())
        digest.update(sums[name].encode())
    return {"checksums": sums, "per_gpu_checksum": digest.hexdigest(),
            "parallelism_info": {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                                 "rank": 0, "size": 1}}


def checker_response(ranks: list[dict]) -> dict:
    """The ``/weights_checker`` body for ``ranks`` (``ChecksumInfo`` each), as SGLang's tokenizer manager builds it."""
    digest = hashlib.sha256()
    for rank in ranks:
        digest.update(rank["per_gpu_checksum"].encode())
    return {"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": digest.hexdigest()}


def differences(expected: dict[str, str], answer: dict, every_name: bool) -> list[str]:
    """Names whose checksum the engine's ``/weights_checker`` answer does not match, in the trainer's order.
    ``every_name``: the engine must report every expected name (the embedded engine); else names it does not
    report under the same name are not compared (an SGLang engine's fused tensors). A name the trainer sent that
    TP ranks report differently (a sharded tensor) is not compared either."""
    reported: dict[str, set[str]] = {}
    for rank in answer.get("ranks") or []:
        for name, value in (rank.get("checksums") or {}).items():
            reported.setdefault(name, set()).add(value)
    out = []
    for name, value in expected.items():
        got = reported.get(name)
        if got is None:
            if every_name:
                out.append(f"{name} (not reported by the engine)")
        elif len(got) == 1 and value not in got:
            out.append(name)
    return out


def check_answers(expected: dict[str, str], answers: dict[str, dict], version: str, every_name: bool) -> int:
    """Raise :class:`WeightCheckError` for the first engine (URL -> its ``/weights_checker`` answer) that does not
    hold ``expected``, or for engines of one layout reporting different ``per_engine_checksum``; returns how many
    tensors were compared per engine."""
    compared = 0
    for url, answer in answers.items():
        if not isinstance(answer, dict) or not answer.get("success") or not answer.get("ranks"):
            raise WeightCheckError(f"engine {url} did not report a weight checksum after the sync of weights "
                                   f"v{version}: /weights_checker answered {str(answer)[:300]}; an engine without "
                                   "SGLang's /weights_checker needs --check-weights never")
        wrong = differences(expected, answer, every_name)
        if wrong:
            raise WeightCheckError(
                f"engine {url} does not hold the weights v{version} the trainer sent: {len(wrong)} tensor(s) differ, "
                f"first {', '.join(wrong[:SHOWN])}. The sync reported success but did not transfer (or corrupted) "
                "them; the run stops here rather than sample from wrong weights (--check-weights never turns this "
                "check off)")
        compared = len([n for n in expected if any(n in (r.get("checksums") or {}) for r in answer["ranks"])])
    layouts: dict[str, dict[str, str]] = {}
    for url, answer in answers.items():
        layout = repr([sorted(r.get("parallelism_info", {}).items()) for r in answer["ranks"]])
        layouts.setdefault(layout, {})[url] = answer["per_engine_checksum"]
    for same in layouts.values():
        if len(set(same.values())) > 1:
            raise WeightCheckError(f"after the sync of weights v{version} the engines report different weights "
                                   f"(per_engine_checksum): {same}")
    return compared


def check_engines(expected: dict[str, str], urls: list[str], version: str, every_name: bool,
                  api_key: str | None = None, timeout: float = 600) -> int:
    """Ask every engine at ``urls`` for its checksum (``POST /weights_checker {"action": "checksum"}``, at once)
    and :func:`check_answers`; returns how many tensors were compared per engine."""
    from concurrent.futures import ThreadPoolExecutor

    from slimecore.http_client import http_json

    def ask(url: str):
        try:
            return http_json("POST", url + "/weights_checker", {"action": "checksum"}, timeout=timeout,
                             api_key=api_key)[1]
        except OSError as exc:  # no connection: the engine died (an HTTP error is an answer, checked below)
            return _Unreachable(str(exc))

    with ThreadPoolExecutor(max_workers=max(len(urls), 1), thread_name_prefix="slimecore-weight-check") as pool:
        answers = dict(zip(urls, pool.map(ask, urls)))
    for url, answer in list(answers.items()):
        if isinstance(answer, _Unreachable):
            # it died after the sync: the fault monitor restarts it, and the restarted engine is checked after
            # the trainers push the weights to it again, before it goes back in the router
            log.warning("weight check v%s: engine %s cannot be reached (%s); not checked here, the fault monitor "
                        "restarts it and checks it after the push again", version, url, answer.reason)
            del answers[url]
    return check_answers(expected, answers, version, every_name)


class _Unreachable:
    def __init__(self, reason: str):
        self.reason = reason


def due(mode: str, syncs_checked: int) -> bool:
    """``--check-weights``: every sync, the first one only, or never."""
    return mode == "every" or (mode == "first" and syncs_checked == 0)
