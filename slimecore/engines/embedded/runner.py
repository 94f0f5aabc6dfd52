"""The embedded engine's forwards: the prefill of a group of prompts and the decode step, over a batch of KV rows.

Prompts are prefilled together with HF's forward (left padding, attention mask, position ids from the mask);
each step decodes through the engine's own decode step for Llama/Qwen2/Qwen3
(:mod:`slimecore.engines.fastpath`) or HF's forward for other architectures, with the HF KV cache. Identical
prompts (the n samples of one prompt) are prefilled once and their rows copied; prompts that start with the
same tokens (a shared chat template) prefill that prefix once, as SGLang's prefix cache does, and the cache
layers write each step into a buffer grown by chunks, not a new concatenated copy. Rows that join a running
batch get their cache left-padded to the same length (:class:`_Batch`).

:class:`ModelRunner` is the part of :class:`~slimecore.engines.embedded.server.EmbeddedServer` that runs the
model (``model``, ``fast``, ``cache_name``, ``pad_id``, set when the model loads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimecore.engines.embedded.request import Request


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


class ModelRunner:
    """Prefill and decode."""

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
            if self.routes:
                self.routes.share(reqs, rows)
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
        if self.routes:
            self.routes.keep(reqs, mask)
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
        if self.routes:
            self.routes.keep(reqs, torch.ones(1, shared))
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
        if self.routes:
            self.routes.keep(reqs, own)
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
