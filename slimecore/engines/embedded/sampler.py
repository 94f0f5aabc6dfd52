"""The embedded engine's sampler: each row's next token, its log-prob, and whether the row stops there.

Log-probs: for each sampled token, ``log_softmax(logits / T)`` over the full vocabulary (T = 1 for
greedy), without top-p/top-k/min-p renormalisation, exactly as SGLang returns them. Padding is masked
out, so this equals the log-prob from a single *unpadded* forward of prompt + response, which is what
the trainer computes: the two agree to float32 rounding (tested < 1e-4). Only logit adjustments a
request asks for (penalties, ``logit_bias``, the stop-token ban before ``min_new_tokens``) are applied
before the softmax, as SGLang does; the trainer cannot reproduce those.

:class:`Sampler` is the part of :class:`~slimecore.engines.embedded.server.EmbeddedServer` that draws (with
the server's ``generator``) and stops rows (``context_len``, the tokenizer for stop strings).
"""

from __future__ import annotations

import re

import torch

from slimecore.engines.embedded.request import ABORTED, Request


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (B, V), non-negative and not necessarily normalised, drawn with
    probability ``probs / probs.sum()`` by inverting the row's cumulative sum at the row's number of
    ``uniform`` (B, 1), in [0, 1].
    ``torch.multinomial`` draws one exponential number per token of the vocabulary (18 ms for 16 rows of a 49k
    vocabulary on one core here, against ~1 ms for this). A token of probability 0 is never drawn: the search
    takes the first index whose cumulative sum exceeds the point, and a point that rounds up to the total
    takes the last token of positive probability."""
    cdf = probs.cumsum(-1)  # (B, V)
    total = cdf[:, -1:].contiguous()
    point = uniform.to(cdf.dtype) * total
    return torch.minimum(torch.searchsorted(cdf, point, right=True), torch.searchsorted(cdf, total)).squeeze(1)


_MASK64 = (1 << 64) - 1


def _seeded_uniform(seed: int, position: int) -> float:
    """A number in [0, 1) that depends on ``(seed, position)`` only: splitmix64's finaliser of both, 53 bits.
    Counter-based (no state), as SGLang's seeded sampler hashes (seed, position), so a seeded request draws
    the same tokens whichever engine, batch or arrival order serves it."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / (1 << 53)


class Sampler:
    """Sample one token per row and decide whether each row is finished."""

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[int]:
        """One token per row; records its log-prob, ``log_softmax(logits / T)`` over the full vocabulary.

        The softmax and the draw run batched; rows with top-k/top-p/min-p draw one by one. A row with a
        ``sampling_seed`` draws at a number that depends only on its seed and the token's position
        (:func:`_seeded_uniform`), so its tokens do not depend on the batch it shares or the order requests came
        in; other rows draw from the engine's generator."""
        for i, req in enumerate(reqs):
            if req.adjusts_logits:
                self._adjust_logits(req, logits[i])
        temps = torch.tensor([r.params["temperature"] for r in reqs], dtype=logits.dtype)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)  # (B, V)
        tokens = logp.argmax(dim=-1)  # greedy rows (top_k 1) keep this
        drawn = [i for i, r in enumerate(reqs) if r.params["top_k"] != 1]
        uniform = self._uniform([reqs[i] for i in drawn])  # (len(drawn), 1)
        plain = [k for k, i in enumerate(drawn) if not reqs[i].draws_alone]
        if plain:
            tokens[[drawn[k] for k in plain]] = _draw(logp[[drawn[k] for k in plain]].exp(), uniform[plain])
        for k, i in enumerate(drawn):
            if reqs[i].draws_alone:
                tokens[i] = int(_draw(self._filtered_probs(logp[i], reqs[i].params)[None], uniform[k:k + 1]))
        picked = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
        for req, value in zip(reqs, picked):
            req.logprobs.append(value)
        return tokens.tolist()

    def _uniform(self, reqs: list[Request]) -> torch.Tensor:
        """One number in [0, 1] per row (len(reqs), 1): counter-based for a seeded row, else the generator's."""
        seeds = [r.params["sampling_seed"] for r in reqs]
        unseeded = iter(torch.rand(sum(s is None for s in seeds), generator=self.generator, dtype=torch.float64)
                        .tolist())
        return torch.tensor([[next(unseeded) if s is None else _seeded_uniform(s, len(r.input_ids) + len(r.output_ids))]
                             for r, s in zip(reqs, seeds)], dtype=torch.float64).reshape(len(reqs), 1)

    @staticmethod
    def _adjust_logits(req: Request, logits: torch.Tensor) -> None:
        """Penalties over the generated tokens, logit_bias, and no stop token before min_new_tokens."""
        p = req.params
        if req.output_ids and (p["frequency_penalty"] or p["presence_penalty"] or p["repetition_penalty"] != 1.0):
            ids, counts = torch.tensor(req.output_ids).unique(return_counts=True)
            seen = logits[ids]
            seen = torch.where(seen > 0, seen / p["repetition_penalty"], seen * p["repetition_penalty"])
            logits[ids] = seen - p["frequency_penalty"] * counts - p["presence_penalty"]
        for token, bias in (p["logit_bias"] or {}).items():
            logits[int(token)] += float(bias)
        if len(req.output_ids) < p["min_new_tokens"] and req.stop_ids:
            logits[list(req.stop_ids)] = float("-inf")

    @staticmethod
    def _filtered_probs(logp: torch.Tensor, p: dict) -> torch.Tensor:
        """Top-k, then top-p, then min-p over the probabilities; ``_draw`` renormalises."""
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

    def _advance(self, req: Request, token: int) -> None:
        """Append the token and decide whether the request is finished, in SGLang's order: abort,
        max_new_tokens, stop string/regex (wins over a stop token in the same step), stop token, context."""
        req.output_ids.append(token)
        p, n = req.params, len(req.output_ids)
        if req.aborted:
            self._finish(req, ABORTED)
        elif p["max_new_tokens"] is not None and n >= p["max_new_tokens"]:
            self._finish(req, {"type": "length", "length": p["max_new_tokens"]})
        elif (matched := self._matched_stop_text(req)) is not None:
            self._finish(req, {"type": "stop", "matched": matched})
        elif token in req.stop_ids:
            self._finish(req, {"type": "stop", "matched": token})
        elif len(req.input_ids) + n >= self.context_len:  # like SGLang's clamp to the context length
            self._finish(req, {"type": "length", "length": n})

    def _matched_stop_text(self, req: Request) -> str | None:
        p = req.params
        if p["stop"]:
            # a stop string can only complete in the newest tokens: decode a window, not the whole output
            window = max(len(s) for s in p["stop"]) + 2
            tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=p["skip_special_tokens"])
            for stop in p["stop"]:
                if stop in tail:
                    return stop
        if p["stop_regex"]:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p["skip_special_tokens"])
            for pattern in p["stop_regex"]:
                if re.search(pattern, text):
                    return pattern
        return None
