"""The LM head, log-softmax, token log-probs and entropy of many token positions, a chunk of positions at a time,
without ever holding the whole-vocabulary logits of every position: the chunk's logits are recomputed in the
backward pass (a fused linear + log-prob, as Liger's fused linear cross-entropy does for the loss alone).

``log_probs = log softmax(z)[target]`` and ``entropy = logsumexp(z) - sum softmax(z) z`` with
``z = (hidden @ weight.T + bias) / T``, the same numbers as ``slimecore.ops.logprobs.log_probs_and_entropy`` of
the head's logits. The head's matmuls run in ``compute_dtype`` (the autocast dtype of the caller, or the weight's
dtype); the softmax math is fp32, as there. Peak memory is a chunk's logits (``chunk_size`` x V, in
``compute_dtype`` and fp32) instead of every position's, and the backward writes the hidden states' and head's
gradients chunk by chunk.

Tensor parallelism (Megatron's vocab-parallel head): with ``group`` each rank holds the vocabulary rows
``[vocab_start, vocab_start + V_local)`` of the head; the max, sum(exp), target logit and sum(p z) of a row are
all-reduced over ``group``; the hidden states' gradient is this rank's part (the caller sums it over the group,
as Megatron's ``copy_to_tensor_model_parallel_region`` does in backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_TOKENS = 1024  # positions per chunk: 1024 x 152k vocabulary = 0.6 GB of fp32 logits on a GPU


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, chunk_size, compute_dtype,
                vocab_start, group):
        n, local = hidden.shape[0], weight.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(log_probs)
        mean_z = torch.empty_like(log_probs)  # sum softmax(z) z, for the entropy and its gradient
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            z = _logits(hidden[a:b], weight, bias, compute_dtype).float() / temperature  # (c, V_local)
            lp, lse[a:b], ez = _row_stats(z, targets[a:b], vocab_start, group, with_entropy)
            log_probs[a:b] = lp
            if with_entropy:
                mean_z[a:b] = ez
        ctx.save_for_backward(hidden, weight, bias, targets, lse, mean_z)
        ctx.options = (temperature, with_entropy, chunk_size, compute_dtype, vocab_start)
        return log_probs, (lse - mean_z if with_entropy else lse.new_zeros(0))

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, targets, lse, mean_z = ctx.saved_tensors
        temperature, with_entropy, chunk_size, compute_dtype, vocab_start = ctx.options
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                     if want_bias and bias is not None else None)
        w = weight.to(compute_dtype)
        local = weight.shape[0]
        for a in range(0, hidden.shape[0], chunk_size):
            b = min(a + chunk_size, hidden.shape[0])
            h = hidden[a:b].to(compute_dtype)
            z = _logits(h, weight, bias, compute_dtype).float() / temperature  # (c, V_local), recomputed
            # d lp / dz = onehot(target) - p; d H / dz = -p (z - sum p z): dz = -p (g_lp + g_H (z - sum p z))
            # + g_lp at the target, computed in place in two (c, V_local) fp32 buffers
            dz = torch.exp(z - lse[a:b, None])  # p
            if with_entropy and grad_entropy is not None:
                z.sub_(mean_z[a:b, None]).mul_(grad_entropy[a:b, None]).add_(grad_log_probs[a:b, None])
                dz.mul_(z).neg_()
            else:
                dz.mul_(-grad_log_probs[a:b, None])
            del z
            index = targets[a:b] - vocab_start
            here = (index >= 0) & (index < local)
            rows = torch.arange(b - a, device=dz.device)[here]
            dz[rows, index[here]] += grad_log_probs[a:b][here]
            d_logits = dz.div_(temperature).to(compute_dtype)  # (c, V_local)
            if want_hidden:
                grad_hidden[a:b] = (d_logits @ w).to(hidden.dtype)
            if want_weight:  # fp32: accumulated in place; else one (V, H) product in compute_dtype per chunk
                if compute_dtype == torch.float32:
                    grad_weight.addmm_(d_logits.t(), h)
                else:
                    grad_weight += d_logits.t() @ h
            if grad_bias is not None:
                grad_bias += d_logits.float().sum(0)
        return (grad_hidden, grad_weight.to(weight.dtype) if want_weight else None,
                grad_bias.to(bias.dtype) if grad_bias is not None else None) + (None,) * 7


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        return torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype),
                                          None if bias is None else bias.to(dtype))


def _row_stats(z: torch.Tensor, targets: torch.Tensor, vocab_start: int, group, with_entropy: bool):
    """Per row of the fp32 logits ``z`` (this rank's vocabulary slice): the target's log-prob, the logsumexp and
    sum softmax(z) z over the whole vocabulary (all-reduced over ``group``)."""
    local = z.shape[-1]
    if group is None:  # the whole vocabulary here: the same operations as log_probs_and_entropy
        lse = torch.logsumexp(z, dim=-1)
        lp = z.gather(-1, (targets - vocab_start)[:, None]).squeeze(-1) - lse
        return lp, lse, (torch.softmax(z, dim=-1) * z).sum(-1) if with_entropy else None
    peak = z.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    exp = torch.exp(z - peak[:, None])
    sums = [exp.sum(-1)]
    index = targets - vocab_start
    here = (index >= 0) & (index < local)
    picked = z.gather(-1, index.clamp(0, local - 1)[:, None]).squeeze(-1)
    sums.append(torch.where(here, picked, torch.zeros_like(picked)))
    if with_entropy:
        sums.append((exp * z).sum(-1))
    stacked = torch.stack(sums)
    dist.all_reduce(stacked, group=group)
    lse = peak + torch.log(stacked[0])
    mean_z = stacked[2] / stacked[0] if with_entropy else None
    return stacked[1] - lse, lse, mean_z


def linear_log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                 temperature: float = 1.0, with_entropy: bool = True, *,
                                 bias: torch.Tensor | None = None, chunk_size: int = CHUNK_TOKENS,
                                 compute_dtype: torch.dtype | None = None, vocab_start: int = 0, group=None
                                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` (and entropies) under the head ``weight`` (V, H) [+ ``bias`` (V,)] applied to
    ``hidden`` (N, H), divided by ``temperature``: (N,), (N,) or None, fp32, differentiable in ``hidden``,
    ``weight`` and ``bias``. ``compute_dtype``: the matmuls' dtype (default: the caller's autocast dtype when
    autocast is on, else the weight's). ``vocab_start``/``group``: a vocab-parallel head (module docstring)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature}); check --rollout-temperature")
    if compute_dtype is None:
        device = hidden.device.type
        compute_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype)
    log_probs, entropy = _LinearLogProbs.apply(hidden, weight, bias, targets, float(temperature), bool(with_entropy),
                                               max(1, int(chunk_size)), compute_dtype, int(vocab_start), group)
    return log_probs, (entropy if with_entropy else None)
