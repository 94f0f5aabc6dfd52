"""The ``fsdp`` training backend: an HF ``AutoModelForCausalLM`` trained with plain torch.

On CPU (the default and the tests) each data-parallel rank holds a full replica and gradients are
summed across ranks with gloo; because the loss reducer already divides by the step's rollout count
(``slimecore.ops.reducers``), the sum is the exact gradient of the step objective regardless of how
samples were split into micro-batches and ranks. On CUDA with several ranks the model is sharded with
FSDP2 (``fully_shard``); that path is small and has not been run on CPU.

Micro-batches are right-padded batches with an attention mask; the response slice of sample i is
logits positions ``[prompt_len - 1, total_len - 1)`` scoring tokens ``[prompt_len, total_len)``.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from slimecore.ops.logprobs import entropy_from_logits, log_probs_from_logits
from slimecore.ops.reducers import make_sample_mean_reducer, make_token_mean_reducer

TENSOR_KEYS = ("loss_masks", "rollout_log_probs")


def lr_lambda(config):
    """Multiplier on --lr for optimizer step ``it``: linear warm-up, then constant / linear / cosine decay."""
    warmup, total, floor = config.lr_warmup_iters, config.train_iters, config.min_lr / config.lr if config.lr else 0.0

    def factor(it: int) -> float:
        if warmup and it < warmup:
            return (it + 1) / warmup
        if config.lr_decay_style == "constant" or not total:
            return 1.0
        progress = min(1.0, (it - warmup) / max(1, total - warmup))
        if config.lr_decay_style == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class FSDPTrainer:
    def __init__(self, config, hooks, rank: int = 0, world_size: int = 1, role: str = "actor"):
        from transformers import AutoModelForCausalLM

        self.config, self.hooks, self.rank, self.world_size, self.role = config, hooks, rank, world_size, role
        dtype = torch.bfloat16 if config.bf16 else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(config.hf_checkpoint, dtype=dtype)
        self.model.config.use_cache = False
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if config.use_lora:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(
                r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=list(config.lora_target_modules),
                lora_dropout=0.0, task_type="CAUSAL_LM"))
        if torch.cuda.is_available():
            self.model.cuda()
            if world_size > 1:
                from torch.distributed.fsdp import fully_shard

                for layer in self.model.base_model.layers if hasattr(self.model.base_model, "layers") else []:
                    fully_shard(layer)
                fully_shard(self.model)
        self.device = next(self.model.parameters()).device
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                           eps=config.adam_eps, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        self._ref_state: dict[str, torch.Tensor] | None = None
        self._sharded = torch.cuda.is_available() and world_size > 1

    # -- forward ---------------------------------------------------------------------------
    def _forward(self, tokens: list[list[int]], response_lengths: list[int], with_entropy: bool):
        """Per-sample response log-probs (and entropy) for one micro-batch. Each 1-D, (response_length,)."""
        longest = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), longest, dtype=torch.long)  # (B, T), right padded
        mask = torch.zeros(len(tokens), longest, dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, :len(t)] = torch.tensor(t)
            mask[i, :len(t)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits  # (B, T, V)
        temperature = self.config.rollout_temperature
        log_probs, entropy = [], []
        for i, (t, r) in enumerate(zip(tokens, response_lengths)):
            start, end = len(t) - r - 1, len(t) - 1
            rows = logits[i, start:end]  # (R, V)
            log_probs.append(log_probs_from_logits(rows, ids[i, start + 1:end + 1].to(self.device), temperature))
            if with_entropy:
                entropy.append(entropy_from_logits(rows, temperature))
        return log_probs, entropy

    @torch.no_grad()
    def compute_log_probs(self, data: dict) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(data["tokens"])
        self.model.eval()
        for step in data["steps"]:
            for mb in step["micro_batches"]:
                if mb:
                    lps, _ = self._forward([data["tokens"][i] for i in mb], [data["response_lengths"][i] for i in mb], False)
                    for i, lp in zip(mb, lps):
                        out[i] = lp.float().cpu()
        return out

    def _ref_log_probs(self, data: dict) -> list[torch.Tensor]:
        """The reference policy = the initial weights, swapped into the same model (no extra process)."""
        current = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(self._ref_state)
        try:
            return self.compute_log_probs(data)
        finally:
            self.model.load_state_dict(current)

    # -- one rollout -------------------------------------------------------------------------
    def train(self, rollout_id: int, data: dict) -> dict[str, float]:
        config, role = self.config, self.role
        if self._ref_state is None:
            self._ref_state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        inputs = self.hooks.train_inputs(config=config, role=role)
        batch = {k: v for k, v in data.items() if k != "steps"}
        for key in TENSOR_KEYS:
            if key in batch:
                batch[key] = [torch.tensor(v, dtype=torch.float32) for v in batch[key]]
        metrics: dict[str, float] = {}
        if "log_probs" in inputs or "rollout_log_probs" in batch:
            batch["log_probs"] = self.compute_log_probs(data)
        if "ref_log_probs" in inputs:
            batch["ref_log_probs"] = self._ref_log_probs(data)
        if "rollout_log_probs" in batch:
            diffs = [((lp - rl).abs() * m).sum() / m.sum().clamp(min=1)
                     for lp, rl, m in zip(batch["log_probs"], batch["rollout_log_probs"], batch["loss_masks"])]
            stats = self._sum_across_ranks(torch.tensor([float(sum(diffs)), float(len(diffs))]))
            metrics["train/train_rollout_logprob_abs_diff"] = (stats[0] / stats[1].clamp(min=1)).item()
        batch.update(self.hooks.compute_advantages(config=config, role=role, batch=batch))
        self.hooks.rollout_data_postprocess(config=config, rollout_id=rollout_id, batch=batch)

        step_metrics: list[dict[str, float]] = []
        self.model.train()
        for step in data["steps"]:
            step_metrics.append(self._optimizer_step(batch, step, inputs))
        for key in step_metrics[0] if step_metrics else []:
            metrics[key] = sum(m[key] for m in step_metrics) / len(step_metrics)
        return metrics

    def _optimizer_step(self, batch: dict, step: dict, inputs: set[str]) -> dict[str, float]:
        config = self.config
        self.optimizer.zero_grad(set_to_none=False)
        sums: dict[str, torch.Tensor] = {}
        for mb in step["micro_batches"]:
            if not mb:
                continue  # an empty micro-batch contributes nothing; the all-reduce below still runs
            mb_batch = {k: [v[i] for i in mb] for k, v in batch.items() if isinstance(v, list) and len(v) == len(batch["tokens"])}
            log_probs, entropy = self._forward(mb_batch["tokens"], mb_batch["response_lengths"], True)
            masks = [m.to(self.device) for m in mb_batch["loss_masks"]]
            if config.calculate_per_token_loss:
                reducer = make_token_mean_reducer(masks, step["num_tokens"])
            else:
                reducer = make_sample_mean_reducer(masks, mb_batch["rollout_mask_sums"], step["num_rollouts"])
            outputs = {"log_probs": log_probs, "entropy": entropy}
            loss, mb_metrics = self.hooks.loss(config=config, role=self.role, batch=mb_batch, outputs=outputs,
                                               reducer=reducer)
            loss.backward()
            for key, value in {"loss": loss, **mb_metrics}.items():
                sums[key] = sums.get(key, torch.zeros(())) + value.detach().float().cpu()
        self._all_reduce_grads()
        if config.clip_grad > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, config.clip_grad)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.params]))
        self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        reduced = self._reduce_metrics(sums)
        reduced.update({"train/grad_norm": float(grad_norm), "train/lr": lr})
        return reduced

    # -- collectives -------------------------------------------------------------------------
    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_initialized()

    def _sum_across_ranks(self, t: torch.Tensor) -> torch.Tensor:
        if self._distributed():
            dist.all_reduce(t)
        return t

    def _all_reduce_grads(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not self._distributed() or self._sharded:
            return  # FSDP2 reduces gradients itself
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat)
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def _reduce_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sum each metric's shares across ranks; ranks with only empty micro-batches report no keys."""
        if self._distributed():
            gathered: list[dict] = [None] * self.world_size
            dist.all_gather_object(gathered, {k: float(v) for k, v in sums.items()})
            keys = sorted({k for g in gathered for k in g})
            return {f"train/{k}": sum(g.get(k, 0.0) for g in gathered) for k in keys}
        return {f"train/{k}": float(v) for k, v in sums.items()}

    # -- weights and checkpoints ---------------------------------------------------------------
    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full HF-named weights on CPU (LoRA adapters merged) for the engines."""
        model = self.model
        if self.config.use_lora:
            model.merge_adapter()
            try:
                state = {k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v.detach().cpu().clone()
                         for k, v in model.state_dict().items() if "lora_" not in k}
            finally:
                model.unmerge_adapter()
            return state
        return {k: v.detach().cpu().float().clone().contiguous() if self.config.bf16 else v.detach().cpu().clone()
                for k, v in model.state_dict().items()}

    def save(self, directory: str) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self.model.save_pretrained(path / "model", safe_serialization=True)
            if not self.config.no_save_optim:
                torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                            "ref_state": self._ref_state}, path / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
                   path / f"rng_{self.rank}.pt")

    def load(self, directory: str) -> None:
        from safetensors.torch import load_file

        path = Path(directory)
        files = sorted((path / "model").glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path / 'model'} holds no *.safetensors; is this a slime-core checkpoint?")
        state = {}
        for file in files:
            state.update(load_file(str(file)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        real_missing = [k for k in missing if not (k == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if real_missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing {real_missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        if (path / "optimizer.pt").is_file():
            saved = torch.load(path / "optimizer.pt", weights_only=False)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.scheduler.load_state_dict(saved["scheduler"])
            self._ref_state = saved["ref_state"]
        rng_file = path / f"rng_{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
