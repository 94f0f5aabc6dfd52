"""One rollout's training on one rank, the same for every backend.

``Trainer.train`` pre-computes the inputs the plugins ask for (``slime_train_inputs``: log-probs, entropies,
reference and ``slime_scoring_weights`` log-probs, a value role's old values), calls ``slime_compute_advantages`` and
``slime_rollout_data_postprocess``, then takes one optimizer step per entry of the rank's schedule
(``data["steps"]``, built by the rollout manager: ``slimecore.rollout.schedule``). Each step runs the
backend over the step's micro-batches; for each one it calls ``slime_loss`` with a ``Reducer`` whose shares
add up, over micro-batches and data-parallel ranks, to the step's objective, so the summed gradient is the
exact gradient of that objective whatever the micro-batching and DP split. Metrics are summed over ranks
and averaged over steps. The model itself (forward, backward, optimizer, weights, checkpoints) is the
backend's: ``slimecore.trainers.backend.TrainBackend``.
"""

from __future__ import annotations

import time

import torch

from slimecore.ops.reducers import Reducer, make_sample_mean_reducer, make_token_mean_reducer
from slimecore.routing_replay import records
from slimecore.trainers.backend import REFERENCE, TrainBackend, backend_class
from slimecore.trainers.flops import forward_flops
from slimecore.trainers.roles import role_config

# per-sample lists turned into fp32 tensors before the hooks see the batch
TENSOR_KEYS = ("loss_masks", "rollout_log_probs", "values", "returns")


class Trainer:
    """One data-parallel rank of one training role on the backend ``backend`` (default ``--train-backend``).

    ``hooks`` is the run's ``slimecore.plugins.Hooks``: the step calls its ``slime_train_inputs``,
    ``slime_compute_advantages``, ``slime_rollout_data_postprocess`` and ``slime_loss`` (keyword arguments only). ``options`` go to the backend's
    constructor (the fsdp backend's ``shard`` and ``process_group``). The role's declaration
    (``slimecore.trainers.roles``) says whether it is a value model and which of its own options (``lr``,
    ``hf_checkpoint`` ...) it trains with.
    """

    def __init__(self, config, hooks, rank: int = 0, world_size: int = 1, role: str = "actor",
                 backend: str | None = None, **options):
        spec, config = role_config(config, hooks, role)  # the role's own options (a critic's --critic-lr) applied
        self.config, self.hooks, self.role = config, hooks, role
        self.is_value = spec.model == "value"
        # Taken when the backend is built, before any load(): the reference policy is the initial checkpoint.
        keep_reference = not self.is_value and REFERENCE in hooks.slime_train_inputs(config=config, role=role)
        # {column: checkpoint}: log-prob columns scored under other weights, each kept as a CPU copy by the backend
        self.other_weights = {} if self.is_value else hooks.slime_scoring_weights(config=config, role=role)
        self.backend: TrainBackend = backend_class(backend or config.train_backend)(
            config, hooks, rank=rank, world_size=world_size, value_model=self.is_value, keep_reference=keep_reference,
            other_weights=self.other_weights, **options)
        self.outputs: dict = {}  # per-sample results another role needs (the actor's returns, for the critic)
        # --use-routing-replay (R2): the old-policy pass records the routing that the training steps replay
        self.records_routing = not self.is_value and records(config)
        self._first_log_probs: list | None = None  # the first step's per-sample log-probs (--max-logprob-mismatch)
        self._old_values: dict | None = None

    # -- no-grad passes ------------------------------------------------------------------------------
    def score(self, data: dict, temperature: float, with_entropy: bool = False) -> dict[str, list[torch.Tensor]]:
        """No-grad outputs of every local sample, micro-batched as the steps are, each ``(R_i,)`` on CPU:
        ``{"log_probs": ..., "entropy": ...}`` (entropy only if asked), or a value model's ``{"values": ...}``;
        with ``--use-routing-replay`` the policy's pass adds ``routed_experts``, the routing it recorded (numpy
        ``(T_i - 1, layers, topk)`` each)."""
        n = len(data["tokens"])
        keys = ["values"] if self.is_value else ["log_probs", "entropy"][:1 + with_entropy]
        scored: dict[str, list] = {key: [None] * n for key in keys}

        def keep(mb: list[int], outputs: dict):
            return None, (mb, {k: v if k == "routed_experts" else [x.float().cpu() for x in v]
                               for k, v in outputs.items() if v is not None})

        micro_batches = [mb for step in data["steps"] for mb in step["micro_batches"]]
        for mb, outputs in self.backend.run_micro_batches(data, micro_batches, keep, temperature=temperature,
                                                          with_entropy=with_entropy, train=False):
            for key, values in outputs.items():
                column = scored.setdefault(key, [None] * n)
                for i, value in zip(mb, values):
                    column[i] = value
        return scored

    def compute_log_probs(self, data: dict, temperature: float | None = None) -> list[torch.Tensor]:
        """Current-policy log-probs of every local sample (``(R_i,)`` each, CPU fp32), without gradient."""
        temperature = self.config.rollout_temperature if temperature is None else temperature
        return self.score(data, temperature)["log_probs"]

    def compute_values(self, data: dict) -> dict:
        """The value model's ``{"values": [(R_i,) ...]}`` for every local sample (CPU fp32, no gradient).
        Kept for the ``train`` call on the same data that follows (the old values of the value loss)."""
        if not self.is_value:
            raise RuntimeError(f"role {self.role!r} is not a value model; only the critic computes values")
        self._old_values = {"values": self.score(data, 1.0)["values"]}
        return self._old_values

    # -- one rollout's training ----------------------------------------------------------------------
    def train(self, rollout_id: int, data: dict, update: bool = True) -> dict[str, float]:
        """Pre-compute the requested inputs, call the advantage and post-process hooks, then run one optimizer
        step per ``data["steps"]`` entry (none when ``update`` is False: advantages and returns only).
        ``data`` may carry another role's per-sample results: ``values`` (from the critic) for the actor,
        ``returns`` (from the actor) for the critic, which then skips the advantage hook.
        Returns ``train/*`` metrics (summed over ranks, mean over steps)."""
        config, role = self.config, self.role
        inputs = set(self.hooks.slime_train_inputs(config=config, role=role))
        if self.is_value:  # the old values of the clipped value loss: those just sent to the actor, if any
            old, self._old_values = self._old_values, None
            data = {**data, **(old if old is not None else self.compute_values(data))}
        elif "values" in inputs and data.get("values") is None:
            raise RuntimeError(f"slime_train_inputs asked for 'values' (role {role!r}) but no value model fed them; "
                               f"the plugin that needs values must declare a value role whose scores feed {role!r} "
                               "(slime_train_roles)")
        temperature = config.rollout_temperature
        batch = {k: v for k, v in data.items() if k != "steps"}
        for key in TENSOR_KEYS:
            if batch.get(key) is not None:
                batch[key] = [torch.as_tensor(v, dtype=torch.float32) for v in batch[key]]

        metrics: dict[str, float] = {}
        start = time.perf_counter()
        # R2 needs the old-policy pass, whose routing training replays: run even where the loss would reuse its
        # own forward or the rollout's log-probs (slime's can_reuse_log_probs_in_loss excludes R2); its log-probs
        # are then the old policy's, as in slime
        if "log_probs" in inputs or "entropy" in inputs or self.records_routing:
            scored = self.score(data, temperature, with_entropy="entropy" in inputs)
            if "log_probs" in inputs or self.records_routing:
                batch["log_probs"] = scored["log_probs"]
            if "entropy" in scored:
                batch["entropy"] = scored["entropy"]
            if self.records_routing:
                if data["tokens"] and "routed_experts" not in scored:
                    raise ValueError(f"--use-routing-replay: the {type(self.backend).__name__} backend recorded no "
                                     "routing in the old-policy pass (docs/backends.md)")
                batch["rollout_routed_experts"] = scored.get("routed_experts", [])
        for column in ([REFERENCE] if REFERENCE in inputs else []) + list(self.other_weights):
            with self.backend.reference_weights(column):
                batch[column] = self.score(data, temperature)["log_probs"]
        if inputs & {"log_probs", "entropy", REFERENCE} or self.other_weights or self.records_routing:
            metrics["perf/log_probs_time"] = time.perf_counter() - start
        # The engine/trainer log-prob mismatch is measured on the pre-update policy: on the recomputed
        # log-probs when a plugin asked for them, otherwise on the first optimizer step's own forward
        # (before that step the model is exactly the policy that generated the rollout).
        measure_in_first_step = (not self.is_value and batch.get("rollout_log_probs") is not None
                                 and "log_probs" not in batch)
        if "log_probs" in batch and batch.get("rollout_log_probs") is not None and data["steps"]:
            metrics["train/train_rollout_logprob_abs_diff"] = self._logprob_abs_diff(batch, data["steps"][0])

        if batch.get("returns") is None:
            batch.update(self.hooks.slime_compute_advantages(config=config, role=role, batch=batch))
        self.hooks.slime_rollout_data_postprocess(config=config, rollout_id=rollout_id, batch=batch)
        self.outputs = {"returns": [r.detach().float().cpu() for r in batch["returns"]]}

        steps = data["steps"] if update else []
        start = time.perf_counter()
        bound = config.max_logprob_mismatch
        # --max-logprob-mismatch dumps the per-sample log-probs: kept from the first step's forward when measured there
        self._first_log_probs = [None] * len(batch["tokens"]) if bound is not None and measure_in_first_step else None
        per_step = [self._optimizer_step(batch, step, measure_mismatch=measure_in_first_step and n == 0)
                    for n, step in enumerate(steps)]
        for key in {k for m in per_step for k in m}:
            values = [m[key] for m in per_step if key in m]
            metrics[key] = sum(values) / len(values)
        if steps:
            metrics.update(self._throughput(batch, steps, time.perf_counter() - start))
        mismatch = metrics.get("train/train_rollout_logprob_abs_diff")
        if bound is not None and mismatch is not None and mismatch > bound:
            from slimecore.parity import stop_on_mismatch

            scored = batch["log_probs"] if "log_probs" in batch else self._first_log_probs
            stop_on_mismatch(config, rollout_id, self.backend.rank, mismatch, data,
                             [None if lp is None else lp.detach().float().cpu() for lp in scored])
        return metrics

    def _optimizer_step(self, batch: dict, step: dict, measure_mismatch: bool = False) -> dict[str, float]:
        config = self.config

        def loss(mb: list[int], outputs: dict):
            mb_batch = self._micro_batch(batch, mb)
            reducer = self._reducer(mb_batch, step)
            value, mb_metrics = self.hooks.slime_loss(config=config, role=self.role, batch=mb_batch, outputs=outputs,
                                                      reducer=reducer)
            info = {"loss": value.detach(), **mb_metrics}
            if measure_mismatch:
                diffs = [(lp.detach() - roll).abs() for lp, roll in zip(outputs["log_probs"],
                                                                        mb_batch["rollout_log_probs"])]
                info["train_rollout_logprob_abs_diff"] = reducer(diffs)
                if self._first_log_probs is not None:
                    for i, lp in zip(mb, outputs["log_probs"]):
                        self._first_log_probs[i] = lp.detach().float().cpu()
            return value, {k: float(v) for k, v in info.items()}

        sums: dict[str, float] = {}
        for info in self.backend.run_micro_batches(batch, step["micro_batches"], loss,
                                                   temperature=config.rollout_temperature,
                                                   with_entropy=not self.is_value, train=True):
            for key, value in info.items():
                sums[key] = sums.get(key, 0.0) + value
        grad_norm, lr = self.backend.optimizer_step()
        metrics = {f"train/{k}": v for k, v in self.backend.sum_across_ranks(sums).items()}
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr})
        return metrics

    # -- micro-batches and reducers ------------------------------------------------------------------
    def _micro_batch(self, batch: dict, mb: list[int]) -> dict:
        """Rows ``mb`` of every per-sample list (tensors moved to the device); other values as they are."""
        n, device = len(batch["tokens"]), self.backend.device
        out = {}
        for key, value in batch.items():
            if isinstance(value, list) and len(value) == n:
                out[key] = [value[i].to(device) if isinstance(value[i], torch.Tensor) else value[i] for i in mb]
            else:
                out[key] = value
        return out

    def _reducer(self, mb_batch: dict, step: dict) -> Reducer:
        masks = mb_batch["loss_masks"]
        if self.config.calculate_per_token_loss:
            return make_token_mean_reducer(masks, step["num_tokens"])
        return make_sample_mean_reducer(masks, mb_batch["rollout_mask_sums"], step["num_rollouts"])

    def _logprob_abs_diff(self, batch: dict, step: dict) -> float:
        """``|old log-prob - rollout log-prob|`` reduced like the loss over the first step's samples."""
        local = [i for mb in step["micro_batches"] for i in mb]
        mb_batch = self._micro_batch(batch, local)
        diffs = [(lp - roll).abs() for lp, roll in zip(mb_batch["log_probs"], mb_batch["rollout_log_probs"])]
        share = self._reducer(mb_batch, step)(diffs).detach().float().cpu()
        return self.backend.sum_across_ranks({"d": float(share)})["d"]

    def _throughput(self, batch: dict, steps: list[dict], seconds: float) -> dict[str, float]:
        """Trained tokens per second (all ranks) and model TFLOP/s per rank (``slimecore.trainers.flops``: forward
        + backward = 3 forwards; the recompute of activation checkpointing is not useful work, so not counted)."""
        local = [i for step in steps for mb in step["micro_batches"] for i in mb]
        lengths = [len(batch["tokens"][i]) for i in local]
        scored = sum(batch["response_lengths"][i] for i in local)
        flops = 3 * forward_flops(self.backend.hf_config, lengths, head_tokens=scored,
                                  head_size=1 if self.is_value else None)
        total = self.backend.sum_across_ranks({"tokens": float(sum(lengths)), "flops": flops})
        return {f"perf/{self.role}_train_tok_per_s": total["tokens"] / seconds,
                f"perf/{self.role}_train_tflops": total["flops"] / seconds / self.backend.world_size / 1e12}
