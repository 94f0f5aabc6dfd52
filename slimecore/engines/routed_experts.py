"""The embedded engine's side of rollout routing replay (SGLang's ``--enable-return-routed-experts``,
``slimecore.routing_replay``): what a ``/generate`` body asks for, the record kept per request, and the recorder
that reads each MoE router's choice after every forward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from slimecore.engines.http import BadRequest
from slimecore.routers import ROUTERS, find_routers
from slimecore.routing_replay import encode


@dataclass
class RoutedRows:
    """What one engine request that asked for its routing (``return_routed_experts``) has run so far: ``rows``,
    one ``(tokens, layers, topk)`` int32 array per forward, in token order; ``start`` is SGLang's
    ``routed_experts_start_len``, the first position the answer covers."""

    start: int = 0
    rows: list[np.ndarray] = field(default_factory=list)

    def encoded(self, seqlen: int) -> str | None:
        """SGLang's ``meta_info.routed_experts`` for positions ``[start, seqlen - 1)``: a request's last token never
        runs through the model. None when nothing ran (a request aborted while it waited)."""
        if not self.rows:
            return None
        return encode(np.concatenate(self.rows)[self.start:seqlen - 1])


def routed_rows(body: dict, prompt_len: int) -> RoutedRows:
    """The routing record of a ``/generate`` body on an engine that records (``routed_experts_start_len`` checked as
    SGLang checks it). Every request gets one, ``return_routed_experts`` or not: the upstream sglang-router (0.3.2)
    drops that field on its way to the worker (slime relies on its router fork, which forwards the raw body), so
    an engine started to record answers every request's routing."""
    start = body.get("routed_experts_start_len") or 0
    if not isinstance(start, int) or not 0 <= start <= prompt_len:
        raise BadRequest(f"routed_experts_start_len={start!r} must be an integer in [0, {prompt_len}] (the number of "
                         "input tokens)")
    return RoutedRows(start)


class ExpertRecorder:
    """The embedded engine's record of the experts each token was routed to (SGLang's
    ``--enable-return-routed-experts``). A forward hook on every router keeps its last top-k; after each model
    forward the engine calls :meth:`keep` with the requests of the forward's rows, and each request that asked
    (``Request.routed_experts`` a ``slimecore.routing_replay.RoutedRows``) gets the rows of its real (unpadded)
    tokens. Forwards: a prefill (``mask`` its (B, T) attention mask over the new tokens; B may be 1 for a prefix
    shared by all the requests), a decode step (``mask`` None: one new token per row)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"return_routed_experts: {type(model).__name__} has no MoE router of "
                             f"{', '.join(ROUTERS)}")
        self.layers = model.config.num_hidden_layers
        self.topk = self.routers[0][1].top_k
        self._last: dict[int, torch.Tensor] = {}
        for layer, router in self.routers:
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def keep_indices(module, args, output) -> None:
            self._last[layer] = output[2]

        return keep_indices

    def keep(self, reqs: Sequence, mask: torch.Tensor | None = None) -> None:
        last, self._last = self._last, {}
        asking = [i for i, r in enumerate(reqs) if r.routed_experts is not None]
        if not asking:
            return
        rows, width = (len(reqs), 1) if mask is None else mask.shape
        # dense layers route nothing: zeros, as SGLang's buffer holds for them
        routed = torch.zeros(rows * width, self.layers, self.topk, dtype=torch.int32)
        for layer, indices in last.items():
            routed[:, layer] = indices.reshape(rows * width, self.topk)
        routed = routed.view(rows, width, self.layers, self.topk)
        for i in asking:
            row = routed[i if rows > 1 else 0]
            real = row if mask is None else row[mask[i if rows > 1 else 0].bool()]
            reqs[i].routed_experts.rows.append(real.numpy())

    @staticmethod
    def share(reqs: Sequence, rows: Sequence[int]) -> None:
        """Identical prompts prefilled once: request i gets the prompt routing of the first request of its row
        ``rows[i]``."""
        for req, row in zip(reqs, rows):
            first = reqs[rows.index(row)]
            if req is not first and req.routed_experts is not None and first.routed_experts is not None:
                req.routed_experts.rows[:] = first.routed_experts.rows
