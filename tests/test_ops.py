"""Shared RL math on hand-computed cases, against slime's formulas: ``compute_approx_kl``,
``distributed_masked_whiten``, log-probs and entropy, ``sum_of_sample_mean``."""

import math

import pytest
import torch

from devices import DEVICES, fp32_strict, tolerance
from slimecore.ops import (approx_kl, entropy_from_logits, linear_log_probs_and_entropy, log_probs_and_entropy,
                           log_probs_from_logits, make_sample_mean_reducer, make_token_mean_reducer, masked_mean, masked_sum, masked_whiten,
                           per_sample_response_log_probs)

# -- KL estimators ---------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    lp, base = torch.tensor([0.0, -1.0]), torch.tensor([-1.0, 0.0])  # delta = [1, -1]
    assert approx_kl(lp, base, "k1").tolist() == [1.0, -1.0]
    assert approx_kl(lp, base, "k2").tolist() == [0.5, 0.5]
    k3 = [math.exp(-1) - 1 + 1, math.exp(1) - 1 - 1]
    assert approx_kl(lp, base, "k3").tolist() == pytest.approx(k3, rel=1e-6)
    assert approx_kl(lp, base, "low_var_kl").tolist() == pytest.approx(k3, rel=1e-6)
    # the importance ratio multiplies before the low_var_kl clamp
    assert approx_kl(lp, base, "k1", importance_ratio=torch.tensor([2.0, 3.0])).tolist() == [2.0, -3.0]
    # k3(delta=-3) = e^3 - 4 = 16.1: clamping first would give 0.5 * 10 = 5, slime's order gives 8.04
    ratio_then_clamp = approx_kl(torch.tensor([-3.0]), torch.tensor([0.0]), "low_var_kl", torch.tensor([0.5]))
    assert ratio_then_clamp.item() == pytest.approx(0.5 * (math.exp(3) - 4), rel=1e-6)
    with pytest.raises(ValueError, match="--kl-loss-type"):
        approx_kl(lp, base, "k4")


def test_kl_is_zero_for_equal_inputs():
    x = torch.randn(5)
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        assert approx_kl(x, x.clone(), kind).abs().max().item() == 0.0


def test_k3_is_unclamped_but_finite_and_low_var_kl_has_finite_gradients():
    lp = torch.tensor([-30.0, -200.0], requires_grad=True)
    base = torch.zeros(2)
    k3 = approx_kl(lp, base, "k3")
    assert k3[0].item() == pytest.approx(math.exp(30) - 31, rel=1e-5)  # slime's value, unclamped
    assert math.isfinite(k3[1].item())  # slime: inf (exp(200) overflows fp32)
    low = approx_kl(lp, base, "low_var_kl")
    assert low.tolist() == [10.0, 10.0]
    low.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad.abs().max().item() == 0.0  # clamped: zero, not NaN


# -- log-probs and entropy ----------------------------------------------------------------------------


def test_log_probs_and_entropy_with_temperature_by_hand():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    targets = torch.tensor([1, 2])
    t = 0.7
    z = logits / t
    manual_lp = [z[i, targets[i]].item() - math.log(sum(math.exp(v) for v in z[i].tolist())) for i in range(2)]
    p = torch.softmax(z, -1)
    manual_h = (-(p * p.log()).sum(-1)).tolist()
    assert log_probs_from_logits(logits, targets, temperature=t).tolist() == pytest.approx(manual_lp, abs=1e-6)
    assert entropy_from_logits(logits, t).tolist() == pytest.approx(manual_h, abs=1e-6)
    lp, h = log_probs_and_entropy(logits.to(torch.bfloat16), targets, t, chunk_size=1)
    assert lp.dtype == h.dtype == torch.float32  # fp32 math whatever the logits' dtype
    with pytest.raises(ValueError, match="--rollout-temperature"):
        log_probs_from_logits(logits, targets, temperature=0.0)


def test_chunking_changes_nothing():
    logits, targets = torch.randn(7, 11), torch.randint(0, 11, (7,))
    full = log_probs_and_entropy(logits, targets, 1.3)
    chunked = log_probs_and_entropy(logits, targets, 1.3, chunk_size=3)
    for a, b in zip(full, chunked):
        assert torch.equal(a, b)


def test_per_sample_response_slices_padded_and_packed_layouts():
    tokens = [[1, 2, 3, 4, 5], [6, 7, 8]]
    response_lengths = [2, 1]
    torch.manual_seed(0)
    padded = torch.randn(2, 5, 9)  # (B, T, V); row 1 is padded after position 3
    lps, ents = per_sample_response_log_probs(padded, tokens, response_lengths, temperature=2.0, with_entropy=True)
    # sample 0: tokens 4, 5 are predicted by positions 2, 3; sample 1: token 8 by position 1
    assert torch.allclose(lps[0], log_probs_from_logits(padded[0, 2:4], torch.tensor([4, 5]), 2.0))
    assert torch.allclose(lps[1], log_probs_from_logits(padded[1, 1:2], torch.tensor([8]), 2.0))
    assert torch.allclose(ents[1], entropy_from_logits(padded[1, 1:2], 2.0))
    packed = torch.cat([padded[0], padded[1, :3]]).unsqueeze(0)  # (1, 8, V): the samples concatenated
    packed_lps, none = per_sample_response_log_probs(packed, tokens, response_lengths, temperature=2.0)
    assert none is None and all(torch.equal(a, b) for a, b in zip(lps, packed_lps))
    with pytest.raises(ValueError, match="response_length"):
        per_sample_response_log_probs(padded, tokens, [5, 1])


# -- masked statistics ---------------------------------------------------------------------------------


def test_masked_sum_and_mean():
    a, m = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert masked_sum(a, m).item() == 8.0
    assert masked_mean(a, m).item() == pytest.approx(8 / 3)
    assert masked_mean(a, m, dim=1).tolist() == [1.0, 3.5]
    assert masked_mean(a, torch.zeros(2, 2), dim=1).tolist() == [0.0, 0.0]


def test_masked_whiten_formula_and_safety():
    a, m = torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert masked_whiten(a, m)[:3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)  # mean 2, Bessel var 1
    assert masked_whiten(a, m, shift_mean=False)[:3].tolist() == pytest.approx([1.0, 2.0, 3.0], abs=1e-6)
    # constant input: exactly 0 (a one-pass fp32 variance can go negative and give NaN)
    assert masked_whiten(torch.full((5,), 0.3), torch.ones(5)).abs().max().item() == 0.0
    # one unmasked token: centred, not multiplied by rsqrt(1e-8) = 1e4
    assert masked_whiten(torch.tensor([5.0, 9.0]), torch.tensor([1.0, 0.0]))[0].item() == 0.0
    with pytest.raises(ValueError, match="every entry is masked"):
        masked_whiten(a, torch.zeros(4))


# -- reducers --------------------------------------------------------------------------------------------


def test_sample_mean_reducer_with_shared_rollout_and_fully_masked_sample():
    # samples 0 and 1 form one rollout (4 mask tokens together); sample 2 is its own rollout, fully masked
    x = [torch.tensor([1.0, 1.0]), torch.tensor([2.0, 6.0]), torch.tensor([5.0])]
    masks = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0])]
    reduce = make_sample_mean_reducer(masks, [4.0, 4.0, 0.0], num_rollouts_step=2)
    assert reduce(x).item() == pytest.approx(((1 + 1 + 2 + 6) / 4 + 0.0) / 2)
    # split over micro-batches, the shares add up to the same value
    a = make_sample_mean_reducer(masks[:1], [4.0], 2)(x[:1])
    b = make_sample_mean_reducer(masks[1:], [4.0, 0.0], 2)(x[1:])
    assert (a + b).item() == pytest.approx(reduce(x).item())
    with pytest.raises(ValueError, match="shape"):
        reduce([torch.ones(3), x[1], x[2]])


def test_token_mean_reducer():
    x = [torch.tensor([1.0, 3.0]), torch.tensor([2.0])]
    masks = [torch.tensor([1.0, 0.0]), torch.tensor([1.0])]
    assert make_token_mean_reducer(masks, 2)(x).item() == 1.5
    assert make_token_mean_reducer(masks, 4)(x).item() == 0.75  # N is the step's tokens, not the micro-batch's
    assert make_token_mean_reducer([], 0)([]).item() == 0.0


# -- the LM head and log-probs in chunks, logits recomputed in backward -------------------------------------


def _head_case(device, n=37, hidden=16, vocab=50, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(device).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).to(device).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g).to(device)
    weights = torch.randn(2, n, generator=g).to(device)  # a loss mixing log-probs and entropies
    return h, w, b, targets, weights


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_entropy, bias, chunk", [(True, True, 8), (True, False, 100), (False, True, 5)])
def test_chunked_head_log_probs_equal_the_full_logits_path(device, with_entropy, bias, chunk):
    """Values and gradients (hidden states, head weight and bias) equal those of the whole (N, V) logits through
    ``log_probs_and_entropy``, whatever the chunking: fp32 1e-6 on the CPU (1e-5 on CUDA, TF32 off), relative to
    the largest entry of a tensor when that is above 1 (the head's gradient sums N rows in another order: a few
    ulps of values near 7)."""
    h, w, b, targets, weights = _head_case(device, bias=bias)
    with fp32_strict():
        lp, ent = log_probs_and_entropy(torch.nn.functional.linear(h, w, b), targets, 0.7, with_entropy)
        loss = (weights[0] * lp).sum() + ((weights[1] * ent).sum() if with_entropy else 0)
        want = _grads(loss, (h, w, b))
        got_lp, got_ent = linear_log_probs_and_entropy(h, w, targets, 0.7, with_entropy, bias=b, chunk_size=chunk)
        got_loss = (weights[0] * got_lp).sum() + ((weights[1] * got_ent).sum() if with_entropy else 0)
        got = _grads(got_loss, (h, w, b))
    tol = tolerance(device)
    assert got_lp.dtype == torch.float32 and (got_lp - lp).abs().max().item() < tol
    assert (got_ent is None) == (not with_entropy)
    if with_entropy:
        assert (got_ent - ent).abs().max().item() < tol
    assert len(got) == len(want) == (3 if bias else 2)
    for g, ref in zip(got, want):
        assert g.shape == ref.shape and g.abs().max().item() > 0
        assert (g - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_head_under_bf16_autocast_matches_the_autocast_logits(device):
    """Under autocast the head's matmuls run in bf16 as the model's own head would; the softmax stays fp32."""
    h, w, b, targets, _ = _head_case(device, bias=False)
    with torch.autocast(device, dtype=torch.bfloat16):
        lp, ent = log_probs_and_entropy(torch.nn.functional.linear(h, w), targets, 1.0)
        got_lp, got_ent = linear_log_probs_and_entropy(h, w, targets, 1.0, chunk_size=7)
    assert got_lp.dtype == torch.float32
    assert (got_lp - lp).abs().max().item() < 1e-5 and (got_ent - ent).abs().max().item() < 1e-5
    grads = _grads(got_lp.sum() + got_ent.sum(), (h, w))
    assert grads[0].dtype == grads[1].dtype == torch.float32  # the leaves' dtype, as autograd gives
    with pytest.raises(ValueError, match="--rollout-temperature"):
        linear_log_probs_and_entropy(h, w, targets, 0.0)
