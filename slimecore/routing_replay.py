"""Rollout routing replay (R3) for mixture-of-experts models: slime's ``--use-rollout-routing-replay``.

Why. A MoE layer's router sends each token to its top-k experts. The engine that sampled a response and the trainer
that scores it may pick different experts for the same token (other kernels, batch shapes or precision turn a
near-tie the other way), and then the trainer's log-probs are those of another network than the one that
sampled. With the flag, the engine returns the experts every MoE layer routed each token to, and the trainer routes
each token to exactly those experts, for the old-policy log-probs and for the training forward and backward. The
replayed experts are still weighted by the trainer's own router (its softmax, or sigmoid, probabilities of those
experts, renormalised as the model does), so the router keeps its gradient: slime's and Miles' rule
(``scores.gather(1, replayed_indices)``). The reference policy routes by itself, as in slime; a value model (critic)
too.

Wire format, SGLang's. The request asks with ``"return_routed_experts": true`` (and optionally
``routed_experts_start_len``, the first position returned, default 0); ``meta_info.routed_experts`` is the
base64 of a C-order little-endian int32 array ``(prompt + completion - 1 - start, num_hidden_layers,
num_experts_per_tok)``: row p holds the experts of the token at position p for every decoder layer (the last
token never runs through the model). SGLang records only when started with ``--enable-return-routed-experts``
(slime-core passes it; the embedded engine records when started with ``return_routed_experts=True``).

Storage. ``Sample.rollout_routed_experts`` holds the rows of the sample's tokens as a numpy array ``(T - 1,
layers, top-k)`` of the smallest unsigned type that holds an expert id (uint8 up to 256 experts): 64k tokens x 48
layers x top-8 is 25 MB, where nested Python lists would take over 20 times as much. It becomes the training column
``rollout_routed_experts``, which ``slimecore.rollout.schedule.split_for_ranks`` slices like every per-sample
column, so each data-parallel rank receives its own samples' routing only (the host OOM of THUDM/slime#2384).

R2, slime's ``--use-routing-replay``, needs no engine: the actor's old-policy log-prob pass routes freely and
records every MoE layer's experts per token into the same per-sample arrays, the batch column
``rollout_routed_experts``, and the training forward and its recompute in backward replay them through R3's code,
so that the first step's ratio is that of one network (the router's weights may still move: only the choice is
kept). The trainer runs that pass even where the loss would reuse its own forward or the rollout's log-probs (slime
forces it where it would reuse the forward: ``can_reuse_log_probs_in_loss`` excludes R2). With both flags R3 wins,
as in slime, where ``--use-rollout-routing-replay`` implies ``--use-routing-replay``.

This module imports no torch: the flags' checks before Ray, the wire format and the sample's routing. The routers
the trainers replay (and R2's record) are ``slimecore.routers``; the embedded engine's record is
``slimecore.engines.routed_experts``.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from slimecore.errors import ConfigError

FLAG = "--use-rollout-routing-replay"
R2_FLAG = "--use-routing-replay"
# a backend asked to replay a batch that has no routing to replay
NO_ROUTING_COLUMN = (f"routing replay: the batch has no rollout_routed_experts column ({FLAG}: the rollout's; "
                     f"{R2_FLAG}: Trainer.train's old-policy log-prob pass records it)")
# HF model types whose router the trainers can replay (their router classes: slimecore.routers.ROUTERS)
REPLAYABLE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "deepseek_v3", "glm4_moe")


class RoutingError(ValueError):
    """An engine answer whose routed experts are missing or do not fit the sample."""


@dataclass(frozen=True)
class RoutingShape:
    """What one token's routing holds: ``layers`` decoder layers (dense ones included, as SGLang returns them)
    x ``topk`` experts, ids below ``num_experts``."""

    layers: int
    topk: int
    num_experts: int
    model_type: str

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned integer type that holds every expert id."""
        return expert_dtype(self.num_experts)


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest unsigned integer type that holds the ids of ``num_experts`` experts."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16 if num_experts <= 65536 else np.uint32)


def routing_shape(hf_config: dict) -> RoutingShape | None:
    """The routing shape of a checkpoint's ``config.json`` (a dict), None for a dense model."""
    experts = hf_config.get("num_experts") or hf_config.get("n_routed_experts") or hf_config.get("num_local_experts")
    topk = hf_config.get("num_experts_per_tok")
    if not experts or not topk:
        return None
    return RoutingShape(int(hf_config["num_hidden_layers"]), int(topk), int(experts), hf_config.get("model_type", ""))


@lru_cache(maxsize=8)
def checkpoint_shape(checkpoint: str) -> RoutingShape | None:
    """``routing_shape`` of the HF checkpoint directory ``checkpoint``."""
    return routing_shape(json.loads((Path(checkpoint) / "config.json").read_text()))


def replays(config) -> bool:
    """Whether the policy's trainer replays routing: the rollout's (R3) or its own old-policy pass's (R2)."""
    return bool(config.use_rollout_routing_replay or config.use_routing_replay)


def records(config) -> bool:
    """R2 alone: the old-policy log-prob pass records the routing that training replays (with R3 the rollout's
    routing is replayed in both passes)."""
    return bool(config.use_routing_replay and not config.use_rollout_routing_replay)


def check_config(config) -> None:
    """Before Ray (``slimecore.trainers.backend.check_startup``): replay needs a MoE checkpoint whose router the
    trainer can replay, and R3 engines that return the experts. One ``ConfigError`` line otherwise."""
    if not replays(config):
        return
    flag = FLAG if config.use_rollout_routing_replay else R2_FLAG
    if config.use_rollout_routing_replay and config.without_engines:
        raise ConfigError(f"{FLAG} replays the experts the engines routed each token to, but this run starts no "
                          "engine (--no-engines / --debug-train-only): drop the flag")
    shape = checkpoint_shape(config.hf_checkpoint)
    model_type = json.loads((Path(config.hf_checkpoint) / "config.json").read_text()).get("model_type")
    if shape is None:
        raise ConfigError(f"{flag}: --hf-checkpoint {config.hf_checkpoint} is a dense model (model_type "
                          f"{model_type!r}, no routed experts in its config.json); routing replay applies to "
                          "mixture-of-experts models only: drop the flag")
    if (config.use_rollout_routing_replay and config.rollout_engine == "sglang" and config.sglang_router_ip is None
            and not _router_forwards_raw_body()):
        raise ConfigError(f"{FLAG} with --rollout-engine sglang: the installed sglang-router drops "
                          "return_routed_experts on its way to the engines (upstream 0.3.2 re-serialises /generate); "
                          "install slime's router fork (zhuzilin/sgl-router, a version naming slime), which forwards "
                          "the raw body")
    if model_type not in REPLAYABLE_MODEL_TYPES:
        raise ConfigError(f"{flag}: the trainer cannot replay the router of model_type {model_type!r} "
                          f"(--hf-checkpoint {config.hf_checkpoint}); it can for {', '.join(REPLAYABLE_MODEL_TYPES)}")


def _router_forwards_raw_body() -> bool:
    """Whether the installed sglang-router is slime's fork (its version names slime, as slime's install checks)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "slime" in version("sglang-router")
    except PackageNotFoundError:  # not installed: starting the router fails with its own message
        return True


def encode(experts: np.ndarray) -> str:
    """SGLang's ``meta_info.routed_experts`` for the rows ``experts`` ``(rows, layers, topk)``."""
    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


def decode(meta_info: dict, num_tokens: int, shape: RoutingShape, previous: np.ndarray | None = None) -> np.ndarray:
    """The routing of a sequence of ``num_tokens`` tokens from SGLang's ``meta_info``, as ``(num_tokens - 1,
    layers, topk)`` in ``shape.dtype``. Rows before ``meta_info["routed_experts_start_len"]`` (when the request
    asked from there) come from ``previous``, the routing kept for the same tokens before."""
    value = meta_info.get("routed_experts")
    if value is None:
        raise RoutingError(f"{FLAG}: the engine's answer has no meta_info.routed_experts; start SGLang with "
                           "--enable-return-routed-experts (slime-core does with the flag) and send "
                           "return_routed_experts in /generate (the rollout client does)")
    try:
        flat = np.frombuffer(base64.b64decode(value, validate=True), dtype="<i4")
    except (binascii.Error, ValueError, TypeError) as exc:
        raise RoutingError(f"meta_info.routed_experts is not base64 of int32 values ({exc})") from None
    start = int(meta_info.get("routed_experts_start_len") or 0)
    rows = num_tokens - 1 - start
    per_row = shape.layers * shape.topk
    if rows < 0 or flat.size != rows * per_row:
        raise RoutingError(f"meta_info.routed_experts holds {flat.size} ids; {num_tokens} tokens from position {start} "
                           f"need {max(rows, 0)} rows x {shape.layers} layers x top-{shape.topk} = "
                           f"{max(rows, 0) * per_row} (SGLang returns positions [start, tokens - 1))")
    if flat.size and (flat.min() < 0 or flat.max() >= shape.num_experts):
        raise RoutingError(f"meta_info.routed_experts has expert id {int(flat.min() if flat.min() < 0 else flat.max())}"
                           f" outside [0, {shape.num_experts})")
    experts = flat.astype(shape.dtype).reshape(rows, shape.layers, shape.topk)
    if start == 0:
        return experts
    if previous is None or len(previous) < start:
        raise RoutingError(f"meta_info.routed_experts starts at position {start} but only "
                           f"{0 if previous is None else len(previous)} earlier rows are kept")
    return np.concatenate([previous[:start], experts])


def check_samples(samples) -> None:
    """Every sample of a step carries routing for each of its tokens but the last (``convert_samples`` calls it
    with the flag on)."""
    for sample in samples:
        experts = getattr(sample, "rollout_routed_experts", None)
        if experts is None:
            raise RoutingError(f"{FLAG}: sample {sample.index} has no rollout_routed_experts; a generate hook must "
                               "keep them with client.keep_routed_experts(sample, out['meta_info']) after each "
                               "/generate (the built-in single- and multi-turn generate do; agent sessions do not)")
        if len(experts) != len(sample.tokens) - 1:
            raise RoutingError(f"{FLAG}: sample {sample.index} has routing for {len(experts)} positions but "
                               f"{len(sample.tokens)} tokens (needs tokens - 1: were tokens appended after the last "
                               "/generate?)")
