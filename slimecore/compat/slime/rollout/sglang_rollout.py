"""slime-core shim of what custom generate functions use from ``slime.rollout.sglang_rollout``:
``GenerateState(args)`` (one per process: ``tokenizer``, ``sampling_params``, ``semaphore``), ``generate`` (slime's
default single-turn generate: token ids in, ``/generate`` on the router, tokens and log-probs appended) and
``get_model_url``. slime's rollout loop itself is slime-core's built-in rollout."""

from __future__ import annotations

import asyncio
from typing import Any

from slimecore.types import Sample
from slime.utils.http_utils import post


class GenerateState:
    _instance: "GenerateState | None" = None

    def __new__(cls, args):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._setup(args)
        return cls._instance

    def _setup(self, args) -> None:
        from slimecore.hf_checkpoint import load_tokenizer
        from slimecore.rollout.groups import concurrency

        self.args = args
        self.tokenizer = load_tokenizer(args.hf_checkpoint)
        self.processor = None
        self.semaphore = asyncio.Semaphore(concurrency(args))
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop=args.rollout_stop,
            stop_token_ids=args.rollout_stop_token_ids, skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True, spaces_between_special_tokens=False)
        self.aborted = False


def get_model_url(args, model_name: str = "", endpoint: str = "/generate") -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


async def generate(args, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's default generate, for custom generate functions that call it."""
    state = GenerateState(args)
    prompt_ids = sample.tokens or state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    sampling_params = dict(sampling_params)
    sampling_params["max_new_tokens"] -= sample.response_length
    if sampling_params["max_new_tokens"] <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload = {"input_ids": prompt_ids, "sampling_params": sampling_params, "return_logprob": True}
    if args.use_rollout_routing_replay:  # as slime: the engine returns each token's routed experts
        payload["return_routed_experts"] = True
    output = await post(get_model_url(args), payload)
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    entries = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(args, tokens=[e[1] for e in entries], log_probs=[e[0] for e in entries],
                                  trainable=True, meta_info=output["meta_info"], text=output["text"])
    if args.use_rollout_routing_replay:
        from slimecore.routing_replay import checkpoint_shape, decode

        sample.rollout_routed_experts = decode(output["meta_info"], len(sample.tokens),
                                               checkpoint_shape(args.hf_checkpoint), sample.rollout_routed_experts)
    return sample


__all__ = ["GenerateState", "generate", "get_model_url"]
