"""``slime-core convert``: the HF -> torch_dist -> HF round trip through the real command (two processes, each with
the CPU shim: ``shim_cli.py``), and every mismatch it must name before building anything (in this process: these
checks import no Megatron)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from slimecore_cli.main import cli
from slimecore.testing import timeout as scaled

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("megatron.core", "mbridge", "slime_models")),
    reason="needs megatron-core, mbridge and the models plugin (scripts/setup.sh installs them)")

SHIM_CLI = str(Path(__file__).with_name("shim_cli.py"))
# the tiny Qwen2 checkpoint's shape, written as slime's scripts/models/*.sh write MODEL_ARGS
TINY_MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads",
                   "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
                   "--vocab-size", "400", "--rotary-base", "10000", "--norm-epsilon", "1e-6",
                   "--untie-embeddings-and-output-weights", "--add-qkv-bias", "--rotary-percent", "1.0",
                   "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type",
                   "rope"]


def _convert(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, SHIM_CLI, "convert", *args], capture_output=True, text=True, timeout=scaled(240))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _fails(*args: str) -> str:
    result = CliRunner().invoke(cli, ["convert", *args])
    assert result.exit_code == 2, result.output
    return " ".join(result.output.split())  # rich wraps long lines


def test_round_trip_through_the_command_is_exact(tiny_checkpoint, tmp_path):
    import torch
    from safetensors.torch import load_file

    _convert("hf-to-megatron", "--hf-checkpoint", str(tiny_checkpoint), "--save", str(tmp_path / "mcore"),
             *TINY_MODEL_ARGS)
    meta = json.loads((tmp_path / "mcore" / "megatron_checkpoint.json").read_text())
    assert meta["format"] == "torch_dist" and meta["shape"]["num_layers"] == 2 and not meta["optimizer"]
    _convert("megatron-to-hf", "--load", str(tmp_path / "mcore"), "--hf-checkpoint", str(tiny_checkpoint),
             "--output", str(tmp_path / "hf"))
    original, back = load_file(str(tiny_checkpoint / "model.safetensors")), load_file(str(tmp_path / "hf" /
                                                                                             "model.safetensors"))
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (tiny_checkpoint / name).read_bytes()


def test_layer_split_of_slimes_convert_commands_reaches_the_build(tmp_path):
    """slime's DeepSeek-R1 conversion passes --decoder-first/last-pipeline-num-layers (61 layers on 8 stages): they
    reach the model build as in train (Megatron-LM's names for num_layers_in_first/last_pipeline_stage). Three
    layers on two stages, which no even split gives, convert and come back exact."""
    import torch
    from safetensors.torch import load_file

    from slimecore.testing.distributed import run_ranks
    from slimecore.testing.tiny import make_tiny_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import megatron_checks

    hf = make_tiny_checkpoint(tmp_path / "hf", layers=3)
    args = ["--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "1"]
    layers = run_ranks(megatron_checks.convert_split_over_stages, str(hf), str(tmp_path / "mcore"), args, world=2,
                       timeout=scaled(300))
    assert layers == [[1, 2], [3]]
    _convert("megatron-to-hf", "--load", str(tmp_path / "mcore"), "--hf-checkpoint", str(hf), "--output",
             str(tmp_path / "back"))
    original, back = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(original) and all(torch.equal(back[k], original[k]) for k in original)


def test_model_args_that_disagree_with_config_json_are_listed(tiny_checkpoint, tmp_path):
    wrong = [a if a != "64" else "96" for a in TINY_MODEL_ARGS]  # --hidden-size 96
    wrong.remove("--add-qkv-bias")
    out = _fails("hf-to-megatron", "--hf-checkpoint", str(tiny_checkpoint), "--save", str(tmp_path), *wrong)
    assert "nothing was converted" in out
    assert "--hidden-size: MODEL_ARGS 96, config.json 64" in out
    assert "--add-qkv-bias: MODEL_ARGS False, config.json True" in out
    assert not any(tmp_path.iterdir())


def test_a_preset_of_another_model_is_refused_field_by_field(tiny_checkpoint, tmp_path):
    out = _fails("hf-to-megatron", "--hf-checkpoint", str(tiny_checkpoint), "--save", str(tmp_path), "--model",
                 "qwen2.5-0.5B")
    assert "--num-layers: preset qwen2.5-0.5B 24, config.json 2" in out and "--vocab-size" in out
    out = _fails("hf-to-megatron", "--hf-checkpoint", str(tiny_checkpoint), "--save", str(tmp_path), "--model",
                 "qwen9-1T")
    assert "--model 'qwen9-1T' is not a preset" in out and "qwen3-4B" in out


def test_unknown_model_argument(tiny_checkpoint, tmp_path):
    out = _fails("hf-to-megatron", "--hf-checkpoint", str(tiny_checkpoint), "--save", str(tmp_path),
                 "--num-layerz", "2")
    assert out.count("error:") == 1 and "unknown model argument '--num-layerz' (did you mean --num-layers?)" in out
    out = _fails("hf-to-megatron", "--hf-checkpoint", str(tiny_checkpoint), "--save", str(tmp_path),
                 *TINY_MODEL_ARGS, "--kv-lora-rnk", "16")
    assert "unknown model argument '--kv-lora-rnk' (did you mean --kv-lora-rank?)" in out
    out = _fails("hf-to-megatron", "--hf-checkpoint", str(tiny_checkpoint), "--save", str(tmp_path),
                 "--custom-model-provider-path", "my.provider")
    assert "--custom-model-provider-path is not taken: the model is built by a bridge plugin" in out
    assert not any(tmp_path.iterdir())


SLIME_MODELS = Path(__file__).resolve().parents[1] / "slime_format" / "scripts" / "models"


def test_a_slime_model_files_args_as_slimes_converter_takes_them(tmp_path):
    """`source scripts/models/deepseek-v3.sh; convert ${MODEL_ARGS[@]} --hf-checkpoint ... --save ...`: the
    multi-latent-attention, MoE-routing and YaRN flags parse (the parser `train` uses) and agree with config.json,
    so the command goes on to the weights, which this directory (config.json alone) does not have. A disagreeing
    value, or a weight switch the file leaves out, is named with both values."""
    from transformers import DeepseekV3Config

    from slimecore.trainers.megatron_args import source_model_args

    DeepseekV3Config(
        num_hidden_layers=4, hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
        num_key_value_heads=128, vocab_size=129280, rms_norm_eps=1e-6, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, tie_word_embeddings=False, architectures=["DeepseekV3ForCausalLM"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    ).save_pretrained(tmp_path / "hf")
    args = source_model_args(SLIME_MODELS / "deepseek-v3.sh", {"MODEL_ARGS_NUM_LAYERS": "4"})
    assert {"--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-pos-emb-head-dim"} <= set(args)
    paths = ["--hf-checkpoint", str(tmp_path / "hf"), "--save", str(tmp_path / "out")]
    assert "holds no *.safetensors" in _fails("hf-to-megatron", *args, *paths)  # slime's order: MODEL_ARGS first
    out = _fails("hf-to-megatron", *paths, *[a if a != "512" else "256" for a in args if a != "--qk-layernorm"])
    assert "--kv-lora-rank: MODEL_ARGS 256, config.json 512" in out and "--qk-layernorm: MODEL_ARGS False, " \
        "config.json True" in out and "nothing was converted" in out
    assert not (tmp_path / "out").exists()


def test_weights_that_do_not_match_config_json(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    out = _fails("hf-to-megatron", "--hf-checkpoint", str(bad), "--save", str(tmp_path / "out"))
    assert "do not match its config.json" in out and "model.layers.0.mlp.up_proj.weight (128, 64)" in out
    (bad / "config.json").write_text(json.dumps(config))
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.1.extra.weight"] = weights.pop("model.layers.1.self_attn.o_proj.weight")
    save_file(weights, str(bad / "model.safetensors"))
    out = _fails("hf-to-megatron", "--hf-checkpoint", str(bad), "--save", str(tmp_path / "out"))
    assert "missing 1: model.layers.1.self_attn.o_proj.weight" in out and "unexpected 1: model.layers.1.extra" in out


def test_architecture_without_a_bridge(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    out = _fails("hf-to-megatron", "--hf-checkpoint", str(tmp_path), "--save", str(tmp_path / "out"))
    assert "no active plugin answers slime_model_bridge for architectures ['GPT2LMHeadModel']" in out


def test_megatron_checkpoint_onto_another_models_config(tiny_checkpoint, tmp_path):
    from transformers import AutoConfig

    from slime_models.plugin import bridge_for
    from slimecore.config import Config
    from slimecore.testing.tiny import make_tiny_checkpoint
    from slimecore.trainers.megatron_model import write_checkpoint_meta

    saved = tmp_path / "mcore"
    saved.mkdir()  # what hf-to-megatron or a training checkpoint records about its model
    write_checkpoint_meta(saved, bridge_for(AutoConfig.from_pretrained(tiny_checkpoint)), Config.make())
    other = make_tiny_checkpoint(tmp_path / "wider", hidden=96, layers=3)
    out = _fails("megatron-to-hf", "--load", str(saved), "--hf-checkpoint", str(other), "--output",
                 str(tmp_path / "out"))
    assert "saved for a different model than the HF config" in out
    assert "--hidden-size: checkpoint 64, HF config 96" in out and "--num-layers: checkpoint 2, HF config 3" in out
    out = _fails("megatron-to-hf", "--load", str(tmp_path), "--hf-checkpoint", str(other), "--output",
                 str(tmp_path / "out"))
    assert "has no megatron_checkpoint.json" in out


def test_models_command_lists_presets_and_prints_their_flags():
    result = CliRunner().invoke(cli, ["models"])
    assert result.exit_code == 0 and "qwen3-30B-A3B" in result.output and "deepseek-v3" in result.output
    result = CliRunner().invoke(cli, ["models", "--show", "qwen3-30B-A3B"])
    assert result.exit_code == 0
    flags = result.output.split()
    assert flags[flags.index("--num-experts") + 1] == "128" and "--qk-layernorm" in flags
    assert flags[flags.index("--moe-layer-freq") + 1] == "[1]*48"
    result = CliRunner().invoke(cli, ["models", "--show", "gpt5"])
    assert result.exit_code == 2 and "no preset 'gpt5'" in result.output
