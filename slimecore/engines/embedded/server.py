"""The embedded engine's server: one object that holds the model and its state, made of the parts of this package
(the request forms, the scheduler, the forwards, the sampler, the weights), with its lifecycle (HTTP first, then
the model, then the scheduler thread) and its ``/server_info`` and ``/model_info`` answers."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import threading
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from slimecore import aio
from slimecore.engines.embedded.request import ABORTED_WAITING, Request, RequestForms
from slimecore.engines.embedded.runner import ModelRunner, _growing_layer_class
from slimecore.engines.embedded.sampler import Sampler
from slimecore.engines.embedded.scheduler import Scheduler, _PauseGate
from slimecore.engines.embedded.weights import Weights, _own_weights
from slimecore.engines.fastpath import FastDecoder
from slimecore.engines.http import build_app, run_app
from slimecore.engines.routed_experts import ExpertRecorder

log = logging.getLogger("slimecore.engine")
VERSION = "slimecore-embedded-0.2"


class EmbeddedServer(RequestForms, Scheduler, ModelRunner, Sampler, Weights):
    """One CPU engine: an HF causal LM from a local directory, served over SGLang's HTTP API.

    ``start()`` binds the HTTP server first (``/health`` answers 503 while the model loads), then loads
    the model and starts the scheduler; it returns the URL. ``stop()`` aborts everything and closes it.
    """

    def __init__(self, model_path: str | Path, host: str = "127.0.0.1", port: int = 0, max_batch_size: int = 64,
                 dtype: str = "float32", seed: int = 0, model_path_for_info: str | None = None,
                 num_threads: int = 1, api_key: str | None = None, return_routed_experts: bool = False):
        self.model_path, self.host, self.port = str(model_path), host, port
        # SGLang's --enable-return-routed-experts: record each token's MoE experts (slimecore.routers.ExpertRecorder)
        self.return_routed_experts = return_routed_experts
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
        self.routes = ExpertRecorder(self.model) if self.return_routed_experts else None
        log.info("decode step: %s", "fast path" if self.fast else f"HF forward ({why_not})")

    def server_info(self) -> dict:
        """/server_info: SGLang's flat server-args object for the fields slime and the router read."""
        return {"model_path": self.model_path_for_info, "tokenizer_path": self.model_path,
                "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "moe_dp_size": 1, "num_gpus": 0,
                "disaggregation_mode": "null", "disaggregation_bootstrap_port": None, "encoder_only": False,
                "served_model_name": self.model_path_for_info, "dtype": str(self.dtype).removeprefix("torch."),
                "random_seed": self.seed, "max_running_requests": self.max_batch_size,
                "enable_memory_saver": False, "enable_return_routed_experts": self.return_routed_experts, "skip_tokenizer_init": False,
                "weight_version": self.weight_version, "version": VERSION,
                "status": "ready" if self.ready else "loading",
                "max_total_num_tokens": self.context_len if self.ready else 0,
                "max_req_input_len": self.context_len - 1 if self.ready else 0,
                "internal_states": [{**self.stats, "memory_usage": self.memory_usage()}]}

    def model_info(self) -> dict:
        config = self.model.config if self.ready else None
        return {"model_path": self.model_path_for_info, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None)}
