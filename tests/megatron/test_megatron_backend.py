"""The megatron training backend on CPU: megatron-core 0.16 and mbridge under the test shim (``cpu_shim.py``), each
check in fresh spawned processes (``megatron_checks.py``; the shim and Megatron's parallel state are per process).

- TP = 1, for tiny Qwen2 and Llama: packed logits and log-probs (temperature 0.7) equal HF's and the fsdp
  backend's within 1e-5 (fp32); HF -> Megatron -> HF export is exact; one real GRPO step (KL loss, entropy bonus,
  three packed micro-batches) gives fsdp's loss and gradient norm; a torch_dist checkpoint resumes to the bit.
  Also Qwen3, tied-embedding Qwen2, Llama with llama3 RoPE scaling, GLM-4.5 MoE and the GLM-4.6 kind (q/k norms,
  routed scaling, group-limited routing): logits and export; and
  ``--bf16`` on both backends (bf16 weights with fp32 main params against fsdp's autocast): within bf16 rounding.
- Two gloo ranks: TP = 2, DP = 2 with the distributed optimizer, and PP = 2 with full activation recompute
  agree with fsdp on one process; a
  TP = 2 checkpoint's weights load into the DP = 2 layout; the distributed optimizer's state resumes.
- Tiny Qwen3-MoE with EP = 2: log-probs equal HF's, the GRPO step equals fsdp's, and the conversion round trip is
  exact.
The start-up checks and the packing need no Megatron and run in the test process.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from slimecore.config import Config
from slimecore.testing.distributed import run_ranks

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("megatron.core", "mbridge", "slime_grpo", "slime_models")),
    reason="needs megatron-core, mbridge and the grpo and models plugins (scripts/setup.sh installs them)")

import megatron_checks as checks  # noqa: E402  (no megatron import at module level)
from slimecore.testing import timeout as scaled

TOL = 1e-5
STEP_KEYS = ("train/loss", "train/pg_loss", "train/kl_loss", "train/entropy_loss", "train/grad_norm")


def _same_step(actual: dict, expected: dict) -> None:
    for key in STEP_KEYS:
        assert actual[key] == pytest.approx(expected[key], rel=TOL, abs=TOL), key


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from slimecore.testing.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", arch="llama")


# Checked in the Llama test's process: Megatron logits against HF's and the exported weights. 2e-6 because the
# llama3 RoPE check must be sharp: without scaling the logits differ by 1.6e-5, with mbridge's linear
# interpolation by 5e-3 (measured when this test was written).
MORE_ARCHITECTURES = ("qwen3", "qwen2-tied", "llama3-rope", "glm4.5-moe", "glm4.6-moe")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tp1_matches_hf_and_fsdp_exports_exactly_and_resumes(arch, tiny_checkpoint, tiny_llama, tmp_path):
    checkpoint = tiny_checkpoint if arch == "qwen2" else tiny_llama
    more = MORE_ARCHITECTURES if arch == "llama" else ()
    [r] = run_ranks(checks.single_process, str(checkpoint), str(tmp_path / "ckpt"), more, arch == "qwen2", world=1,
                    timeout=scaled(300))
    assert r["logits_vs_hf"] < TOL and r["log_probs_vs_hf"] < TOL
    assert r["log_probs_vs_fsdp"] < TOL and r["entropy_vs_fsdp"] < TOL
    assert r["export_names_equal"] and r["export_exact"]
    assert r["buckets_cover_export"] and len(r["bucket_bytes"]) > 1  # 64 KiB buckets; a bigger tensor goes alone
    assert all(size <= 64 << 10 or n == 1 for size, n in zip(r["bucket_bytes"], r["bucket_tensors"]))
    _same_step(r["megatron_step"], r["fsdp_step"])
    assert r["megatron_step"]["train/grad_norm"] > 0.1  # a real gradient, compared to 1e-5
    assert r["weights_vs_fsdp"] < 1e-4  # after one AdamW step of lr 1e-3
    # resume: same second step to the bit; the LR warm-up position (step 2 of 3) came back too
    assert r["resumed_iteration"] == 1 and r["resumed_weights_equal"]
    assert r["resumed"]["train/lr"] == r["continued"]["train/lr"] == pytest.approx(2e-3 / 3)
    for key in STEP_KEYS:
        assert r["resumed"][key] == r["continued"][key], key
    assert r["files"] == ["megatron_checkpoint.json", "rng_rank0.pt", "torch_dist"]
    if arch == "qwen2":  # --bf16 on both backends: bf16 rounding apart, the same numbers
        bf16 = r["bf16"]
        assert bf16["weight_dtype"] == "torch.bfloat16"
        assert bf16["mean_abs_diff"] < 5e-3 and bf16["max_abs_diff"] < 3e-2, bf16
        for key in ("train/loss", "train/grad_norm"):
            assert bf16["megatron_step"][key] == pytest.approx(bf16["fsdp_step"][key], rel=1e-3, abs=1e-4), key
    for name in more:
        assert r["architectures"][name].get("logits_vs_hf", 1.0) < 2e-6, (name, r["architectures"][name])
        assert r["architectures"][name]["export_exact"], name


def test_tp2_dp2_and_pp2_with_recompute_agree_with_one_process(tiny_checkpoint, tmp_path):
    layouts = [{"tensor_model_parallel_size": 2}, {"use_distributed_optimizer": True},
               {"pipeline_model_parallel_size": 2, "recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}]
    r0, r1 = run_ranks(checks.grpo_step_layouts, str(tiny_checkpoint), layouts, str(tmp_path), world=2, timeout=scaled(300))
    tp2, dp2, pp2 = r0["layouts"]
    assert [(x["tp_size"], x["pp_size"], x["dp_size"]) for x in (tp2, dp2, pp2)] == [(2, 1, 1), (1, 1, 2), (1, 2, 1)]
    for layout in (tp2, dp2, pp2):
        assert layout["log_probs_vs_fsdp"] < TOL
        _same_step(layout["metrics"], r0["fsdp"])
        assert layout["weights_vs_fsdp"] < 1e-4
    assert r1["layouts"][0]["metrics"]["train/loss"] == tp2["metrics"]["train/loss"]  # reduced on every rank
    assert dp2["resharded_vs_saved"] == 0.0  # TP = 2 weights loaded into TP = 1, DP = 2
    assert dp2["resumed_iteration"] == 1 and dp2["resumed_vs_saved"] == 0.0


def test_qwen3_moe_with_expert_parallelism(tmp_path):
    r0, _ = run_ranks(checks.moe_converts_and_matches_hf, str(tmp_path), world=2, timeout=scaled(300))
    assert r0["norm1_log_probs_vs_hf"] < TOL and r0["norm0_log_probs_vs_hf"] < TOL
    _same_step(r0["megatron"], r0["fsdp"])
    assert r0["round_trip_names_equal"] and r0["round_trip_exact"] and r0["tensors"] == 45


def test_segment_attention_equals_megatrons_masked_attention():
    """The per-sample attention of a packed stream gives megatron-core's own masked local attention's output."""
    [r] = run_ranks(checks.segment_attention_vs_mask, world=1, timeout=scaled(300))
    assert r["swapped"] and r["max_diff"] < TOL


def test_cuda_paths_equal_the_paths_they_replace_with_tp2(tiny_checkpoint):
    """Two CUDA defaults, run on the CPU with TP = 2: the chunked output layer (hidden states out, the
    vocab-parallel head in chunks with the logits recomputed in backward) against the model's logits, and packed
    ``thd`` streams through per-sample attention (no (T, T) mask; the default on a GPU without Transformer Engine)
    against the block-diagonal mask: log-probs, entropies and a GRPO step within fp32 1e-6 (chunked head) and
    1e-5 (attention), the weights after one AdamW step within 1e-5."""
    r0, r1 = run_ranks(checks.cuda_paths_on_cpu, str(tiny_checkpoint), world=2, timeout=scaled(300))
    assert r0["grad_norm"] > 0.1
    for name, tol in (("chunked", 1e-6), ("segments", TOL)):
        for r in (r0, r1):
            assert r[name]["log_probs"] < tol and r[name]["entropy"] < tol, (name, r[name])
        assert all(v < tol for v in r0[name]["metrics"].values()), (name, r0[name]["metrics"])
        assert r0[name]["weights"] < 1e-5, name  # one AdamW step of lr 1e-3: m / sqrt(v) magnifies rounding


def test_trainers_and_the_throughput_benchmark_run_without_ray(tiny_checkpoint):
    """A GPU machine with torch alone: both backends train through benchmarks/train_throughput.py while
    ``import ray`` fails (megatron_model -> checkpoint imported Ray before), and the weight sender imports and
    starts there (slimecore.engines.launch imported Ray before)."""
    [r] = run_ranks(checks.throughput_without_ray, str(tiny_checkpoint), world=1, timeout=scaled(300))
    assert r["ray_before"] == [] and r["ray_after"] == [] and r["weight_sender"] > 0
    for backend in ("fsdp", "megatron"):
        assert r[backend]["perf/actor_train_tok_per_s"] > 0 and r[backend]["train/loss"] == r[backend]["train/loss"]


# -- no Megatron needed ----------------------------------------------------------------------------------


def test_packing_marks_sample_boundaries_and_response_rows():
    from slimecore.trainers.megatron import pack

    packed = pack([[5, 6, 7, 8], [9, 10, 11]], [2, 1], "mask", multiple=4, device=torch.device("cpu"))
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 0]]  # padded to a multiple of the TP size
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    allowed = ~packed.attention_mask[0, 0]  # True where attention is allowed
    assert allowed[3].tolist() == [True] * 4 + [False] * 4  # causal inside sample 1
    assert allowed[6].tolist() == [False] * 4 + [True] * 3 + [False]  # sample 2 sees only itself
    assert allowed[7].tolist() == [False] * 7 + [True]  # padding is its own segment
    assert packed.rows.tolist() == [1, 2, 5] and packed.targets.tolist() == [7, 8, 11]
    empty = pack([], [], "mask", multiple=2, device=torch.device("cpu"))
    assert empty.input_ids.tolist() == [[0, 0]] and empty.rows.numel() == 0


def test_data_parallel_rank_follows_megatrons_order():
    from slimecore.trainers.megatron import data_parallel_rank

    config = Config.make(tensor_model_parallel_size=2)
    assert [data_parallel_rank(config, r, 4) for r in range(4)] == [0, 0, 1, 1]
    config = Config.make(pipeline_model_parallel_size=2)
    assert [data_parallel_rank(config, r, 4) for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize("flags, world, message", [
    ({"tensor_model_parallel_size": 2}, 3, "not divisible by --tensor-model-parallel-size"),
    ({"context_parallel_size": 2}, 2, "--context-parallel-size > 1 is not supported"),
    ({"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2}, 2, "--expert-model-parallel-size 2 must"),
    ({"sequence_parallel": True}, 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    ({"use_lora": True}, 1, "--use-lora is an fsdp-backend feature"),
    ({"gradient_checkpointing": True}, 1, "--recompute-granularity full"),
    ({"recompute_granularity": "full"}, 1, "needs --recompute-method"),
])
def test_options_the_backend_cannot_run_are_named(flags, world, message):
    from slimecore.trainers.megatron import MegatronSetupError, check_config

    with pytest.raises(MegatronSetupError, match=message):
        check_config(Config.make(**flags), world)


def test_cli_refuses_what_megatron_cannot_run_before_ray_starts(tiny_checkpoint):
    from click.testing import CliRunner

    from slimecore_cli.main import cli

    # no bridge plugin named: the installed models plugin joins (as slime's scripts expect), and the backend's
    # start-up check still refuses what it cannot run before Ray starts
    args = ["train", "--plugin", "grpo", "--train-backend", "megatron", "--hf-checkpoint", str(tiny_checkpoint),
            "--rollout-batch-size", "2", "--context-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "--context-parallel-size > 1 is not supported" in result.output
    assert "models 0.1.0 [entry point]" in result.output and "Ray" not in result.output
    assert result.output.count("grpo 0.1.0 [entry point]") == 1  # the plugin the command names, loaded once


def test_critic_role_is_refused_at_startup(tiny_checkpoint):
    from slimecore import hookimpl
    from slimecore.plugins import load_plugins
    from slimecore.trainers.megatron import MegatronSetupError, check_startup

    class WantsCritic:
        @hookimpl
        def slime_train_roles(self, config):
            return ["critic"]

    hooks = load_plugins(["models"], extra=[WantsCritic()])
    with pytest.raises(MegatronSetupError, match="value models run on the fsdp backend"):
        check_startup(Config.make(hf_checkpoint=str(tiny_checkpoint), train_backend="megatron"), hooks)


def test_throughput_benchmark_counts_the_same_tokens_and_flops_on_both_backends(tiny_checkpoint):
    """benchmarks/train_throughput.py, as a GPU run would call it: TP = 2 megatron counts each trained token once
    (one data-parallel replica), as fsdp's DP = 2 does, so tokens/s per TFLOP/s per device is the same."""
    fsdp = run_ranks(checks.throughput_benchmark, str(tiny_checkpoint), "fsdp", [], timeout=scaled(300))
    megatron = run_ranks(checks.throughput_benchmark, str(tiny_checkpoint), "megatron",
                         ["--tensor-model-parallel-size", "2"], timeout=scaled(300))
    ratio = [r["perf/actor_train_tok_per_s"] / r["perf/actor_train_tflops"] for r in fsdp + megatron]
    assert ratio == pytest.approx([ratio[0]] * 4, rel=1e-9)
    [one] = run_ranks(checks.throughput_benchmark, str(tiny_checkpoint), "megatron", [], True, world=1, timeout=scaled(300))
    assert one["logprob_abs_diff_max"] < 1e-5  # fp32 on the CPU: the same weights give the same log-probs


# -- GPU (not run in this project's CI: no CUDA there) -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_log_probs_close_to_fsdp(tiny_checkpoint):
    [r] = run_ranks(checks.gpu_bf16_log_probs, str(tiny_checkpoint), world=1, timeout=scaled(300))
    assert r["mean_abs_diff"] < 2e-2 and r["max_abs_diff"] < 0.25  # bf16 rounding, different kernels
    for key in STEP_KEYS:  # fp32 on the GPU: other kernels (cuBLAS, TE), so not the CPU's 1e-5
        assert r["megatron_fp32_step"][key] == pytest.approx(r["fsdp_fp32_step"][key], rel=1e-4, abs=1e-4), key
