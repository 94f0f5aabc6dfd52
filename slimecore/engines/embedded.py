"""The embedded CPU inference engine: an HF transformers model behind SGLang's native HTTP API.

It answers the endpoints the router and slime-style rollouts use (``/generate``, ``/health``,
``/model_info``, ``/server_info``, ``/abort_request``, ``/v1/loads``, ``/flush_cache``,
``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``, weight version), with
the same request and response shapes (reference/sglang-api.md), bound to 127.0.0.1.

Batching: a scheduler thread takes every waiting request (up to ``max_batch_size``), prefills them
together (left padding, positions from the attention mask) and decodes step by step with the KV
cache; requests that arrive meanwhile form the next wave.

Log-probs: for each sampled token, ``log_softmax(logits / T)`` over the full vocabulary (T = 1 for
greedy), without top-p/top-k renormalisation, exactly as SGLang returns them. The trainer recomputes
the same quantity from an unpadded forward, so the two agree to float32 rounding.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("slimecore.engine")
VERSION = "slimecore-embedded-0.1"
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "min_new_tokens", "stop",
                 "stop_token_ids", "ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens",
                 "n", "frequency_penalty", "presence_penalty", "repetition_penalty", "sampling_seed", "json_schema",
                 "regex", "ebnf", "logit_bias", "custom_params", "stream_interval"}


class BadRequest(ValueError):
    """An invalid /generate request: answered with HTTP 400 ``{"error": {"message": ...}}``."""


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: dict
    return_logprob: bool
    done: threading.Event = field(default_factory=threading.Event)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    aborted: bool = False
    created: float = field(default_factory=time.perf_counter)
    text_stop: str | None = None


def _validate(params: dict) -> dict:
    unknown = set(params) - SAMPLING_KEYS
    if unknown:
        raise BadRequest(f"unknown sampling_params {sorted(unknown)}")
    p = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": 128, "min_new_tokens": 0,
         "stop": [], "stop_token_ids": [], "ignore_eos": False, "no_stop_trim": False, "skip_special_tokens": True}
    p.update({k: v for k, v in params.items() if v is not None or k == "max_new_tokens"})
    if isinstance(p["stop"], str):
        p["stop"] = [p["stop"]]
    if p["temperature"] < 0:
        raise BadRequest(f"temperature must be non-negative, got {p['temperature']}")
    if not 0 < p["top_p"] <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {p['top_p']}")
    if p["top_k"] == 0 or p["top_k"] < -1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}")
    if not 0 <= p["min_p"] <= 1:
        raise BadRequest(f"min_p must be in [0, 1], got {p['min_p']}")
    if p["max_new_tokens"] is not None and p["max_new_tokens"] < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}")
    if p["min_new_tokens"] < 0 or (p["max_new_tokens"] is not None and p["min_new_tokens"] > p["max_new_tokens"]):
        raise BadRequest("min_new_tokens must be in [0, max_new_tokens]")
    return p


class EmbeddedServer:
    def __init__(self, model_path: str, host: str = "127.0.0.1", port: int = 0, max_batch_size: int = 64,
                 seed: int = 0, num_threads: int = 1):
        self.model_path, self.host, self.port = str(model_path), host, port
        self.max_batch_size, self.num_threads = max_batch_size, num_threads
        self.gather_window = 0.05  # seconds without a new request that closes a wave
        self.weight_version = "default"
        self.ready = False
        self.generator = torch.Generator().manual_seed(seed)
        self.waiting: queue.Queue[Request] = queue.Queue()
        self.running: list[Request] = []
        self.model_lock = threading.Lock()  # held by a decode wave; weight updates take it between waves
        self.unpaused = threading.Event()
        self.unpaused.set()
        self.stats = {"waves": 0, "last_wave_size": 0, "max_wave_size": 0}
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 300) -> str:
        started = threading.Event()
        self._http_thread = threading.Thread(target=self._serve, args=(started,), daemon=True, name="engine-http")
        self._http_thread.start()
        if not started.wait(timeout):
            raise TimeoutError(f"embedded engine HTTP server did not start within {timeout}s")
        self._load_model()
        self._sched_thread = threading.Thread(target=self._scheduler, daemon=True, name="engine-scheduler")
        self._sched_thread.start()
        self.ready = True
        return self.url

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self._stop.set()
        self.abort(abort_all=True)
        if self._loop:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def _load_model(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        torch.set_num_threads(self.num_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        eos: set[int] = set()
        for source in (self.model.config.eos_token_id, self.tokenizer.eos_token_id):
            eos.update(source if isinstance(source, list) else [source] if source is not None else [])
        try:
            gen = GenerationConfig.from_pretrained(self.model_path).eos_token_id
            eos.update(gen if isinstance(gen, list) else [gen] if gen is not None else [])
        except OSError:
            pass  # no generation_config.json: the config and tokenizer EOS are the whole set
        self.eos_ids = eos
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, named_tensors, weight_version: str) -> str:
        """Replace the weights in place (names and shapes checked); waits for the running wave."""
        tensors = dict(named_tensors)
        state = self.model.state_dict()
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        missing = [k for k in state if k not in tensors and not (tied and k == "lm_head.weight")]
        unexpected = [k for k in tensors if k not in state]
        if missing or unexpected:
            raise ValueError(f"weights do not match the engine's model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)} but the model has {tuple(state[name].shape)}")
        with self.model_lock, torch.no_grad():
            for name, tensor in tensors.items():
                state[name].copy_(tensor)
            self.weight_version = str(weight_version)
        return self.weight_version

    def update_weights_from_disk(self, model_path: str, weight_version: str | None) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path}")
        tensors = {}
        for file in files:
            tensors.update(load_file(str(file)))
        self.load_weights(tensors, weight_version if weight_version is not None else self.weight_version)

    # -- requests ----------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        self.waiting.put(request)
        return request

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        for req in list(self.running) + list(self.waiting.queue):
            if abort_all or (rid and req.rid.startswith(rid)):
                req.aborted = True

    def loads(self) -> dict:
        return {"num_running_reqs": sum(not r.done.is_set() for r in self.running),
                "num_waiting_reqs": self.waiting.qsize()}

    # -- scheduler ---------------------------------------------------------------------------
    def _scheduler(self) -> None:
        while not self._stop.is_set():
            try:
                first = self.waiting.get(timeout=0.05)
            except queue.Empty:
                continue
            self.unpaused.wait()
            wave = [first]
            # requests of one rollout arrive over a few milliseconds: keep collecting while they do
            while len(wave) < self.max_batch_size:
                try:
                    wave.append(self.waiting.get(timeout=self.gather_window))
                except queue.Empty:
                    break
            with self.model_lock:
                self.running = wave
                try:
                    self._run_wave(wave)
                except Exception as exc:  # answer every request of the wave instead of leaving them hanging
                    log.exception("decode wave failed")
                    for req in wave:
                        if not req.done.is_set():
                            req.finish_reason = {"type": "abort", "message": f"engine error: {exc}",
                                                 "status_code": 500, "err_type": type(exc).__name__}
                            req.done.set()
                finally:
                    self.running = []

    @torch.inference_mode()
    def _run_wave(self, wave: list[Request]) -> None:
        self.stats["waves"] += 1
        self.stats["last_wave_size"] = len(wave)
        self.stats["max_wave_size"] = max(self.stats["max_wave_size"], len(wave))
        for req in wave:
            if req.aborted:
                self._finish(req, {"type": "abort", "message": "Abort in waiting queue"})
            elif req.params["max_new_tokens"] == 0:
                self._finish(req, {"type": "length", "length": 0})
        active = [r for r in wave if not r.done.is_set()]
        if not active:
            return
        longest = max(len(r.input_ids) for r in active)
        ids = torch.full((len(active), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(active), longest), dtype=torch.long)
        for i, r in enumerate(active):
            ids[i, longest - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, longest - len(r.input_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        limit = getattr(self.model.config, "max_position_embeddings", 4096)
        for _ in itertools.count():
            tokens = self._sample(active, out.logits[:, -1, :])
            for req, token in zip(active, tokens):
                if not req.done.is_set():
                    self._step(req, token, limit)
            if all(r.done.is_set() for r in active):
                return
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=torch.tensor(tokens).unsqueeze(1), attention_mask=mask, position_ids=positions,
                             past_key_values=out.past_key_values, use_cache=True)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """Pick one token per row and record its log-prob (full-vocabulary log softmax of logits / T).

        The softmax and the draw run batched over the rows; only rows with top-k/top-p/min-p filters or a
        min_new_tokens ban take the per-row path."""
        logits = logits.float()  # (B, V)
        live = [i for i, r in enumerate(reqs) if not r.done.is_set()]
        chosen = [self.pad_id] * len(reqs)
        if not live:
            return chosen
        for i in live:  # before min_new_tokens, stop tokens may not be drawn (this changes the distribution)
            if len(reqs[i].output_ids) < reqs[i].params["min_new_tokens"]:
                logits[i, list(self._stop_ids(reqs[i]))] = float("-inf")
        temps = torch.tensor([max(reqs[i].params["temperature"], 0.0) for i in live])
        greedy = temps < 1e-6
        logp = torch.log_softmax(logits[live] / torch.where(greedy, 1.0, temps).unsqueeze(1), dim=-1)  # (L, V)
        plain = [k for k, i in enumerate(live) if not greedy[k] and not self._needs_filter(reqs[i].params)]
        tokens = logp.argmax(dim=-1)  # greedy rows keep this
        if plain:
            tokens[plain] = torch.multinomial(logp[plain].exp(), 1, generator=self.generator).squeeze(1)
        for k, i in enumerate(live):
            if not greedy[k] and k not in plain:
                tokens[k] = int(torch.multinomial(self._filtered_probs(logp[k], reqs[i].params), 1,
                                                  generator=self.generator))
        picked = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        for k, i in enumerate(live):
            reqs[i].logprobs.append(float(picked[k]))
            chosen[i] = int(tokens[k])
        return chosen

    @staticmethod
    def _needs_filter(p: dict) -> bool:
        return p["top_k"] > 0 or p["top_p"] < 1 or p["min_p"] > 0

    @staticmethod
    def _filtered_probs(logp: torch.Tensor, p: dict) -> torch.Tensor:
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

    def _stop_ids(self, req: Request) -> set[int]:
        return set(req.params["stop_token_ids"] or []) | (set() if req.params["ignore_eos"] else self.eos_ids)

    def _step(self, req: Request, token: int, limit: int) -> None:
        req.output_ids.append(token)
        p = req.params
        if req.aborted:
            self._finish(req, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
            return
        if p["stop"]:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p["skip_special_tokens"])
            for stop in p["stop"]:
                if stop and stop in text:
                    req.text_stop = stop
                    self._finish(req, {"type": "stop", "matched": stop})
                    return
        if token in self._stop_ids(req):
            self._finish(req, {"type": "stop", "matched": token})
            return
        budget = p["max_new_tokens"]
        if (budget is not None and len(req.output_ids) >= budget) or len(req.input_ids) + len(req.output_ids) >= limit:
            self._finish(req, {"type": "length", "length": len(req.output_ids)})

    @staticmethod
    def _finish(req: Request, reason: dict) -> None:
        req.finish_reason = reason
        req.done.set()

    # -- responses ---------------------------------------------------------------------------
    def response(self, req: Request) -> dict:
        p = req.params
        ids = req.output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=p["skip_special_tokens"])
        if req.text_stop and not p["no_stop_trim"]:
            text = text[: text.find(req.text_stop)]
        elif (req.finish_reason or {}).get("type") == "stop" and isinstance(req.finish_reason.get("matched"), int) \
                and not p["no_stop_trim"]:
            text = self.tokenizer.decode(ids[:-1], skip_special_tokens=p["skip_special_tokens"])
        meta = {"id": req.rid, "finish_reason": req.finish_reason, "weight_version": self.weight_version,
                "completion_tokens": len(ids), "e2e_latency": time.perf_counter() - req.created}
        if (req.finish_reason or {}).get("message") != "Abort in waiting queue":
            meta.update({"prompt_tokens": len(req.input_ids), "cached_tokens": 0, "num_retractions": 0})
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs, ids)]
            meta["output_token_logprobs_length"] = len(ids)
            meta["input_token_logprobs"] = []
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    def server_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "tp_size": 1, "dp_size": 1,
                "pp_size": 1, "ep_size": 1, "disaggregation_mode": "null", "weight_version": self.weight_version,
                "version": VERSION, "status": "ready" if self.ready else "loading",
                "max_total_num_tokens": getattr(self.model.config, "max_position_embeddings", 0) if self.ready else 0,
                "internal_states": [dict(self.stats)]}

    def model_info(self) -> dict:
        config = self.model.config if self.ready else None
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None), "architectures": getattr(config, "architectures", None)}

    # -- HTTP --------------------------------------------------------------------------------
    def _serve(self, started: threading.Event) -> None:
        from slimecore.engines.http import build_app, run_app

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self.port = run_app(self._loop, build_app(self), self.host, self.port)
        started.set()
        self._loop.run_forever()

    def new_request(self, body: dict) -> Request:
        if not isinstance(body, dict):
            raise BadRequest("the body must be one JSON object (batch requests are not supported)")
        params = _validate(dict(body.get("sampling_params") or {}))
        ids = body.get("input_ids")
        if ids is None:
            if not isinstance(body.get("text"), str):
                raise BadRequest("either input_ids or text is required")
            ids = self.tokenizer(body["text"], add_special_tokens=False).input_ids
        if not ids or not all(isinstance(t, int) and 0 <= t < self.model.config.vocab_size for t in ids):
            raise BadRequest("input_ids must be a non-empty list of token ids within the vocabulary")
        return Request(body.get("rid") or uuid.uuid4().hex, list(ids), params, bool(body.get("return_logprob")))


class EmbeddedEngineActor:
    """Ray actor holding one EmbeddedServer (create with ``launch_embedded_engines``)."""

    def __init__(self, model_path: str, max_batch_size: int = 64, seed: int = 0, num_threads: int = 1):
        torch.set_num_threads(num_threads)
        self.server = EmbeddedServer(model_path, max_batch_size=max_batch_size, seed=seed, num_threads=num_threads)

    def start(self) -> str:
        return self.server.start()

    def load_weights(self, named_tensors, weight_version: str) -> str:
        return self.server.load_weights(named_tensors, weight_version)

    def health(self) -> bool:
        return self.server.ready

    def shutdown(self) -> None:
        self.server.stop()


def launch_embedded_engines(n: int, model_path: str, num_cpus: float = 0.5, placement_group=None,
                            bundle_indices: list[int] | None = None, timeout: float = 600, seed: int = 0,
                            num_threads: int = 1):
    """Start ``n`` engine actors (in the given placement-group bundles); return [(actor, url)]."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from slimecore.raytools import ray_get

    actor_cls = ray.remote(EmbeddedEngineActor)
    actors = []
    for i in range(n):
        options = {"num_cpus": num_cpus}
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=bundle_indices[i])
        actors.append(actor_cls.options(**options).remote(model_path, seed=seed + i, num_threads=num_threads))
    urls = ray_get([a.start.remote() for a in actors], f"{n} embedded engine(s) to load {model_path}", timeout)
    return list(zip(actors, urls))
