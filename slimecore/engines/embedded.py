"""The embedded CPU inference engine: an HF transformers model behind SGLang's native HTTP API.

It answers the endpoints the router and slime-style rollouts use (``/generate``, ``/health``,
``/model_info``, ``/server_info``, ``/abort_request``, ``/v1/loads``, ``/flush_cache``,
``/pause_generation``, ``/continue_generation``, the weight-sync endpoints ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/release_memory_occupation``, ``/resume_memory_occupation``, weight
version), with the same request and response shapes as SGLang, bound to 127.0.0.1 (or the node's address
with an API key, as SGLang's ``--api-key``). The aiohttp
routes live in :mod:`slimecore.engines.http`; this module holds the model, the scheduler and the
request state they drive.

Batching (continuous, on one scheduler thread): the scheduler collects the waiting requests (up to
``max_batch_size``, 64 by default; it starts once no request came for a few milliseconds), prefills them
together with HF's forward (left padding, attention mask, position ids from the mask) and decodes step by
step with the HF KV cache, through the engine's own decode step for Llama/Qwen2/Qwen3
(:mod:`slimecore.engines.fastpath`) and HF's forward for other architectures. Identical prompts (the n
samples of one prompt) are prefilled once and their rows copied; prompts that start with the same tokens
(a shared chat template) prefill that prefix once, as SGLang's prefix cache does, and the cache layers
write each step into a buffer grown by chunks, not a new concatenated copy. A finished row leaves the
batch at once (its KV rows are dropped); requests that arrive meanwhile are prefilled on their own and
join the running batch, their cache left-padded to the same length.
Joining stops while a weight update waits, so updates are never starved.

Log-probs: for each sampled token, ``log_softmax(logits / T)`` over the full vocabulary (T = 1 for
greedy), without top-p/top-k/min-p renormalisation, exactly as SGLang returns them. Padding is masked
out, so this equals the log-prob from a single *unpadded* forward of prompt + response, which is what
the trainer computes: the two agree to float32 rounding (tested < 1e-4). Only logit adjustments a
request asks for (penalties, ``logit_bias``, the stop-token ban before ``min_new_tokens``) are applied
before the softmax, as SGLang does; the trainer cannot reproduce those.

Weights: a generation wave holds ``_weights_lock``; every weight update (``load_weights`` underneath the
object-store, disk, tensor and distributed paths) takes it too, so they wait for the running requests (none run while
paused) and the requests queued meanwhile start on the new weights.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import math
import pickle
import re
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from slimecore import aio
from slimecore.engines.fastpath import FastDecoder
from slimecore.engines.http import BadRequest, build_app, run_app

log = logging.getLogger("slimecore.engine")
VERSION = "slimecore-embedded-0.2"
DEFAULT_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": 128,
                    "min_new_tokens": 0, "stop": [], "stop_token_ids": [], "stop_regex": [], "ignore_eos": False,
                    "no_stop_trim": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
                    "n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                    "sampling_seed": None, "logit_bias": None, "json_schema": None, "regex": None, "ebnf": None,
                    "structural_tag": None, "custom_params": None, "stream_interval": None}
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


def _reasoning_tokens(req: Request) -> int:
    """SGLang's ``meta_info.reasoning_tokens``: with ``require_reasoning`` and a model that has a ``</think>`` token,
    the output tokens up to and including the first one (all of them while it has not come); else 0."""
    if req.think_end is None:
        return 0
    ids = req.output_ids
    return ids.index(req.think_end) + 1 if req.think_end in ids else len(ids)


@dataclass(eq=False)  # identity: the queues find and remove requests with ``in`` / ``remove``
class Request:
    """One ``/generate`` call, from submission to its response."""

    rid: str
    input_ids: list[int]
    params: dict
    return_logprob: bool
    logprob_start_len: int = -1
    stop_ids: frozenset[int] = frozenset()
    done: threading.Event = field(default_factory=threading.Event)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict | None = None
    aborted: bool = False  # set by /abort_request; the decode loop finishes the row after its current step
    think_end: int | None = None  # the model's end-of-thinking token, when the request set require_reasoning
    created: float = field(default_factory=time.perf_counter)
    on_done: Callable[[], None] | None = None  # called once, on the finishing thread, after ``done`` is set

    def finished(self) -> asyncio.Future:
        """A future of the running event loop, resolved when the request finishes: an HTTP handler awaits it
        instead of holding an executor thread per request. Call it before ``submit``."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def resolve() -> None:
            if not future.done():
                future.set_result(None)

        def on_done() -> None:
            if not loop.is_closed():  # a stopped server's loop: nobody waits any more
                loop.call_soon_threadsafe(resolve)

        self.on_done = on_done
        return future

    @cached_property  # the params never change: asked per row and step
    def adjusts_logits(self) -> bool:
        p = self.params
        return bool(p["frequency_penalty"] or p["presence_penalty"] or p["repetition_penalty"] != 1.0
                    or p["logit_bias"] or p["min_new_tokens"])

    @cached_property
    def draws_alone(self) -> bool:
        """Top-k/top-p/min-p filtering: this row cannot share the batched draw."""
        p = self.params
        return p["top_k"] > 0 or p["top_p"] < 1 or p["min_p"] > 0


def _is_batch(body: dict) -> bool:
    """SGLang's batch form of /generate: ``text`` a list, or ``input_ids`` a list of token lists."""
    ids = body.get("input_ids")
    return isinstance(body.get("text"), list) or (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list))


def _number(p: dict, key: str, low: float, high: float, integer: bool = False, low_open: bool = False) -> None:
    value = p[key]
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and not math.isfinite(value)):
        raise BadRequest(f"{key} must be a finite {'integer' if integer else 'number'}, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise BadRequest(f"{key} must be in {'(' if low_open else '['}{low}, {high}], got {value}")


def validate_sampling_params(params: Mapping) -> dict:
    """SGLang's checks of ``sampling_params`` (its ``SamplingParams.verify``) over the defaults; an explicit null means the default,
    except ``max_new_tokens: null``, which means "up to the context length"."""
    if not isinstance(params, Mapping):
        raise BadRequest("sampling_params must be an object")
    unknown = set(params) - set(DEFAULT_SAMPLING)
    if unknown:
        raise BadRequest(f"unknown sampling_params {sorted(unknown)}")
    p = dict(DEFAULT_SAMPLING)
    p.update({k: v for k, v in params.items() if v is not None or k == "max_new_tokens"})
    for key in ("stop", "stop_regex"):
        p[key] = [p[key]] if isinstance(p[key], str) else list(p[key])
        if not all(isinstance(s, str) for s in p[key]):
            raise BadRequest(f"{key} must be a string or a list of strings")
    p["stop"] = [s for s in p["stop"] if s]
    p["stop_token_ids"] = [t for t in p["stop_token_ids"] if t is not None]
    if not all(isinstance(t, int) for t in p["stop_token_ids"]):
        raise BadRequest("stop_token_ids must be a list of integers")
    _number(p, "temperature", 0, math.inf)
    _number(p, "top_p", 0, 1, low_open=True)
    _number(p, "min_p", 0, 1)
    _number(p, "frequency_penalty", -2, 2)
    _number(p, "presence_penalty", -2, 2)
    _number(p, "repetition_penalty", 0, 2, low_open=True)
    _number(p, "top_k", -1, math.inf, integer=True)
    if p["top_k"] == 0:
        raise BadRequest("top_k must be -1 (whole vocabulary) or at least 1, got 0")
    if p["max_new_tokens"] is not None:
        _number(p, "max_new_tokens", 0, math.inf, integer=True)
    _number(p, "min_new_tokens", 0, math.inf if p["max_new_tokens"] is None else p["max_new_tokens"], integer=True)
    if p["n"] != 1:
        raise BadRequest("n > 1 (parallel sampling) is not supported by the CPU embedded engine; send n requests")
    constrained = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if p[k] is not None]
    if constrained:
        raise BadRequest(f"constrained decoding ({constrained[0]}) is not supported by the CPU embedded engine")
    if p["sampling_seed"] is not None:
        _number(p, "sampling_seed", -(2**63), 2**63 - 1, integer=True)
    for key in ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"):
        p[key] = bool(p[key])
    if p["temperature"] < 1e-6:  # SGLang's greedy rewrite: argmax, log-probs at temperature 1
        p.update(temperature=1.0, top_k=1)
    return p


class _PauseGate(threading.Event):
    """``server.unpaused``: set while generation runs. Setting it wakes the scheduler, which then admits
    the requests held while paused."""

    def __init__(self, on_change):
        super().__init__()
        super().set()
        self._on_change = on_change

    def set(self) -> None:
        super().set()
        self._on_change()

    def clear(self) -> None:
        super().clear()
        self._on_change()


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (B, V), non-negative and not necessarily normalised, drawn with
    probability ``probs / probs.sum()`` by inverting the row's cumulative sum at the row's number of
    ``uniform`` (B, 1), in [0, 1].
    ``torch.multinomial`` draws one exponential number per token of the vocabulary (18 ms for 16 rows of a 49k
    vocabulary on one core here, against ~1 ms for this). A token of probability 0 is never drawn: the search
    takes the first index whose cumulative sum exceeds the point, and a point that rounds up to the total
    takes the last token of positive probability."""
    cdf = probs.cumsum(-1)  # (B, V)
    total = cdf[:, -1:].contiguous()
    point = uniform.to(cdf.dtype) * total
    return torch.minimum(torch.searchsorted(cdf, point, right=True), torch.searchsorted(cdf, total)).squeeze(1)


_MASK64 = (1 << 64) - 1


def _seeded_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends on ``(seed, position)`` only: splitmix64's finaliser of both, 53 bits.
    Counter-based (no state), as SGLang's seeded sampler hashes (seed, position), so a seeded request draws
    the same tokens whichever engine, batch or arrival order serves it."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / (1 << 53)


def _growing_layer_class():
    """HF's ``DynamicLayer`` whose ``update`` writes into a preallocated buffer (grown by chunks) instead
    of concatenating a new cache every step: the keys and values it hands attention are views of it.
    Made lazily, as transformers is imported only with the model."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        chunk = 64  # columns added when the buffer is full

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized or self.keys.numel() == 0:
                return super().update(key_states, value_states, *args, **kwargs)
            length, new = self.keys.shape[-2], key_states.shape[-2]
            # keys reassigned from outside (rows selected or joined, cache cropped): adopt them into a new buffer
            if getattr(self, "_view", None) is not self.keys or length + new > self._kbuf.shape[-2]:
                size = length + new + self.chunk
                kbuf = self.keys.new_empty((*self.keys.shape[:-2], size, self.keys.shape[-1]))
                vbuf = self.values.new_empty((*self.values.shape[:-2], size, self.values.shape[-1]))
                kbuf[..., :length, :], vbuf[..., :length, :] = self.keys, self.values
                self._kbuf, self._vbuf = kbuf, vbuf
            self._kbuf[..., length:length + new, :] = key_states
            self._vbuf[..., length:length + new, :] = value_states
            self.keys, self.values = self._kbuf[..., :length + new, :], self._vbuf[..., :length + new, :]
            self._view = self.keys
            return self.keys, self.values

    return GrowingLayer


@dataclass
class _Batch:
    """The decode state of the rows being generated: attention mask (B, L), last positions (B, 1), the
    KV cache and the logits (B, V) the next token is sampled from."""

    mask: torch.Tensor
    positions: torch.Tensor
    cache: object
    logits: torch.Tensor

    def select(self, keep: list[int]) -> None:
        """Keep only these rows, then drop the leading columns that are padding in every remaining row."""
        index = torch.tensor(keep)
        self.cache.batch_select_indices(index)
        self.mask, self.positions = self.mask[index], self.positions[index]
        first = int(self.mask.any(dim=0).int().argmax())
        if first:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def take(self, rows: list[int]) -> None:
        """Rows ``rows`` in that order, logits included; a row may be taken more than once."""
        self.select(rows)
        self.logits = self.logits[torch.tensor(rows)]

    def extend(self, other: _Batch) -> None:
        """Append ``other``'s rows, left-padding the shorter cache (masked, so the padding is never seen)."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for batch in (self, other):
            pad = width - batch.mask.shape[1]
            if pad:
                batch.mask = torch.nn.functional.pad(batch.mask, (pad, 0))
                for layer in batch.cache.layers:
                    layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, pad, 0))
                    layer.values = torch.nn.functional.pad(layer.values, (0, 0, pad, 0))
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys, mine.values = torch.cat([mine.keys, theirs.keys]), torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([self.mask, other.mask])
        self.positions = torch.cat([self.positions, other.positions])
        self.logits = torch.cat([self.logits, other.logits])


def _own_weights(model: torch.nn.Module) -> None:
    """Give every CPU parameter memory of its own. transformers maps the safetensors file and loads weights of
    the file's dtype as copy-on-write views of it, so the first weight update (the one before the first
    rollout) would copy each 4 KiB page on a fault: 0.6 s for SmolLM2-135M on a 2-core machine, against 0.17 s
    for one copy here, made while the trainer still loads."""
    for param in model.parameters():
        if param.device.type == "cpu":
            param.data = param.data.clone()


class EmbeddedServer:
    """One CPU engine: an HF causal LM from a local directory, served over SGLang's HTTP API.

    ``start()`` binds the HTTP server first (``/health`` answers 503 while the model loads), then loads
    the model and starts the scheduler; it returns the URL. ``stop()`` aborts everything and closes it.
    """

    def __init__(self, model_path: str | Path, host: str = "127.0.0.1", port: int = 0, max_batch_size: int = 64,
                 dtype: str = "float32", seed: int = 0, model_path_for_info: str | None = None,
                 num_threads: int = 1, api_key: str | None = None):
        self.model_path, self.host, self.port = str(model_path), host, port
        self.api_key = api_key  # SGLang's --api-key: every endpoint but /health* and /metrics needs the bearer token
        self.model_path_for_info = model_path_for_info or self.model_path
        self.max_batch_size, self.num_threads, self.seed = max_batch_size, num_threads, seed
        self.dtype = getattr(torch, dtype)
        self.gather_window = 0.05  # seconds an idle engine collects requests before it starts a batch, at most
        self.gather_quiet = 0.005  # ... and it starts at once when none arrived for this long
        self.weight_version = "default"
        self.ready = False
        self.generator = torch.Generator().manual_seed(seed)
        self.stats = {"waves": 0, "joined": 0, "last_wave_size": 0, "max_wave_size": 0, "generate_calls": 0}
        # request ids as unique as uuid4's without a system call per request (6% of the serving loop's time)
        self._rid_prefix, self._rid_count = uuid.uuid4().hex[:16], itertools.count()
        self._cond = threading.Condition()  # guards the queues below; notified on every change
        self._queue: deque[Request] = deque()  # waiting for the scheduler
        self._held: list[Request] = []  # arrived while paused: outside the scheduler, as in SGLang
        self._running: list[Request] = []  # taken by the scheduler, not finished yet
        self._inflight: dict[str, Request] = {}  # rid -> every unfinished request
        self._weights_lock = threading.Lock()
        self._update_waiting = threading.Event()  # a weight update waits: stop joining new requests
        self.unpaused = _PauseGate(self._notify)
        self._stop = threading.Event()
        self._loop = None
        self._weight_groups: dict[str, object] = {}  # /init_weights_update_group: name -> process group
        self._released: set[str] = set()  # memory tags released by /release_memory_occupation
        self._buffers: dict[str, torch.Tensor] = {}  # non-weight buffers (rotary tables) kept over a release
        self._weights_missing: set[str] = set()  # resumed weights not yet overwritten by an update
        self._mapped_bucket = None  # the last /update_weights_from_tensor bucket's shared memory, kept mapped

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 300) -> str:
        """Serve HTTP, load the model, start the scheduler; return the URL."""
        started = threading.Event()
        self._http_thread = threading.Thread(target=self._serve, args=(started,), daemon=True, name="engine-http")
        self._http_thread.start()
        if not started.wait(timeout):
            raise TimeoutError(f"embedded engine HTTP server did not start within {timeout}s")
        try:
            self._load_model()
        except BaseException:
            self.stop()
            raise
        self._sched_thread = threading.Thread(target=self._scheduler, daemon=True, name="engine-scheduler")
        self._sched_thread.start()
        self.ready = True
        return self.url

    def stop(self) -> None:
        """Abort every request, stop the scheduler and the HTTP server."""
        self.ready = False
        self._stop.set()
        self.abort(abort_all=True)
        with self._cond:
            for req in self._held:
                self._finish(req, ABORTED_WAITING)
            self._held.clear()
            self._cond.notify_all()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _serve(self, started: threading.Event) -> None:
        self._loop = aio.new_event_loop()
        # a /generate handler that arrives while generation is paused waits on an executor thread
        # (asyncio.to_thread); the default pool (cpu_count + 4 threads) would cap how many can be held
        self._loop.set_default_executor(ThreadPoolExecutor(max_workers=1024, thread_name_prefix="engine-wait"))
        asyncio.set_event_loop(self._loop)
        self.port = run_app(self._loop, build_app(self), self.host, self.port)
        started.set()
        self._loop.run_forever()

    def _load_model(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        torch.set_num_threads(self.num_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype).eval()
        _own_weights(self.model)
        # transformers >= 5.2x names the KV cache ``cache`` (argument and output); older ones ``past_key_values``
        self.cache_name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.context_len = getattr(self.model.config, "max_position_embeddings", None) or 4096
        self.think_end_id = self.tokenizer.get_vocab().get("</think>")  # as SGLang's model config finds it
        sources = [self.model.config.eos_token_id, self.tokenizer.eos_token_id]
        if (Path(self.model_path) / "generation_config.json").is_file():
            sources.append(GenerationConfig.from_pretrained(self.model_path).eos_token_id)
        self.eos_ids = frozenset(t for s in sources for t in (s if isinstance(s, list) else [s]) if t is not None)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._growing_layer = _growing_layer_class()
        why_not = FastDecoder.supports(self.model)
        self.fast = None if why_not else FastDecoder(self.model)  # the decode step; prefill stays HF's forward
        log.info("decode step: %s", "fast path" if self.fast else f"HF forward ({why_not})")

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     weight_version: str, complete: bool = True) -> str:
        """Copy weights in place; returns the new weight version. ``complete``: every weight must be given
        (the object-store and disk transports); otherwise a bucket of some of them (tensor, distributed).
        Names and shapes must match the model's; tied ``lm_head.weight`` may be left out.

        Waits for the running decode wave (a wave holds the weights lock); requests that join meanwhile
        wait for the new weights."""
        tensors = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if "weights" in self._released:
            raise BadRequest("the weights are released (/release_memory_occupation); resume them first")
        state = self.model.state_dict()
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        missing = [k for k in state if k not in tensors and not (tied and k == "lm_head.weight")] if complete else []
        unexpected = [k for k in tensors if k not in state]
        if missing or unexpected:
            raise BadRequest(f"weights do not match the engine's model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise BadRequest(f"weight {name}: shape {tuple(tensor.shape)}, "
                                 f"the model has {tuple(state[name].shape)}")
        self._update_waiting.set()
        try:
            with self._weights_lock, torch.no_grad():
                for name, tensor in tensors.items():
                    state[name].copy_(tensor)
                if self.fast is not None:
                    self.fast.stale = True  # its packed weights are made again at the next step
                self._weights_missing -= set(tensors)
                if tied:
                    self._weights_missing.discard("lm_head.weight")
                self.weight_version = str(weight_version)
        finally:
            self._update_waiting.clear()
        return self.weight_version

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> str:
        """Load an HF safetensors directory (same architecture) in place, as /update_weights_from_disk."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path}")
        tensors = {}
        for file in files:
            tensors.update(load_file(str(file)))
        return self.load_weights(tensors, weight_version if weight_version is not None else self.weight_version)

    # -- SGLang's weight-sync endpoints (slimecore.engines.weight_sync has the wire formats) -------
    def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None = None,
                                   weight_version: str | None = None) -> str:
        """/update_weights_from_tensor: this engine has one TP rank, so it takes entry 0."""
        from slimecore.engines import weight_sync

        if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
            raise BadRequest("serialized_named_tensors must be a non-empty list (one payload per TP rank)")
        try:
            payload = weight_sync.deserialize(serialized_named_tensors[0])
        except (ValueError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
            raise BadRequest(f"serialized_named_tensors[0] is not a tensor payload: {exc}") from None
        if load_format == "flattened_bucket":
            named = weight_sync.unflatten(payload["flattened_tensor"], payload["metadata"])
            if payload["flattened_tensor"].device.type == "cpu":
                # keep the sender's shared memory mapped: it sends the same buffer every sync, which then
                # unpickles from torch's shared-storage cache (no new mapping, no page faults)
                self._mapped_bucket = payload["flattened_tensor"].untyped_storage()
        elif load_format in (None, "direct"):
            named = list(payload)
        else:
            raise BadRequest(f"load_format {load_format!r}: the embedded engine takes null, direct or flattened_bucket")
        return self.load_weights(named, self._next_version(weight_version), complete=False)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> None:
        """/init_weights_update_group: join the sender's group as rank ``rank_offset`` (blocks until every
        member has joined, as in SGLang)."""
        from slimecore.engines import weight_sync

        if group_name in self._weight_groups:
            raise BadRequest(f"weight-update group {group_name!r} already exists; destroy it first")
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest("backend nccl needs CUDA; the embedded CPU engine joins gloo groups")
        self._weight_groups[group_name] = weight_sync.init_weight_group(
            backend, master_address, master_port, rank_offset, world_size, group_name)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", load_format: str | None = None,
                                        weight_version: str | None = None) -> str:
        """/update_weights_from_distributed: receive the broadcast from rank 0 of the group, then load."""
        from slimecore.engines import weight_sync

        group = self._weight_groups.get(group_name)
        if group is None:
            raise BadRequest(f"Group {group_name} not in {sorted(self._weight_groups)}. "
                             "Please call `init_weights_update_group` first.")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("names, dtypes and shapes must have the same length")
        try:
            metadata = weight_sync.layout(names, dtypes, shapes)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if load_format == "flattened_bucket":
            flat = torch.empty(metadata[-1].end_idx if metadata else 0, dtype=torch.uint8)
            weight_sync.broadcast(group, flat)
            named = weight_sync.unflatten(flat, metadata)
        elif load_format is None:
            named = [(m.name, torch.empty(m.shape, dtype=m.dtype)) for m in metadata]
            for _, tensor in named:
                weight_sync.broadcast(group, tensor)
        else:
            raise BadRequest(f"load_format {load_format!r}: use null or flattened_bucket")
        return self.load_weights(named, self._next_version(weight_version), complete=False)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        if self._weight_groups.pop(group_name, None) is None:
            raise BadRequest("The group to be destroyed does not exist.")

    def weights_digest(self) -> dict[str, str]:
        """``weight_sync.digest`` of the served weights (slime's ``--check-weight-update-equal`` idea)."""
        from slimecore.engines import weight_sync

        with self._weights_lock:
            return weight_sync.digest(self.model.state_dict().items())

    def check_weights(self, action: str = "checksum") -> dict:
        """SGLang's ``/weights_checker`` with action ``checksum``: SGLang's body with every weight's checksum
        (``slimecore.weight_check``), taken under the weights lock (no update runs meanwhile)."""
        from slimecore import weight_check

        if action != "checksum":
            raise BadRequest(f"Unsupported action={action!r}; the embedded engine answers action 'checksum'")
        if "weights" in self._released:
            raise BadRequest("the weights are released (/release_memory_occupation); resume them first")
        with self._weights_lock:
            # a tied lm_head.weight under its own name too: a trainer may send it (an untied copy of the tie)
            named = [*self.model.named_parameters(remove_duplicate=False), *self.model.named_buffers()]
            return weight_check.checker_response([weight_check.checksum_info(named)])

    def _next_version(self, weight_version: str | None) -> str:
        return self.weight_version if weight_version is None else str(weight_version)

    # -- /release_memory_occupation, /resume_memory_occupation --------------------------------------
    MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free the tagged memory. ``weights``: every parameter goes to the meta device (the memory is
        returned); the non-persistent buffers (rotary tables) are kept aside, they are not weights.
        ``kv_cache`` / ``cuda_graph``: this engine keeps no KV pool between waves and has no graphs, so
        there is nothing to free. Needs an idle engine, as SGLang asserts."""
        tags = self._tags(tags)
        load = self.loads()
        if load["num_running_reqs"] or load["num_waiting_reqs"]:
            raise BadRequest("release_memory_occupation needs an idle engine; pause generation first")
        if "weights" in tags and "weights" not in self._released:
            with self._weights_lock:
                saved = set(self.model.state_dict())
                self._buffers = {name: b.clone() for name, b in self.model.named_buffers() if name not in saved}
                self.model.to("meta")
                if self.fast is not None:  # its fused tensors are the weights' storage: let them go too
                    self.fast.release()
        self._released |= set(tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Allocate the tagged memory again. Resumed weights are uninitialised until a weight update has
        written every one of them; until then /generate answers 400 (SGLang would generate garbage)."""
        tags = self._tags(tags)
        if "weights" in tags and "weights" in self._released:
            with self._weights_lock:
                self.model.to_empty(device="cpu")
                for name, value in self._buffers.items():
                    module, _, attr = name.rpartition(".")
                    self.model.get_submodule(module).register_buffer(attr, value, persistent=False)
                self._buffers = {}
                if self.fast is not None:  # to_empty made new parameters: fuse them again
                    self.fast.bind()
                self._weights_missing = set(self.model.state_dict())
        self._released -= set(tags)

    def _tags(self, tags: list[str] | None) -> list[str]:
        if not tags:
            return list(self.MEMORY_TAGS)
        unknown = [t for t in tags if t not in self.MEMORY_TAGS]
        if unknown:
            raise BadRequest(f"unknown memory tags {unknown}; SGLang's are {list(self.MEMORY_TAGS)}")
        return list(tags)

    def generation_blocker(self) -> str | None:
        """Why /generate cannot run now (weights released or not fully reloaded), or None."""
        if "weights" in self._released:
            return "the engine's weights are released (/release_memory_occupation); resume them first"
        if self._weights_missing:
            return (f"{len(self._weights_missing)} weights are not loaded since /resume_memory_occupation "
                    "(e.g. " + sorted(self._weights_missing)[0] + "); push the weights first")
        return None

    # -- requests ----------------------------------------------------------------------------
    def new_requests(self, body: dict) -> tuple[list[Request], bool]:
        """Validate a /generate body, single or batch form; returns (its requests, whether it is a batch).

        The batch form is SGLang's: ``input_ids`` a list of token lists (or ``text`` a list of strings), and
        ``sampling_params``, ``return_logprob``, ``logprob_start_len`` and ``rid`` either one value for every
        prompt or a list with one entry per prompt (``rid`` only as a list); the answer is a list of responses
        in the prompts' order."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        if not _is_batch(body):
            return [self.new_request(body)], False
        text = body.get("text")
        prompts = text if isinstance(text, list) else body["input_ids"]
        if not prompts:
            raise BadRequest("a batch request needs at least one prompt")
        if body.get("rid") is not None and not isinstance(body["rid"], list):
            raise BadRequest("The rid should be a list for batch processing.")
        singles = [dict(body) for _ in prompts]
        key = "text" if isinstance(text, list) else "input_ids"
        for key_name in (key, "sampling_params", "return_logprob", "logprob_start_len", "rid"):
            value = body.get(key_name)
            if key_name == key or isinstance(value, list):
                if len(value) != len(prompts):
                    raise BadRequest(f"{key_name} has {len(value)} entries for {len(prompts)} prompts; give one "
                                     "per prompt, or one value for all")
                for single, entry in zip(singles, value):
                    single[key_name] = entry
        requests = []
        for i, single in enumerate(singles):
            try:
                requests.append(self.new_request(single))
            except BadRequest as exc:
                raise BadRequest(f"batch entry {i}: {exc}") from None
        return requests, True

    def new_request(self, body: dict) -> Request:
        """Validate a single-form /generate body (unknown top-level keys are ignored, as SGLang does)."""
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        if _is_batch(body):
            raise BadRequest("a batch body here; this call takes one prompt")
        ids = body.get("input_ids")
        if ids is not None and not isinstance(ids, list):
            raise BadRequest("input_ids must be a list of token ids")
        params = validate_sampling_params(body.get("sampling_params") or {})
        if ids is None:
            if not isinstance(body.get("text"), str):
                raise BadRequest("Either text, input_ids or input_embeds should be provided.")
            ids = self.tokenizer(body["text"], add_special_tokens=False).input_ids
        vocab = self.model.config.vocab_size
        if not ids:
            raise BadRequest("input_ids cannot be empty.")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise BadRequest(f"input_ids must be token ids in [0, {vocab})")
        if len(ids) >= self.context_len:
            raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        if params["logit_bias"] and not all(str(k).isdigit() and int(k) < vocab for k in params["logit_bias"]):
            raise BadRequest(f"logit_bias keys must be token ids in [0, {vocab})")
        start = body.get("logprob_start_len")
        start = -1 if start is None or not body.get("return_logprob") else start
        if not isinstance(start, int) or start > len(ids):
            raise BadRequest(f"logprob_start_len ({start}) must be an integer at most the prompt length ({len(ids)})")
        stop_ids = frozenset() if params["ignore_eos"] else frozenset(params["stop_token_ids"]) | self.eos_ids
        rid = body.get("rid") or f"{self._rid_prefix}{next(self._rid_count):016x}"  # 32 hex digits, as uuid4().hex
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string")
        return Request(rid, list(ids), params, bool(body.get("return_logprob")), start, stop_ids,
                       think_end=self.think_end_id if body.get("require_reasoning") else None)

    def submit(self, request: Request) -> Request:
        """Queue a request (held aside while paused); ``request.done`` is set when its response is ready."""
        self.submit_all([request])
        return request

    def submit_all(self, requests: list[Request]) -> None:
        """Queue a batch's requests together, or none of them when a rid is already in flight or repeated."""
        with self._cond:
            seen = set()
            for request in requests:
                if request.rid in self._inflight or request.rid in seen:
                    raise BadRequest(f"Duplicate request ID detected: {request.rid}")
                seen.add(request.rid)
            for request in requests:
                self._inflight[request.rid] = request
            (self._queue if self.unpaused.is_set() else self._held).extend(requests)
            self._cond.notify_all()

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """SGLang's /abort_request: every request in the scheduler, or, when ``rid`` is in flight, every
        request whose rid starts with it. Waiting requests finish at once, running ones after the current
        decode step, with their partial output. Requests held by a pause are not in the scheduler."""
        with self._cond:
            if abort_all:
                targets = [*self._queue, *self._running]
            elif rid and rid in self._inflight:
                targets = [r for r in (*self._queue, *self._running) if r.rid.startswith(rid)]
            else:
                targets = []
            for req in targets:
                if req in self._running:
                    req.aborted = True
                else:
                    self._queue.remove(req)
                    self._finish(req, ABORTED_WAITING)
            self._cond.notify_all()

    def loads(self) -> dict:
        """Scheduler load, as /v1/loads and /get_load report it."""
        with self._cond:
            return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._queue)}

    def _notify(self) -> None:
        with self._cond:
            if self.unpaused.is_set() and self._held:
                self._queue.extend(self._held)
                self._held.clear()
            self._cond.notify_all()

    def _finish(self, req: Request, reason: dict) -> None:
        with self._cond:
            req.finish_reason = reason
            self._inflight.pop(req.rid, None)
            if req in self._running:  # a batch that others keep joining may outlive many requests
                self._running.remove(req)
            req.done.set()
        if req.on_done is not None:
            req.on_done()

    # -- scheduler ---------------------------------------------------------------------------
    def _take(self, limit: int) -> list[Request]:
        """Move up to ``limit`` waiting requests into the running set (caller holds ``_cond``)."""
        taken = [self._queue.popleft() for _ in range(min(limit, len(self._queue)))]
        self._running.extend(taken)
        return taken

    def _scheduler(self) -> None:
        torch.set_num_threads(self.num_threads)  # the intra-op threads this thread's forwards use, whatever ran before
        while not self._stop.is_set():
            with self._cond:
                if not self._cond.wait_for(lambda: self._stop.is_set() or (self._queue and self.unpaused.is_set()),
                                           timeout=1.0) or self._stop.is_set():
                    continue
                # the requests of one rollout arrive over a few milliseconds: prefill them together. The wave
                # starts when the batch is full, when no request came for ``gather_quiet`` or after
                # ``gather_window``; later ones join the running batch
                deadline = time.monotonic() + self.gather_window
                while len(self._queue) < self.max_batch_size and (left := deadline - time.monotonic()) > 0:
                    waiting = len(self._queue)
                    self._cond.wait(min(left, self.gather_quiet))
                    if len(self._queue) == waiting:
                        break
                wave = self._take(self.max_batch_size)
            try:
                with self._weights_lock:
                    self._run_wave(wave)
            except Exception as exc:  # answer the wave's requests instead of leaving their callers hanging
                log.exception("decode wave failed")
                for req in list(self._running):
                    self._finish(req, {"type": "abort", "message": f"engine error: {exc}", "status_code": 500,
                                       "err_type": type(exc).__name__})

    def _admit(self, reqs: list[Request]) -> list[Request]:
        """Answer the requests that need no decoding (aborted while queued, max_new_tokens 0); return the rest."""
        active = []
        for req in reqs:
            if req.aborted:
                self._finish(req, ABORTED_WAITING)
            elif req.params["max_new_tokens"] == 0:
                if req.logprob_start_len >= 0:
                    self._prefill([req])  # a prompt-only request (e.g. a teacher's log-probs)
                self._finish(req, {"type": "length", "length": 0})
            else:
                active.append(req)
        return active

    @torch.inference_mode()
    def _run_wave(self, wave: list[Request]) -> None:
        self.stats["waves"] += 1
        self.stats["last_wave_size"] = len(wave)
        rows, batch = [], None
        pending = self._admit(wave)
        while rows or pending:
            if pending:
                fresh = self._prefill(pending)
                if rows:
                    batch.extend(fresh)
                else:
                    batch = fresh
                rows += pending
                self.stats["max_wave_size"] = max(self.stats["max_wave_size"], len(rows))
            tokens = self._sample(rows, batch.logits)
            for req, token in zip(rows, tokens):
                self._advance(req, token)
            keep = [i for i, r in enumerate(rows) if not r.done.is_set()]
            if len(keep) < len(rows):
                rows, tokens = [rows[i] for i in keep], [tokens[i] for i in keep]
                if keep:
                    batch.select(keep)
            if rows:
                self._decode_step(batch, tokens)
            pending = self._admit(self._joiners(len(rows)))

    def _joiners(self, running: int) -> list[Request]:
        """Waiting requests that join the running batch (not while paused or a weight update waits)."""
        if self._update_waiting.is_set() or not self.unpaused.is_set() or self._stop.is_set():
            return []
        with self._cond:
            joined = self._take(self.max_batch_size - running)
        self.stats["joined"] += len(joined)
        return joined

    min_shared_prefix = 8  # tokens: a shorter common prefix is prefilled with the rest

    def _shared_prefix(self, reqs: list[Request]) -> int:
        """Length of the token prefix every prompt of ``reqs`` starts with, leaving each at least one own
        token (the next-token logits come from the suffix pass); 0 when it is not worth sharing."""
        if len(reqs) < 2 or any(r.logprob_start_len >= 0 for r in reqs):
            return 0
        first, n = reqs[0].input_ids, min(len(r.input_ids) for r in reqs) - 1
        for r in reqs[1:]:
            n = next((i for i in range(n) if r.input_ids[i] != first[i]), n)
        return n if n >= self.min_shared_prefix else 0

    def _prefill(self, reqs: list[Request]) -> _Batch:
        distinct: dict[tuple, int] = {}  # prompt -> its row among the distinct prompts
        rows = [distinct.setdefault(tuple(r.input_ids), len(distinct)) for r in reqs]
        if len(distinct) < len(reqs) and all(r.logprob_start_len < 0 for r in reqs):
            # the n samples of one prompt: prefill it once and give every sample a copy of its row (cache,
            # mask, positions, logits), as SGLang's radix cache reuses a whole cached prompt
            batch = self._prefill([reqs[rows.index(row)] for row in range(len(distinct))])
            batch.take(rows)
            return batch
        shared = self._shared_prefix(reqs)
        if shared:
            return self._prefill_shared(reqs, shared)
        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, width - len(r.input_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        prompt_logprobs = any(r.logprob_start_len >= 0 for r in reqs)
        # the full (B, T, V) logits only when a row asked for prompt log-probs: it is the largest tensor
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=0 if prompt_logprobs else 1)
        if prompt_logprobs:
            for i, r in enumerate(reqs):
                if r.logprob_start_len >= 0:
                    self._prompt_logprobs(r, out.logits[i, width - len(r.input_ids):].float())
        return _Batch(mask, positions[:, -1:], self._growing(getattr(out, self.cache_name)),
                      out.logits[:, -1, :].float())

    def _prefill_shared(self, reqs: list[Request], shared: int) -> _Batch:
        """Prefill the common prompt prefix once (one row), then every row's own suffix on top of the
        prefix's KV repeated per row, as SGLang's prefix cache does for the n samples of one prompt. Row
        layout: prefix, padding, suffix (the mask hides the padding; positions continue the prefix)."""
        out = self.model(input_ids=torch.tensor([reqs[0].input_ids[:shared]]), use_cache=True, logits_to_keep=1)
        cache = getattr(out, self.cache_name)
        for layer in cache.layers:
            layer.keys = layer.keys.expand(len(reqs), -1, -1, -1).contiguous()
            layer.values = layer.values.expand(len(reqs), -1, -1, -1).contiguous()
        width = max(len(r.input_ids) for r in reqs) - shared
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        own = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.input_ids) + shared:] = torch.tensor(r.input_ids[shared:])
            own[i, width - len(r.input_ids) + shared:] = 1
        mask = torch.cat([torch.ones((len(reqs), shared), dtype=torch.long), own], dim=1)
        positions = (shared + own.cumsum(-1) - 1).clamp(min=shared)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self.cache_name: cache})
        return _Batch(mask, positions[:, -1:], self._growing(getattr(out, self.cache_name)),
                      out.logits[:, -1, :].float())

    def _growing(self, cache):
        """The prefill's cache with its plain dynamic layers turned into growing ones (no copy per step)."""
        from transformers.cache_utils import DynamicLayer

        for layer in cache.layers:
            if type(layer) is DynamicLayer:
                layer.__class__ = self._growing_layer
        return cache

    def _prompt_logprobs(self, req: Request, logits: torch.Tensor) -> None:
        """``input_token_logprobs`` from prompt position ``logprob_start_len``: the first entry is null,
        entry j the log-prob of prompt token start+j given the tokens before it (same temperature rule
        as the output log-probs)."""
        logp = torch.log_softmax(logits[:-1] / req.params["temperature"], dim=-1)
        targets = torch.tensor(req.input_ids[1:])
        values = logp.gather(1, targets[:, None]).squeeze(1).tolist()
        start = req.logprob_start_len
        req.input_logprobs = [None] + values[start:] if start < len(req.input_ids) else []

    def _decode_step(self, batch: _Batch, tokens: list[int]) -> None:
        batch.mask = torch.nn.functional.pad(batch.mask, (0, 1), value=1)
        batch.positions = batch.positions + 1
        if self.fast is not None:
            batch.logits = self.fast.step(torch.tensor(tokens), batch.positions, batch.mask, batch.cache)
            return
        out = self.model(input_ids=torch.tensor(tokens)[:, None], attention_mask=batch.mask,
                         position_ids=batch.positions, use_cache=True, **{self.cache_name: batch.cache})
        batch.cache, batch.logits = getattr(out, self.cache_name), out.logits[:, -1, :].float()

    # -- sampling ----------------------------------------------------------------------------
    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """One token per row; records its log-prob, ``log_softmax(logits / T)`` over the full vocabulary.

        The softmax and the draw run batched; rows with top-k/top-p/min-p draw one by one. A row with a
        ``sampling_seed`` draws at a number that depends only on its seed and the token's position
        (:func:`_seeded_uniform`), so its tokens do not depend on the batch it shares or the order requests came
        in; other rows draw from the engine's generator."""
        for i, req in enumerate(reqs):
            if req.adjusts_logits:
                self._adjust_logits(req, logits[i])
        temps = torch.tensor([r.params["temperature"] for r in reqs], dtype=logits.dtype)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)  # (B, V)
        tokens = logp.argmax(dim=-1)  # greedy rows (top_k 1) keep this
        drawn = [i for i, r in enumerate(reqs) if r.params["top_k"] != 1]
        uniform = self._uniform([reqs[i] for i in drawn])  # (len(drawn), 1)
        plain = [k for k, i in enumerate(drawn) if not reqs[i].draws_alone]
        if plain:
            tokens[[drawn[k] for k in plain]] = _draw(logp[[drawn[k] for k in plain]].exp(), uniform[plain])
        for k, i in enumerate(drawn):
            if reqs[i].draws_alone:
                tokens[i] = int(_draw(self._filtered_probs(logp[i], reqs[i].params)[None], uniform[k:k + 1]))
        picked = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
        for req, value in zip(reqs, picked):
            req.logprobs.append(value)
        return tokens.tolist()

    def _uniform(self, reqs: list[Request]) -> torch.Tensor:
        """One number in [0, 1] per row (len(reqs), 1): counter-based for a seeded row, else the generator's."""
        seeds = [r.params["sampling_seed"] for r in reqs]
        unseeded = iter(torch.rand(sum(s is None for s in seeds), generator=self.generator, dtype=torch.float64)
                        .tolist())
        return torch.tensor([[next(unseeded) if s is None else _seeded_uniform(s, len(r.input_ids) + len(r.output_ids))]
                             for r, s in zip(reqs, seeds)], dtype=torch.float64).reshape(len(reqs), 1)

    @staticmethod
    def _adjust_logits(req: Request, logits: torch.Tensor) -> None:
        """Penalties over the generated tokens, logit_bias, and no stop token before min_new_tokens."""
        p = req.params
        if req.output_ids and (p["frequency_penalty"] or p["presence_penalty"] or p["repetition_penalty"] != 1.0):
            ids, counts = torch.tensor(req.output_ids).unique(return_counts=True)
            seen = logits[ids]
            seen = torch.where(seen > 0, seen / p["repetition_penalty"], seen * p["repetition_penalty"])
            logits[ids] = seen - p["frequency_penalty"] * counts - p["presence_penalty"]
        for token, bias in (p["logit_bias"] or {}).items():
            logits[int(token)] += float(bias)
        if len(req.output_ids) < p["min_new_tokens"] and req.stop_ids:
            logits[list(req.stop_ids)] = float("-inf")

    @staticmethod
    def _filtered_probs(logp: torch.Tensor, p: dict) -> torch.Tensor:
        """Top-k, then top-p, then min-p over the probabilities; ``_draw`` renormalises."""
        probs = logp.exp()
        if p["top_k"] > 0:
            kth = torch.topk(probs, min(p["top_k"], probs.numel())).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if p["top_p"] < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < p["top_p"] * sorted_probs.sum()
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        if p["min_p"] > 0:
            probs = torch.where(probs >= p["min_p"] * probs.max(), probs, torch.zeros_like(probs))
        return probs

    def _advance(self, req: Request, token: int) -> None:
        """Append the token and decide whether the request is finished, in SGLang's order: abort,
        max_new_tokens, stop string/regex (wins over a stop token in the same step), stop token, context."""
        req.output_ids.append(token)
        p, n = req.params, len(req.output_ids)
        if req.aborted:
            self._finish(req, ABORTED)
        elif p["max_new_tokens"] is not None and n >= p["max_new_tokens"]:
            self._finish(req, {"type": "length", "length": p["max_new_tokens"]})
        elif (matched := self._matched_stop_text(req)) is not None:
            self._finish(req, {"type": "stop", "matched": matched})
        elif token in req.stop_ids:
            self._finish(req, {"type": "stop", "matched": token})
        elif len(req.input_ids) + n >= self.context_len:  # like SGLang's clamp to the context length
            self._finish(req, {"type": "length", "length": n})

    def _matched_stop_text(self, req: Request) -> str | None:
        p = req.params
        if p["stop"]:
            # a stop string can only complete in the newest tokens: decode a window, not the whole output
            window = max(len(s) for s in p["stop"]) + 2
            tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=p["skip_special_tokens"])
            for stop in p["stop"]:
                if stop in tail:
                    return stop
        if p["stop_regex"]:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p["skip_special_tokens"])
            for pattern in p["stop_regex"]:
                if re.search(pattern, text):
                    return pattern
        return None

    # -- responses ---------------------------------------------------------------------------
    def response(self, req: Request) -> dict:
        """SGLang's non-streaming /generate response object for one request."""
        p, reason = req.params, req.finish_reason or {}
        ids, matched = req.output_ids, reason.get("matched")
        trim = reason.get("type") == "stop" and not p["no_stop_trim"]
        text = self.tokenizer.decode(ids[:-1] if trim and isinstance(matched, int) else ids,
                                     skip_special_tokens=p["skip_special_tokens"])
        if trim and isinstance(matched, str):  # the tokens completing the stop string stay; the text is cut
            found = (text.find(matched) if matched in p["stop"]
                     else (m.start() if (m := re.search(matched, text)) else -1))
            text = text[:found] if found >= 0 else text
        meta = {"id": req.rid, "finish_reason": req.finish_reason, "weight_version": self.weight_version,
                "completion_tokens": len(ids), "reasoning_tokens": _reasoning_tokens(req),
                "e2e_latency": time.perf_counter() - req.created}
        if reason != ABORTED_WAITING:
            meta.update({"prompt_tokens": len(req.input_ids), "cached_tokens": 0, "num_retractions": 0})
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, ids)]
            meta["output_token_logprobs_length"] = len(ids)
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in
                                            zip(req.input_logprobs, req.input_ids[max(req.logprob_start_len, 0):])]
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    def server_info(self) -> dict:
        """/server_info: SGLang's flat server-args object for the fields slime and the router read."""
        return {"model_path": self.model_path_for_info, "tokenizer_path": self.model_path,
                "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "moe_dp_size": 1, "num_gpus": 0,
                "disaggregation_mode": "null", "disaggregation_bootstrap_port": None, "encoder_only": False,
                "served_model_name": self.model_path_for_info, "dtype": str(self.dtype).removeprefix("torch."),
                "random_seed": self.seed, "max_running_requests": self.max_batch_size,
                "enable_memory_saver": False, "enable_return_routed_experts": False, "skip_tokenizer_init": False,
                "weight_version": self.weight_version, "version": VERSION,
                "status": "ready" if self.ready else "loading",
                "max_total_num_tokens": self.context_len if self.ready else 0,
                "max_req_input_len": self.context_len - 1 if self.ready else 0,
                "internal_states": [{**self.stats, "memory_usage": self.memory_usage()}]}

    def memory_usage(self) -> dict:
        """SGLang's ``memory_usage`` (GB): the bytes the weights hold now (0 while released); this engine
        keeps no KV pool between waves and no graphs."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (self.model.state_dict().values() if self.ready else ()) if not t.is_meta}
        return {"weight": sum(storages.values()) / 1024**3, "kvcache": 0.0, "graph": 0.0}

    def model_info(self) -> dict:
        config = self.model.config if self.ready else None
        return {"model_path": self.model_path_for_info, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}
