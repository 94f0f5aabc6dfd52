"""Per-rank bodies of the megatron tests. Each runs in a fresh spawned process (``run_ranks``), installs the CPU
shim first and returns plain numbers for the test to assert on. Kept apart from the test modules so that pytest
never imports megatron-core in its own process."""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _setup():
    sys.path.insert(0, str(HERE))
    import cpu_shim

    cpu_shim.install()


def synthetic_batch(n: int = 8, seed: int = 0, vocab: int = 390) -> dict:
    """Rollout columns as the manager makes them: two fan-out rollouts of two samples, then singles; partial loss
    masks; rewards in [-1, 1]; engine log-probs."""
    rng = random.Random(seed)
    data = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_rewards", "rollout_ids",
                            "sample_indices", "truncated", "rollout_log_probs")}
    for i in range(n):
        prompt, response = rng.randint(2, 9), rng.randint(1, 7)
        data["tokens"].append([rng.randint(3, vocab - 1) for _ in range(prompt + response)])
        data["response_lengths"].append(response)
        data["loss_masks"].append([rng.choice([0, 1, 1]) for _ in range(response)])
        data["rewards"].append(rng.uniform(-1, 1))
        data["raw_rewards"].append(0.0)
        data["rollout_ids"].append(i // 2 if i < 4 else i)
        data["sample_indices"].append(i)
        data["truncated"].append(0)
        data["rollout_log_probs"].append([rng.uniform(-8, -1) for _ in range(response)])
    return data


def rank_part(data: dict, dp_size: int, dp_rank: int, micro_batch_size: int | None = 3,
              max_tokens: int | None = None) -> dict:
    from slimecore.rollout.schedule import build_dp_schedule, split_for_ranks

    rollouts = len(set(data["rollout_ids"]))
    schedule = build_dp_schedule(data["rollout_ids"], [len(t) for t in data["tokens"]], rollouts, dp_size,
                                 micro_batch_size, max_tokens)
    return split_for_ranks(copy.deepcopy(data), schedule)[dp_rank]


def grpo_config(checkpoint: str, **core):
    """A run's config with the real grpo plugin (KL loss and an entropy bonus on, so ref log-probs and the entropy
    gradient are exercised) and the models plugin for the bridge."""
    from slimecore.config import Config
    from slimecore.plugins import load_plugins

    defaults = {o.name: o.default for o in load_plugins(["grpo"]).slime_options()["grpo"]}
    grpo = defaults | {"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k3", "entropy_coef": 0.01,
                       "eps_clip_high": 0.28}
    data_rollouts = len(set(synthetic_batch()["rollout_ids"]))
    values = {"hf_checkpoint": str(checkpoint), "lr": 1e-3, "rollout_temperature": 0.7,
              "rollout_batch_size": data_rollouts, "global_batch_size": data_rollouts} | core
    return Config.make(plugins=["grpo", "models"], plugin_values={"grpo": grpo}, **values)


def _hooks():
    from slimecore.plugins import load_plugins

    return load_plugins(["grpo", "models"])


def _max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


def hf_response_log_probs(checkpoint: str, data: dict, temperature: float):
    """Reference: each sample alone through the HF model, scored by ``slimecore.ops``."""
    import torch
    from transformers import AutoModelForCausalLM

    from slimecore.ops import per_sample_response_log_probs

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out, logits = [], []
    with torch.no_grad():
        for seq, r in zip(data["tokens"], data["response_lengths"]):
            step = model(input_ids=torch.tensor([seq])).logits
            logits.append(step[0])
            out.append(per_sample_response_log_probs(step, [seq], [r], temperature)[0][0])
    return out, logits


# ---------------------------------------------------------------------------------------------------
def single_process(rank: int, world: int, checkpoint: str, save_dir: str, more_architectures: tuple = (),
                   bf16: bool = False) -> dict:
    """TP = PP = DP = 1. Packed Megatron logits and log-probs against HF and the fsdp backend; HF -> Megatron -> HF
    export; one GRPO step against fsdp; then save (torch_dist), a second step, and a fresh trainer that loads the
    checkpoint and takes the same second step (model, Adam moments, LR-schedule position and RNG restored).
    ``more_architectures`` (``tiny_hf_configs`` names) are then checked in the same process (``other_architectures``);
    with ``bf16``, both backends run ``--bf16`` too (Megatron: bf16 weights, fp32 main params; fsdp: autocast)."""
    _setup()
    import torch
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from safetensors.torch import load_file

    from slimecore.trainers.trainer import Trainer

    config = grpo_config(checkpoint, lr_warmup_iters=3)
    hooks = _hooks()
    data = rank_part(synthetic_batch(), 1, 0)
    torch.manual_seed(0)
    fsdp = Trainer(config, hooks, backend="fsdp")
    trainer = Trainer(config, hooks, rank=rank, world_size=world, backend="megatron")
    packed = trainer.backend._pack(data["tokens"], data["response_lengths"])
    with torch.no_grad():
        stream = trainer.backend.chunks[0](input_ids=packed.input_ids, position_ids=packed.position_ids,
                                   attention_mask=packed.attention_mask)[0]  # (T, V/tp)
    stream = gather_from_tensor_model_parallel_region(stream)  # (T, V)
    hf_log_probs, hf_logits = hf_response_log_probs(checkpoint, data, config.rollout_temperature)
    offsets = [0]
    for seq in data["tokens"]:
        offsets.append(offsets[-1] + len(seq))
    megatron_scored = trainer.score(data, config.rollout_temperature, with_entropy=True)
    megatron_log_probs, megatron_entropy = megatron_scored["log_probs"], megatron_scored["entropy"]
    fsdp_scored = fsdp.score(data, config.rollout_temperature, with_entropy=True)
    fsdp_log_probs, fsdp_entropy = fsdp_scored["log_probs"], fsdp_scored["entropy"]
    exported = trainer.backend.named_weights()
    buckets = list(trainer.backend.hf_weight_buckets(bucket_bytes=64 << 10))  # what a bucketed engine sync sends
    original = load_file(str(Path(checkpoint) / "model.safetensors"))
    out = {"logits_vs_hf": max(float((stream[a:b] - ref).abs().max())
                               for a, b, ref in zip(offsets, offsets[1:], hf_logits)),
           "log_probs_vs_hf": _max_diff(megatron_log_probs, hf_log_probs),
           "log_probs_vs_fsdp": _max_diff(megatron_log_probs, fsdp_log_probs),
           "entropy_vs_fsdp": _max_diff(megatron_entropy, fsdp_entropy),
           "export_names_equal": set(exported) == set(original),
           "export_exact": all(torch.equal(exported[k], original[k]) for k in original),
           "bucket_bytes": [sum(t.numel() * t.element_size() for _, t in b) for b in buckets],
           "bucket_tensors": [len(b) for b in buckets],
           "buckets_cover_export": sorted(n for b in buckets for n, _ in b) == sorted(exported)}

    second = rank_part(synthetic_batch(seed=2), 1, 0)
    out["fsdp_step"] = fsdp.train(0, copy.deepcopy(data))
    out["megatron_step"] = trainer.train(0, copy.deepcopy(data))
    fsdp_weights, weights = fsdp.backend.named_weights(), trainer.backend.named_weights()
    names = sorted(weights)
    out["weights_vs_fsdp"] = _max_diff([weights[k] for k in names], [fsdp_weights[k] for k in names])
    trainer.backend.save(save_dir)
    out["continued"] = trainer.train(1, copy.deepcopy(second))
    continued_weights = trainer.backend.named_weights()
    del trainer
    resumed = Trainer(config, hooks, rank=rank, world_size=world, backend="megatron")
    resumed.backend.load(save_dir)
    out["resumed_iteration"] = resumed.backend.iteration
    out["resumed"] = resumed.train(1, copy.deepcopy(second))
    resumed_weights = resumed.backend.named_weights()
    out["resumed_weights_equal"] = all(torch.equal(continued_weights[k], resumed_weights[k]) for k in continued_weights)
    out["files"] = sorted(p.name for p in Path(save_dir).iterdir())
    if bf16:
        config = grpo_config(checkpoint, bf16=True)
        trainer = Trainer(config, hooks, rank=rank, world_size=world, backend="megatron")
        fsdp = Trainer(config, hooks, backend="fsdp")
        pairs = zip(trainer.compute_log_probs(data), fsdp.compute_log_probs(data))
        diffs = torch.cat([(a - b).abs() for a, b in pairs])
        out["bf16"] = {"mean_abs_diff": float(diffs.mean()), "max_abs_diff": float(diffs.max()),
                       "megatron_step": trainer.train(0, copy.deepcopy(data)),
                       "fsdp_step": fsdp.train(0, copy.deepcopy(data)),
                       "weight_dtype": str(next(iter(trainer.backend.named_weights().values())).dtype)}
    if more_architectures:
        out["architectures"] = other_architectures(rank, world, f"{save_dir}-archs", list(more_architectures))
    return out


def grpo_step_layouts(rank: int, world: int, checkpoint: str, layouts: list[dict], save_dir: str) -> dict:
    """One GRPO optimizer step (packed micro-batches of up to 3 samples) under each Megatron layout in turn,
    against the fsdp backend on one process (rank 0): log-probs, metrics and the weights after the step.
    Checkpoints: the first layout saves after its step; the second loads those weights (``--no-save-optim``:
    another TP layout), then after its own step saves with its optimizer and a fresh trainer of the same layout
    loads it back."""
    _setup()
    import torch
    from megatron.core import parallel_state

    from slimecore.trainers.megatron import data_parallel_rank, model_parallel_size
    from slimecore.trainers.trainer import Trainer

    data = synthetic_batch()
    hooks = _hooks()
    out: dict = {"layouts": []}
    if rank == 0:
        torch.manual_seed(0)
        fsdp = Trainer(grpo_config(checkpoint), hooks, backend="fsdp")
        whole = rank_part(data, 1, 0)
        fsdp_log_probs = dict(zip(whole["sample_indices"], fsdp.compute_log_probs(whole)))
        out["fsdp"] = {k: v for k, v in fsdp.train(0, whole).items() if k.startswith("train/")}
        fsdp_weights = fsdp.backend.named_weights()
        del fsdp

    def compare(weights, reference):
        return _max_diff([weights[k] for k in sorted(reference)], [reference[k] for k in sorted(reference)])

    saved = None
    for n, layout in enumerate(layouts):
        config = grpo_config(checkpoint, **layout)
        part = rank_part(data, world // model_parallel_size(config), data_parallel_rank(config, rank, world))
        entry = {}
        if n == 1:  # the first layout's weights, resharded
            loader = Trainer(grpo_config(checkpoint, no_save_optim=True, **layout), hooks, rank=rank,
                             world_size=world, backend="megatron")
            loader.backend.load(f"{save_dir}/first")
            weights = loader.backend.named_weights()
            if rank == 0:
                entry["resharded_vs_saved"] = compare(weights, saved)
            del loader
        trainer = Trainer(config, hooks, rank=rank, world_size=world, backend="megatron")
        entry.update(dp_size=parallel_state.get_data_parallel_world_size(),
                     tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                     pp_size=parallel_state.get_pipeline_model_parallel_world_size())
        log_probs = trainer.compute_log_probs(part)
        if rank == 0:  # this rank's samples (all of them with TP = 2, half with DP = 2)
            entry["log_probs_vs_fsdp"] = _max_diff(log_probs, [fsdp_log_probs[i] for i in part["sample_indices"]])
        entry["metrics"] = {k: v for k, v in trainer.train(0, part).items() if k.startswith("train/")}
        weights = trainer.backend.named_weights()
        if rank == 0:
            entry["weights_vs_fsdp"] = compare(weights, fsdp_weights)
        if n == 0:
            trainer.backend.save(f"{save_dir}/first")
            saved = weights
        if n == 1:  # optimizer state too, same layout
            trainer.backend.save(f"{save_dir}/second")
            del trainer
            resumed = Trainer(config, hooks, rank=rank, world_size=world, backend="megatron")
            resumed.backend.load(f"{save_dir}/second")
            entry["resumed_iteration"] = resumed.backend.iteration
            again = resumed.backend.named_weights()
            if rank == 0:
                entry["resumed_vs_saved"] = compare(again, weights)
        out["layouts"].append(entry)
    return out


def make_tiny_qwen3_moe(directory: str, norm_topk_prob: bool = True) -> str:
    """A random tiny Qwen3-MoE checkpoint (4 experts, top-2, 2 layers) and the tiny tokenizer, built locally."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from slimecore.testing.tiny import build_tokenizer

    path = Path(directory)
    if (path / "config.json").is_file():
        return str(path)
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=norm_topk_prob,
                            tie_word_embeddings=False, max_position_embeddings=512,
                            architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # random routers, so that different tokens pick different experts
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def moe_converts_and_matches_hf(rank: int, world: int, directory: str) -> dict:
    """Tiny Qwen3-MoE with expert parallelism = ``world``: Megatron log-probs equal HF's for both router variants
    (``norm_topk_prob`` on and off); one GRPO step (DP = ``world``) equals the fsdp backend's on one process;
    HF -> torch_dist -> HF through ``slimecore.convert`` is exact (experts split over the EP ranks and gathered)."""
    _setup()
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from slimecore.convert import hf_to_megatron, megatron_to_hf
    from slimecore.trainers.megatron import data_parallel_rank
    from slimecore.trainers.trainer import Trainer

    hooks = _hooks()
    out: dict = {}
    data = synthetic_batch()
    for norm in (True, False):
        checkpoint = f"{directory}/qwen3moe-norm{int(norm)}"
        if rank == 0:
            make_tiny_qwen3_moe(checkpoint, norm_topk_prob=norm)
        dist.barrier()
        config = grpo_config(checkpoint, expert_model_parallel_size=world)
        part = rank_part(data, world, data_parallel_rank(config, rank, world))
        trainer = Trainer(config, hooks, rank=rank, world_size=world, backend="megatron")
        hf_log_probs, _ = hf_response_log_probs(checkpoint, part, config.rollout_temperature)
        out[f"norm{int(norm)}_log_probs_vs_hf"] = _max_diff(trainer.compute_log_probs(part), hf_log_probs)
        if norm:
            if rank == 0:
                out["fsdp"] = Trainer(config, hooks, backend="fsdp").train(0, rank_part(data, 1, 0))
            out["megatron"] = trainer.train(0, part)
        del trainer
    checkpoint = f"{directory}/qwen3moe-norm1"
    hf_to_megatron(checkpoint, f"{directory}/torch_dist", hooks, tp=1, ep=world)
    megatron_to_hf(f"{directory}/torch_dist", checkpoint, f"{directory}/back", hooks)
    if rank == 0:
        original = load_file(f"{checkpoint}/model.safetensors")
        back = load_file(f"{directory}/back/model.safetensors")
        out.update(round_trip_names_equal=set(original) == set(back),
                   round_trip_exact=all(torch.equal(original[k], back[k]) for k in original), tensors=len(original))
    return out


def gpu_bf16_log_probs(rank: int, world: int, checkpoint: str) -> dict:
    """On CUDA (no shim; Transformer Engine's THD attention when installed): the megatron backend in bf16 against
    the fsdp backend in bf16 (autocast), log-probs of the same samples; and one fp32 GRPO step against fsdp."""
    import torch
    import torch.distributed as dist

    from slimecore.trainers.trainer import Trainer

    dist.destroy_process_group()  # run_ranks made a gloo group; the backend makes its own NCCL one
    hooks = _hooks()
    data = rank_part(synthetic_batch(), 1, 0)
    config = grpo_config(checkpoint, bf16=True)
    megatron = Trainer(config, hooks, backend="megatron").compute_log_probs(data)
    fsdp = Trainer(config, hooks, backend="fsdp").compute_log_probs(data)
    diffs = torch.cat([(a.float() - b.float()).abs() for a, b in zip(megatron, fsdp)])
    out = {"mean_abs_diff": float(diffs.mean()), "max_abs_diff": float(diffs.max())}
    config = grpo_config(checkpoint)
    out["fsdp_fp32_step"] = Trainer(config, hooks, backend="fsdp").train(0, copy.deepcopy(data))
    out["megatron_fp32_step"] = Trainer(config, hooks, backend="megatron").train(0, copy.deepcopy(data))
    return out


TINY_SHAPES = dict(vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def tiny_hf_configs() -> dict:
    """Small random configs of the other architectures the models plugin bridges (transformers config classes)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig, LlamaConfig, Qwen2Config, Qwen3Config

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    return {
        "qwen3": Qwen3Config(**TINY_SHAPES, head_dim=16, architectures=["Qwen3ForCausalLM"]),
        "qwen2-tied": Qwen2Config(**{**TINY_SHAPES, "tie_word_embeddings": True}, architectures=["Qwen2ForCausalLM"]),
        "llama3-rope": LlamaConfig(**TINY_SHAPES, rope_parameters=rope, architectures=["LlamaForCausalLM"]),
        "glm4.5-moe": Glm4MoeConfig(**TINY_SHAPES, head_dim=16, n_routed_experts=4, n_shared_experts=1,
                                    num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                    partial_rotary_factor=0.5, attention_bias=True,
                                    architectures=["Glm4MoeForCausalLM"]),
        # GLM-4.5-355B / 4.6 / 4.7: q/k norms, routed experts scaled by 2.5, group-limited routing
        "glm4.6-moe": Glm4MoeConfig(**TINY_SHAPES, head_dim=16, n_routed_experts=4, n_shared_experts=1,
                                    num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                                    partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                                    routed_scaling_factor=2.5, n_group=2, topk_group=1,
                                    architectures=["Glm4MoeForCausalLM"]),
        "deepseek-v3": DeepseekV3Config(**{**TINY_SHAPES, "num_key_value_heads": 4}, n_routed_experts=4,
                                        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
                                        topk_group=1, architectures=["DeepseekV3ForCausalLM"]),
    }


def other_architectures(rank: int, world: int, directory: str, names: list[str]) -> dict:
    """Random tiny HF checkpoints of ``names`` (``tiny_hf_configs``): packed Megatron logits against HF's, and the
    exported weights against the checkpoint. Returns per name the differences, or the error it raised."""
    _setup()
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from slimecore.config import Config
    from slimecore.testing.tiny import build_tokenizer
    from slimecore.trainers.megatron import pack
    from slimecore.trainers.megatron_model import BridgedModel, init_parallel

    hooks = _hooks()
    tokenizer = build_tokenizer()
    data = synthetic_batch(n=4)
    out = {}
    for name in names:
        path = Path(directory) / name
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_hf_configs()[name]).to(torch.float32).eval()
        with torch.no_grad():  # random routers (and their score bias): experts are actually chosen by the tokens
            for pname, p in model.named_parameters():
                if pname.endswith("mlp.gate.weight"):
                    p.normal_(0, 1.0)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        try:
            config = Config.make(hf_checkpoint=str(path))
            init_parallel(config, rank, world)
            built = BridgedModel.build(config, hooks, str(path))
            packed = pack(data["tokens"], data["response_lengths"], built.runtime.packing, 1, torch.device("cpu"))
            with torch.no_grad():
                stream = built.chunks[0](input_ids=packed.input_ids, position_ids=packed.position_ids,
                                   attention_mask=packed.attention_mask)[0]
                offsets, diff = 0, 0.0
                for seq in data["tokens"]:
                    ref = model(input_ids=torch.tensor([seq])).logits[0]
                    diff = max(diff, float((stream[offsets:offsets + len(seq)] - ref).abs().max()))
                    offsets += len(seq)
            exported = dict(built.runtime.export_hf_weights(built.chunks))
            original = load_file(str(path / "model.safetensors"))
            out[name] = {"logits_vs_hf": diff, "export_exact": set(exported) == set(original) and all(
                torch.equal(exported[k], original[k]) for k in original)}
        except Exception as exc:  # reported per architecture: the test names which one failed and how
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:800]}
    return out


def throughput_benchmark(rank: int, world: int, checkpoint: str, backend: str, train_argv: list[str],
                         compare: bool = False) -> dict:
    """``benchmarks/train_throughput.py``'s measurement on this rank, as a GPU run would make it."""
    import importlib.util

    _setup()
    path = HERE.parents[1] / "benchmarks" / "train_throughput.py"
    spec = importlib.util.spec_from_file_location("train_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args, train_argv = bench.parse_args(["--backend", backend, "--samples", "8", "--group", "4", "--prompt-len", "5",
                                         "--response-len", "7", "--steps", "2", "--warmup", "1",
                                         *(["--compare-fsdp"] if compare else []), "--", *train_argv])
    args.hf_checkpoint, args.shape = checkpoint, "tiny"
    return bench.measure(args, train_argv)["summary"]


class _NoRay:
    """A meta-path finder that refuses ``ray`` and its submodules, as on a machine without Ray."""

    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name} is blocked: a trainer-only path must not import Ray")
        return None


def throughput_without_ray(rank: int, world: int, checkpoint: str) -> dict:
    """``benchmarks/train_throughput.py`` on both backends in a process where ``import ray`` fails, and train
    rank 0's weight sender (its ``Endpoint`` comes from ``slimecore.engines.launch``) made and closed there."""
    import sys

    already = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
    sys.meta_path.insert(0, _NoRay())
    out = {"ray_before": already}
    for backend in ("fsdp", "megatron"):
        out[backend] = throughput_benchmark(rank, world, checkpoint, backend, [])
    from slimecore.trainers.weight_sender import WeightSender

    sender = WeightSender()
    out["weight_sender"] = sender.bucket_bytes
    sender.close()
    out["ray_after"] = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
    return out



def cuda_paths_on_cpu(rank: int, world: int, checkpoint: str) -> dict:
    """The CUDA defaults against the paths they replace, with TP = ``world``: the chunked output layer (hidden
    states out, ``ops.linear_logprobs`` over the vocab-parallel weight) and the per-sample attention of packed
    ``thd`` streams without Transformer Engine, each against the model's logits and the block-diagonal mask
    path: log-probs, entropies, one GRPO step's metrics and the weights after it (largest differences)."""
    _setup()
    from slimecore.trainers.trainer import Trainer

    data = rank_part(synthetic_batch(), 1, 0)
    config = grpo_config(checkpoint, tensor_model_parallel_size=world)
    runs = {}
    for name, chunk, packing in (("mask", 0, "mask"), ("chunked", 4, "mask"), ("segments", 0, "thd")):
        trainer = Trainer(config, _hooks(), rank=rank, world_size=world, backend="megatron")
        cores = {type(m).__name__ for chunk_ in trainer.backend.chunks for m in chunk_.modules()}
        assert "SegmentAttention" in cores and "DotProductAttention" not in cores  # ready for thd streams
        trainer.backend.head_chunk, trainer.backend.packing = chunk, packing
        log_probs = trainer.compute_log_probs(data)
        outputs = trainer.backend.run_micro_batches(
            data, [list(range(len(data["tokens"])))], lambda mb, out: (None, out), temperature=0.7,
            with_entropy=True, train=False)[0]
        metrics = trainer.train(0, copy.deepcopy(data))
        runs[name] = (log_probs, outputs["entropy"], metrics, trainer.backend.named_weights())
        del trainer
    lp0, ent0, m0, w0 = runs["mask"]
    out = {"grad_norm": m0["train/grad_norm"]}
    for name in ("chunked", "segments"):
        lp, ent, m, w = runs[name]
        out[name] = {"log_probs": _max_diff(lp, lp0), "entropy": _max_diff(ent, ent0),
                     "metrics": {k: abs(m[k] - m0[k]) for k in m0 if k.startswith("train/")},
                     "weights": _max_diff([w[k] for k in sorted(w0)], [w0[k] for k in sorted(w0)]) if rank == 0
                     else None}
    return out


def segment_attention_vs_mask(rank: int, world: int) -> dict:
    """megatron-core's local ``DotProductAttention`` (grouped-query, causal) on a packed stream of three samples:
    its masked forward with the block-diagonal mask against the same module turned into ``SegmentAttention`` and
    fed the ``thd`` stream (largest difference)."""
    _setup()
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from slimecore.trainers.megatron import pack
    from slimecore.trainers.megatron_model import per_segment_attention

    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               masked_softmax_fusion=False, attention_dropout=0.0, use_cpu_initialization=True)
    core = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    swapped = per_segment_attention([torch.nn.Sequential(core)])
    tokens = [[1] * 5, [2] * 4, [3] * 6]
    masked = pack(tokens, [1, 1, 1], "mask", 1, torch.device("cpu"))
    packed = pack(tokens, [1, 1, 1], "thd", 1, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(15, 1, heads, 8, generator=g) for heads in (4, 2, 2))  # (T, b, heads, d)
    want = core(q, k, v, masked.attention_mask)  # (T, 1, 32)
    got = core(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=packed.packed_seq_params)
    return {"swapped": swapped and type(core).__name__ == "SegmentAttention",
            "max_diff": float((got.reshape(want.shape) - want).abs().max())}


def convert_split_over_stages(rank: int, world: int, hf_dir: str, save: str, model_args: list[str]) -> list[int]:
    """``slime-core convert hf-to-megatron`` on ``world`` pipeline stages with ``model_args`` (which may split the
    layers unevenly); returns the global numbers of the decoder layers this rank built."""
    _setup()
    import megatron.core.transformer.transformer_block as block

    from slimecore.convert import hf_to_megatron
    from slimecore.plugins import load_plugins

    built: list[int] = []
    original = block.TransformerBlock._build_layers

    def record(self):
        original(self)
        built.extend(layer.layer_number for layer in self.layers)

    block.TransformerBlock._build_layers = record
    hf_to_megatron(hf_dir, save, load_plugins(["models"]), model_args=model_args, pp=world)
    return built
