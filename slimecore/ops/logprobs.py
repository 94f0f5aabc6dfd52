"""Token log-probs and entropy from logits (slime's ``get_log_probs_and_entropy``).

Logits are divided by the rollout temperature, so the trainer scores tokens under the same distribution
the engine sampled from. All math is fp32 whatever the logits' dtype. ``chunk_size`` processes that
many rows (token positions) at a time, so the fp32 copy of the logits never exists for every position at
once; it saves memory mostly under ``no_grad`` (with autograd each chunk's activations are kept anyway).
"""

from __future__ import annotations

from typing import Sequence

import torch


def _rows(logits: torch.Tensor, chunk_size: int | None) -> list[slice]:
    n = logits.shape[0]
    step = chunk_size if chunk_size and chunk_size > 0 else max(n, 1)
    return [slice(i, i + step) for i in range(0, n, step)] or [slice(0, 0)]


def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                          with_entropy: bool = True, chunk_size: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z)[target]`` and ``H = logsumexp(z) - sum softmax(z) z`` with ``z = logits / T``.

    logits (..., V), targets (...) -> log-probs (...), entropy (...) or None. The logsumexp is shared.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature}); check --rollout-temperature")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_targets = targets.reshape(-1)  # (N,)
    log_probs, entropy = [], []
    for rows in _rows(flat, chunk_size):
        z = flat[rows].float() / temperature  # (n, V)
        lse = torch.logsumexp(z, dim=-1)  # (n,)
        log_probs.append(z.gather(-1, flat_targets[rows].unsqueeze(-1)).squeeze(-1) - lse)
        if with_entropy:
            entropy.append(lse - (torch.softmax(z, dim=-1) * z).sum(-1))
    lp = torch.cat(log_probs).reshape(lead)
    return lp, (torch.cat(entropy).reshape(lead) if with_entropy else None)


def log_probs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                          chunk_size: int | None = None) -> torch.Tensor:
    """``log softmax(logits / T)[target]`` in fp32. logits (..., V), targets (...) -> (...)."""
    return log_probs_and_entropy(logits, targets, temperature, with_entropy=False, chunk_size=chunk_size)[0]


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> torch.Tensor:
    """``H = logsumexp(z) - sum softmax(z) z`` with ``z = logits / T``, in fp32. (..., V) -> (...)."""
    dummy = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)  # targets unused for H
    return log_probs_and_entropy(logits, dummy, temperature, with_entropy=True, chunk_size=chunk_size)[1]


def response_positions(tokens: Sequence[Sequence[int]], response_lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Per sample, the logits rows ``[start - 1, end - 1)`` that score its response tokens ``[start, end)``."""
    spans = []
    for i, (seq, r) in enumerate(zip(tokens, response_lengths, strict=True)):
        if not 0 <= r < len(seq):
            raise ValueError(f"sample {i}: response_length {r} must be in 0..{len(seq) - 1} (the prompt needs a "
                             "token to predict the first response token from)")
        spans.append((len(seq) - r - 1, len(seq) - 1))
    return spans


def per_sample_response_log_probs(logits_or_model_out, tokens: Sequence[Sequence[int]],
                                  response_lengths: Sequence[int], temperature: float = 1.0,
                                  with_entropy: bool = False, chunk_size: int | None = None
                                  ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per-sample response log-probs (and entropies), each ``(response_length,)``.

    ``logits_or_model_out`` is logits or an HF model output with ``.logits``, in one of two layouts:
    - right-padded batch ``(B, T, V)`` with row i holding ``tokens[i]`` from position 0;
    - packed ``(T_total, V)`` or ``(1, T_total, V)``: the samples concatenated in order.
    (With one sample the two layouts coincide.) Only the response rows go through the softmax.
    """
    logits = getattr(logits_or_model_out, "logits", logits_or_model_out)
    spans = response_positions(tokens, response_lengths)
    if logits.dim() == 3 and logits.shape[0] == len(tokens) and len(tokens) > 1:
        rows = [logits[i, a:b] for i, (a, b) in enumerate(spans)]  # padded: each (R_i, V)
    else:
        stream = logits.reshape(-1, logits.shape[-1])  # (T_total, V)
        if stream.shape[0] < sum(len(t) for t in tokens):
            raise ValueError(f"packed logits have {stream.shape[0]} positions for {sum(len(t) for t in tokens)} tokens")
        offsets = [0]
        for seq in tokens:
            offsets.append(offsets[-1] + len(seq))
        rows = [stream[o + a:o + b] for o, (a, b) in zip(offsets, spans)]
    device = logits.device
    targets = torch.cat([torch.as_tensor(list(seq[len(seq) - r:]), dtype=torch.long) for seq, r in
                         zip(tokens, response_lengths)]).to(device)  # (sum R,)
    lp, ent = log_probs_and_entropy(torch.cat(rows), targets, temperature, with_entropy, chunk_size)
    sizes = list(response_lengths)
    return list(lp.split(sizes)), (list(ent.split(sizes)) if with_entropy else None)
