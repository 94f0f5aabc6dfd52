"""The embedded engine's own decode step for the common decoder families (Llama, Qwen2, Qwen3).

HF's ``model.forward`` spends most of a one-token step on CPU in Python: per layer it goes through
decorators, keyword plumbing, the cache object and the attention dispatch, and per step it builds the
mask. This module runs the same math on the model's own weights with a flat loop: the q/k/v projections
are one matmul, as are gate and up (their weights live in one fused tensor each), the rotary cos/sin and
the attention mask are made once per step, and the LM head runs on the one new position only. The KV
cache stays HF's (the engine's growing layers, written in place), so prefill, row selection and joining
are unchanged.

The HF modules' ``q_proj.weight`` etc. are rebound as row slices (views) of the fused tensors, so every
weight update (``state_dict()[name].copy_``) writes straight into them. ``model.to("meta")`` /
``to_empty`` (memory release and resume) replace the parameters, so the engine binds again after a resume.

Packed weights. A decode step multiplies a few rows (the running requests) by every weight matrix, where
the general matmul is slow on CPU: on a 2-core AVX2 machine a 576 x 1536 fp32 matmul of 1, 4 or 16 rows
runs 1.8x, 2.7x and 1.6x faster against a weight oneDNN has laid out for it in advance
(``torch.ops.mkldnn._reorder_linear_weight``) than through ``F.linear``, when every weight of the model is
streamed from memory in turn as a decode step does; from ~160 rows on they are equal. So on CPU in float32
every linear of the step with at least ``PACK_MIN_ELEMENTS`` weights (the LM head included) reads a packed
copy: one more copy of those weights in memory, made again at the first step after a weight update
(``FastDecoder.stale``, set by the engine's ``load_weights``). The result differs from ``F.linear``'s by
float32 rounding only (kernel order). ``SLIMECORE_ENGINE_PACKED_WEIGHTS=0`` keeps ``F.linear`` (no copy).

Other architectures, sliding-window layers, activations other than SiLU or ``attn_implementation`` other
than sdpa/eager keep HF's forward (``FastDecoder.supports`` says why not); ``SLIMECORE_ENGINE_FAST_DECODE=0``
turns the fast step off. Greedy outputs equal ``model.generate()``'s and the log-probs match the trainer's
forward (both tested).
"""

from __future__ import annotations

import os

import torch
from torch.nn import functional as F

FAMILIES = ("llama", "qwen2", "qwen3")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm/Qwen2RMSNorm/Qwen3RMSNorm, op for op (the variance in float32)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# A packed call costs ~30 us more than F.linear's whatever the size, so small weights stay unpacked: 896 x 896
# gains 1.3x at 16 rows, 1024 x 256 nothing, 128 x 64 loses 3x (2 threads, one weight hot in cache).
PACK_MIN_ELEMENTS = 1 << 19


def _packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN's prepacked linear serves ``weight``: float32 on CPU, in a torch built with oneDNN, and
    large enough to gain."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= PACK_MIN_ELEMENTS
            and torch.backends.mkldnn.is_available() and os.environ.get("SLIMECORE_ENGINE_PACKED_WEIGHTS", "1") != "0")


class _Linear:
    """``F.linear(x, weight, bias)``, through a oneDNN-packed copy of ``weight`` once ``pack`` made one."""

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias, self.packed = weight, bias, None

    def pack(self) -> None:
        """(Re)make the packed copy from the current weight (a layout for up to 64 rows; any count works)."""
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 64) if _packs(self.weight)
                       else None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _fuse(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the modules' weights (and biases) into one tensor each, make every module's parameter a view
    of its rows (still contiguous, so ``state_dict()`` looks as before), and return the fused pair."""
    fused = []
    for attr in ("weight", "bias"):
        if getattr(modules[0], attr) is None:
            fused.append(None)
            continue
        whole, start = torch.cat([getattr(m, attr).detach() for m in modules]), 0
        for m in modules:
            rows = getattr(m, attr).shape[0]
            setattr(m, attr, torch.nn.Parameter(whole[start:start + rows], requires_grad=False))
            start += rows
        fused.append(whole)
    return fused[0], fused[1]


class FastDecoder:
    """One-token decode steps for a Llama/Qwen2/Qwen3 ``*ForCausalLM`` (see the module docstring)."""

    def __init__(self, model):
        self.model = model
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.bind()

    @staticmethod
    def supports(model) -> str | None:
        """None when the fast step serves ``model``, else why HF's forward keeps it."""
        if os.environ.get("SLIMECORE_ENGINE_FAST_DECODE", "1") == "0":
            return "SLIMECORE_ENGINE_FAST_DECODE=0"
        config = model.config
        if config.model_type not in FAMILIES:
            return f"model_type {config.model_type!r} is not one of {FAMILIES}"
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"hidden_act {config.hidden_act!r}"
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            return "sliding-window layers"
        if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
            return f"attn_implementation {config._attn_implementation!r}"
        if getattr(config, "pretraining_tp", 1) != 1:
            return "pretraining_tp > 1"
        return None

    def bind(self) -> None:
        """Fuse q/k/v and gate/up of every layer (the module parameters become views of the fused tensors);
        the packed copies are made at the next step."""
        self.layers = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            self.layers.append((layer.input_layernorm.weight, _Linear(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj])),
                                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                                _Linear(attn.o_proj.weight, attn.o_proj.bias), layer.post_attention_layernorm.weight,
                                _Linear(*_fuse([mlp.gate_proj, mlp.up_proj])),
                                _Linear(mlp.down_proj.weight, mlp.down_proj.bias)))
        head = self.model.lm_head
        self.head = _Linear(head.weight, head.bias)
        self.stale = True  # the packed copies are older than the weights

    def release(self) -> None:
        """Drop every reference to the weights (fused tensors and packed copies): the engine frees them."""
        self.layers, self.head = [], None

    def _pack(self) -> None:
        for linear in [self.head, *(x for layer in self.layers for x in layer if isinstance(x, _Linear))]:
            linear.pack()
        self.stale = False

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """One decode step: ``tokens`` (B,) at ``positions`` (B, 1), ``mask`` (B, L) over the cache plus
        this token, ``cache`` the engine's HF cache (its layers append this token's keys and values).
        Returns the next-token logits (B, V) in float32."""
        if self.stale:
            self._pack()
        model = self.model.model
        batch = tokens.shape[0]
        x = model.embed_tokens(tokens)[:, None, :]  # (B, 1, H)
        cos, sin = model.rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, 1, D): broadcast over heads
        attn_mask = mask.bool()[:, None, None, :]  # (B, 1, 1, L), shared by the query heads of a group
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        group = self.heads // self.kv_heads
        for (ln1, qkv, qn, kn, o_proj, ln2, gate_up, down), layer in zip(self.layers, cache.layers):
            h = _rms(x, ln1, self.eps)
            q, k, v = qkv(h).split((q_size, kv_size, kv_size), dim=-1)
            q = q.view(batch, 1, self.heads, self.head_dim)
            k = k.view(batch, 1, self.kv_heads, self.head_dim)
            if qn is not None:
                q, k = _rms(q, qn, self.eps), _rms(k, kn, self.eps)
            q = _rotate(q.transpose(1, 2), cos, sin)  # (B, Hq, 1, D)
            k = _rotate(k.transpose(1, 2), cos, sin)
            keys, values = layer.update(k, v.view(batch, 1, self.kv_heads, self.head_dim).transpose(1, 2))
            # one query token: the heads of a group become the query rows of their key/value head
            out = F.scaled_dot_product_attention(q.reshape(batch, self.kv_heads, group, self.head_dim), keys,
                                                 values, attn_mask=attn_mask, scale=self.scale)
            x = x + o_proj(out.reshape(batch, 1, q_size))
            gate, up = gate_up(_rms(x, ln2, self.eps)).chunk(2, dim=-1)
            x = x + down(F.silu(gate) * up)
        x = _rms(x[:, -1], model.norm.weight, self.eps)
        return self.head(x).float()

