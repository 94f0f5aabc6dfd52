"""One ``/generate`` request of the embedded engine: the body validated as SGLang validates it (single and batch
forms, ``sampling_params``), the :class:`Request` the scheduler runs, and SGLang's response object built from it.

:class:`RequestForms` is the part of :class:`~slimecore.engines.embedded.server.EmbeddedServer` that reads a body
and writes a response; it uses the server's tokenizer, model config, ``context_len``, ``eos_ids``,
``think_end_id`` and ``weight_version``, set when the model loads.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from slimecore.engines.http import BadRequest
from slimecore.engines.routed_experts import RoutedRows, routed_rows

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
    routed_experts: RoutedRows | None = None  # the experts of each token run, on an engine that records them

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


class RequestForms:
    """/generate bodies in, SGLang's response objects out."""

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
                       think_end=self.think_end_id if body.get("require_reasoning") else None,
                       routed_experts=routed_rows(body, len(ids)) if self.routes else None)

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
        if req.routed_experts is not None and (routed := req.routed_experts.encoded(len(req.input_ids) + len(ids))):
            meta["routed_experts"] = routed
        return {"text": text, "output_ids": list(ids), "meta_info": meta}
