"""The MoE routers of HF models, replayed by the fsdp trainer (and found by the embedded engine's recorder,
``slimecore.engines.routed_experts``), and the megatron backend's routers replayed through megatron-core's own
``RouterReplay`` (rollout routing replay, and R2's record of the old-policy pass: ``slimecore.routing_replay``
says what and why).

transformers' MoE routers (``ROUTERS``) all return ``(router_logits, topk_weights, topk_indices)`` for the
tokens flattened to rows ``(N, hidden)``: the engine reads ``topk_indices``; the
trainer swaps the router's forward for one that takes the indices given instead of its top-k and weights them
exactly as the model's own forward weights its own choice (:class:`RouterReplay`), so that replaying the
router's own choice changes nothing, bit for bit.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from slimecore.routing_replay import expert_dtype

# router class -> how it weights its experts: "softmax" (softmax over all experts, the top-k renormalised when
# norm_topk_prob) or "sigmoid" (sigmoid scores, the choice made on score + expert bias over the best groups, the
# chosen scores renormalised when norm_topk_prob, times routed_scaling_factor)
ROUTERS = {"Qwen2MoeTopKRouter": "softmax", "Qwen3MoeTopKRouter": "softmax",
           "DeepseekV3TopkRouter": "sigmoid", "Glm4MoeTopkRouter": "sigmoid"}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, router)`` of every MoE layer of ``model``, by layer."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ in ROUTERS:
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"MoE router {name!r} ({type(module).__name__}) is not under a layers.<i> module")
            found.append((int(match.group(1)), module))
    return sorted(found, key=lambda pair: pair[0])


def _replayed(router: torch.nn.Module, kind: str, hidden_states: torch.Tensor, indices: torch.Tensor):
    """The router's forward with ``indices`` (N, topk) in place of its top-k; the model's own weighting."""
    if kind == "softmax":  # Qwen2MoeTopKRouter / Qwen3MoeTopKRouter.forward
        logits = F.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)
        weights = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, indices)
        if router.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), indices
    # DeepseekV3TopkRouter / Glm4MoeTopkRouter.forward
    logits = F.linear(hidden_states.view(-1, router.hidden_dim).type(torch.float32), router.weight.type(torch.float32))
    weights = logits.sigmoid().gather(1, indices)
    if router.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return logits, weights * router.routed_scaling_factor, indices


def replay_layout(experts: Sequence[np.ndarray], lengths: Sequence[int], widths: Sequence[int], total: int,
                  layers: Sequence[int], topk: int, num_experts: int) -> torch.Tensor:
    """The (total, len(layers), topk) expert indices of a forward's token rows: sequence i (``lengths[i]`` tokens,
    routing ``experts[i]`` of ``(length - 1, all layers, topk)``) starts ``sum(widths[:i])`` rows in; its last token,
    the rows up to its width and those after the last sequence route to experts 0..topk-1 (no log-prob depends on
    them: they are padding, or the last token, whose logits score nothing)."""
    out = (torch.arange(topk, dtype=torch.long) % num_experts).repeat(total, len(layers), 1)
    start = 0
    for routed, n, width in zip(experts, lengths, widths):
        if len(routed) != n - 1:
            raise ValueError(f"rollout_routed_experts has {len(routed)} rows for a sequence of {n} tokens "
                             "(needs tokens - 1)")
        out[start:start + n - 1] = torch.from_numpy(np.asarray(routed)[:, list(layers)].astype(np.int64))
        start += width
    return out


def recorded_layout(chosen: dict[int, np.ndarray], lengths: Sequence[int], widths: Sequence[int], layers: int,
                    dtype: np.dtype) -> list[np.ndarray]:
    """R2's record, :func:`replay_layout` the other way round: from the (rows, topk) experts each MoE layer
    (``chosen``, by decoder layer) chose in one forward laid out as ``replay_layout`` lays it out, each sequence's
    routing ``(length - 1, layers, topk)`` in ``dtype``, the format of ``Sample.rollout_routed_experts`` (the
    columns of dense layers hold 0, as nothing reads them)."""
    topk = next(iter(chosen.values())).shape[1]
    out, start = [], 0
    for n, width in zip(lengths, widths):
        routed = np.zeros((n - 1, layers, topk), dtype=dtype)
        for layer, rows in chosen.items():
            routed[:, layer] = rows[start:start + n - 1]
        out.append(routed)
        start += width
    return out


class _OwnChoice:
    """A replay that :meth:`own_choice` can switch off for a block."""

    _own = False

    @property
    def own(self) -> bool:
        """Inside :meth:`own_choice`: the routers choose by themselves and nothing is recorded."""
        return self._own

    @contextlib.contextmanager
    def own_choice(self) -> Iterator[None]:
        """Within the block the routers choose their own experts, replaying or not (the reference policy)."""
        previous, self._own = self._own, True
        try:
            yield
        finally:
            self._own = previous


class RouterReplay(_OwnChoice):
    """The fsdp trainer's routers, made to route each token to given experts inside :meth:`replaying`.

    The model's routers get a forward that takes the indices set for their layer (and their own top-k outside the
    block). ``seen`` keeps the indices each router used in its last forward (what the exactness test compares)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay: {type(model).__name__} has no MoE router of "
                             f"{', '.join(ROUTERS)}")
        self.num_experts = self.routers[0][1].weight.shape[0]
        self.topk = self.routers[0][1].top_k
        self.layers = model.config.num_hidden_layers
        self._indices: dict[int, torch.Tensor] | None = None  # the experts to take, by layer; None: their own
        self.seen: dict[int, torch.Tensor] = {}
        for layer, router in self.routers:
            router.forward = types.MethodType(self._forward(layer, ROUTERS[type(router).__name__],
                                                            type(router).forward), router)

    def _forward(self, layer: int, kind: str, own):
        def forward(router, hidden_states):
            if self._indices is None:
                out = own(router, hidden_states)
            else:
                out = _replayed(router, kind, hidden_states, self._indices[layer].to(hidden_states.device))
            self.seen[layer] = out[2].detach()
            return out

        return forward

    def rows(self, experts: Sequence[np.ndarray], lengths: Sequence[int], width: int | None) -> dict[int, torch.Tensor]:
        """Per MoE layer, the (N, topk) indices of a forward over sequences of ``lengths`` whose routing is
        ``experts``: right-padded to ``width`` per row (B x width rows), or packed one after the other (``width``
        None); see :func:`replay_layout`."""
        layers = [layer for layer, _ in self.routers]
        widths = [width or n for n in lengths]
        out = replay_layout(experts, lengths, widths, sum(widths), layers, self.topk, self.num_experts)
        return {layer: out[:, k].contiguous() for k, layer in enumerate(layers)}

    def recorded(self, lengths: Sequence[int], width: int | None) -> list[np.ndarray]:
        """R2: each sequence's routing ``(length - 1, decoder layers, topk)`` as the routers chose it in their last
        forward, laid out as :meth:`rows` says; what :meth:`rows` replays in training."""
        widths = [width or n for n in lengths]
        return recorded_layout({layer: self.seen[layer].cpu().numpy() for layer, _ in self.routers}, lengths, widths,
                               self.layers, expert_dtype(self.num_experts))

    @contextlib.contextmanager
    def replaying(self, indices: dict[int, torch.Tensor]) -> Iterator[None]:
        """Within the block every router takes ``indices[layer]`` (from :meth:`rows`), unless inside
        :meth:`own_choice`."""
        previous = self._indices
        if not self._own:
            self._indices = indices
        try:
            yield
        finally:
            self._indices = previous


class MegatronRouterReplay(_OwnChoice):
    """The megatron backend's routers, given the rollout's experts per micro-batch through megatron-core's own
    ``RouterReplay`` (the model built with ``moe_enable_routing_replay``): its replay gathers the router's scores at
    the given experts, as slime's patch does. Global layer ``layer_number - 1`` of each ``TopKRouter`` picks the
    layer's column of the routing; with sequence parallelism a TP rank's routers see its slice of the stream."""

    def __init__(self, chunks: list, config):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter

        self.replays = {m.layer_number - 1: m.router_replay for chunk in chunks for m in chunk.modules()
                        if isinstance(m, TopKRouter)}
        if not self.replays or any(r is None for r in self.replays.values()):
            raise ValueError("routing replay: the megatron model has no MoE router built with "
                             "moe_enable_routing_replay")
        router = next(m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter))
        self.topk, self.num_experts = router.topk, router.config.num_moe_experts
        self.layers = router.config.num_layers
        self.tp = parallel_state.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank() if config.sequence_parallel else 0

    def indices(self, experts: Sequence[np.ndarray], lengths: Sequence[int], total: int) -> torch.Tensor:
        """The (rows, MoE layers, topk) indices of one packed stream of ``total`` rows (``pack``), this rank's
        slice of it."""
        out = replay_layout(experts, lengths, lengths, total, sorted(self.replays), self.topk, self.num_experts)
        per_rank = total // self.tp
        return out[self.tp_rank * per_rank:(self.tp_rank + 1) * per_rank]

    def recorded(self, lengths: Sequence[int]) -> list[np.ndarray]:
        """R2: each sequence's routing ``(length - 1, decoder layers, topk)`` as the routers chose it in the last
        forward (set with ``record``) over one packed stream, gathered from the tensor-parallel ranks' slices with
        sequence parallelism."""
        chosen = {}
        for layer, replay in self.replays.items():
            rows = replay.get_recorded_indices()
            if self.tp > 1:
                from megatron.core import parallel_state

                parts = [torch.empty_like(rows) for _ in range(self.tp)]
                dist.all_gather(parts, rows.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
                rows = torch.cat(parts)
            chosen[layer] = rows.cpu().numpy()
        return recorded_layout(chosen, lengths, lengths, self.layers, expert_dtype(self.num_experts))

    def set(self, indices: torch.Tensor | None, record: bool = False) -> None:
        """The next forward replays ``indices`` (from :meth:`indices`); with ``record``, the routers choose and
        megatron-core's ``RouterReplay`` keeps their choice for :meth:`recorded` (R2); otherwise, or inside
        :meth:`own_choice`, the routers choose their own experts."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for k, layer in enumerate(sorted(self.replays)):
            replay = self.replays[layer]
            replay.clear_indices()
            if self._own or (indices is None and not record):
                replay.clear_router_replay_action()
            elif record:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            else:  # an activation recompute takes these too: in the one-stage schedule it runs before the next
                # micro-batch's forward
                replay.set_target_indices(indices[:, k].contiguous())
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
