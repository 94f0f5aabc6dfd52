"""Bridges read from HF configs built locally (transformers config classes, no download)."""

import types
from pathlib import Path

import pytest
from transformers import (AutoConfig, DeepseekV3Config, Glm4Config, Glm4MoeConfig, LlamaConfig, Qwen2Config,
                          Qwen3Config, Qwen3MoeConfig)

from slime_models.plugin import PRESETS, bridge_for
from slime_models.plugin import SLIME_MODEL_FILES as SLIME_FILE_OF
from slimecore.config import Config, ConfigError, parse_config
from slimecore.convert import model_args_differences, parse_model_args
from slimecore.trainers.megatron_args import check_against_hf, source_model_args
from slimecore.plugins import installed_entry_points, load_plugins


def _rope(theta, **extra):
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **extra}}


# HF config of the model each preset describes (the shape fields of its config.json).
HF_CONFIGS = {
    "qwen2.5-0.5B": lambda: Qwen2Config(
        num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=True, **_rope(1e6)),
    "qwen3-4B": lambda: Qwen3Config(
        num_hidden_layers=36, hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=True, **_rope(1e6)),
    "qwen3-30B-A3B": lambda: Qwen3MoeConfig(
        num_hidden_layers=48, hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, **_rope(1e6)),
    "llama3.1-8B": lambda: LlamaConfig(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "glm4-9B": lambda: Glm4Config(
        num_hidden_layers=40, hidden_size=4096, intermediate_size=13696, num_attention_heads=32, num_key_value_heads=2,
        head_dim=128, vocab_size=151552, rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False,
        **_rope(1e4, partial_rotary_factor=0.5)),
    "glm4.5-106B-A12B": lambda: Glm4MoeConfig(
        num_hidden_layers=46, hidden_size=4096, intermediate_size=10944, num_attention_heads=96, num_key_value_heads=8,
        head_dim=128, vocab_size=151552, rms_norm_eps=1e-5, attention_bias=True, use_qk_norm=False,
        n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=1408,
        first_k_dense_replace=1, tie_word_embeddings=False, **_rope(1e6, partial_rotary_factor=0.5)),
    "deepseek-v3": lambda: DeepseekV3Config(
        num_hidden_layers=61, hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
        num_key_value_heads=128, vocab_size=129280, rms_norm_eps=1e-6, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=163840,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
    "qwen2.5-7B": lambda: Qwen2Config(
        num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
        vocab_size=152064, rms_norm_eps=1e-6, tie_word_embeddings=False, **_rope(1e6)),
    "qwen3-8B": lambda: Qwen3Config(
        num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=False, **_rope(1e6)),
    # GLM-4.5 (355B-A32B); GLM-4.6 and GLM-4.7 have this config.json shape too (max_position_embeddings 202752)
    "glm4.5-355B-A32B": lambda: Glm4MoeConfig(
        num_hidden_layers=92, hidden_size=5120, intermediate_size=12288, num_attention_heads=96, num_key_value_heads=8,
        head_dim=128, vocab_size=151552, rms_norm_eps=1e-5, attention_bias=True, use_qk_norm=True,
        n_routed_experts=160, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=1536,
        first_k_dense_replace=3, routed_scaling_factor=2.5, n_group=1, topk_group=1, tie_word_embeddings=False,
        max_position_embeddings=202752, **_rope(1e6, partial_rotary_factor=0.5)),
    "kimi-k2": lambda: DeepseekV3Config(
        num_hidden_layers=61, hidden_size=7168, intermediate_size=18432, num_attention_heads=64,
        num_key_value_heads=64, vocab_size=163840, rms_norm_eps=1e-6, n_routed_experts=384, n_shared_experts=1,
        num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5e4, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
    "moonlight-16B-A3B": lambda: DeepseekV3Config(
        num_hidden_layers=27, hidden_size=2048, intermediate_size=11264, num_attention_heads=16,
        num_key_value_heads=16, vocab_size=163840, rms_norm_eps=1e-5, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, moe_intermediate_size=1408, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.446, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, tie_word_embeddings=False, max_position_embeddings=8192, **_rope(5e4)),
    "llama3.1-70B": lambda: LlamaConfig(
        num_hidden_layers=80, hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
        vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
# presets of one shape share the config (models/plugin.py PRESETS: same architecture and size)
SAME_SHAPE = {"glm4.6-355B-A32B": "glm4.5-355B-A32B", "glm4.7-355B-A32B": "glm4.5-355B-A32B",
              "deepseek-v3.1": "deepseek-v3", "deepseek-r1": "deepseek-v3", "glm-z1-9B": "glm4-9B"}


def test_every_preset_has_its_hf_config_checked():
    assert set(PRESETS) == set(HF_CONFIGS) | set(SAME_SHAPE)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_bridge_of_the_hf_config_equals_the_slime_preset(name):
    hf = HF_CONFIGS[name]()
    hf.architectures = [PRESETS[name].architecture]
    assert bridge_for(hf) == PRESETS[name]


def test_tiny_qwen2_through_the_hook():
    hooks = load_plugins(["models"])
    tiny = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                       architectures=["Qwen2ForCausalLM"])
    bridge = hooks.slime_model_bridge(config=Config.make(), hf_config=tiny)
    assert (bridge.num_layers, bridge.hidden_size, bridge.ffn_hidden_size, bridge.vocab_size) == (2, 64, 96, 128)
    assert (bridge.num_query_groups, bridge.kv_channels) == (2, 16)  # head dim = 64 / 4
    assert bridge.add_qkv_bias and not bridge.qk_layernorm and not bridge.untie_embeddings_and_output_weights
    assert bridge.num_experts is None and bridge.moe_layer_freq is None and bridge.q_lora_rank is None


def test_qwen3_moe_dense_layers_follow_sparse_step_and_mlp_only_layers():
    tiny = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                          num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=8, decoder_sparse_step=2, mlp_only_layers=[3],
                          architectures=["Qwen3MoeForCausalLM"])
    assert bridge_for(tiny).moe_layer_freq == (0, 1, 0, 0)


def test_transformers_4_style_config_attributes():
    """4.x configs carry ``rope_theta`` / ``partial_rotary_factor`` as attributes, without ``rope_parameters``."""
    hf = types.SimpleNamespace(architectures=["Glm4ForCausalLM"], num_hidden_layers=1, hidden_size=8,
                               intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                               vocab_size=10, rope_theta=1e4, partial_rotary_factor=0.5, rms_norm_eps=1e-5,
                               tie_word_embeddings=False, attention_bias=True)
    bridge = bridge_for(hf)
    assert (bridge.rotary_base, bridge.rotary_percent, bridge.rotary_scaling_factor) == (1e4, 0.5, None)


def test_unknown_or_missing_architecture_is_none():
    hooks = load_plugins(["models"])
    for hf in (types.SimpleNamespace(architectures=["GPT2LMHeadModel"]), types.SimpleNamespace(architectures=None),
               types.SimpleNamespace()):
        assert hooks.slime_model_bridge(config=Config.make(), hf_config=hf) is None


def test_discovered_by_entry_point():
    assert "models" in installed_entry_points()
    hooks = load_plugins(["models"])
    hooks.check(skip_required=["slime_compute_advantages", "slime_loss"])
    assert hooks.plugin_name(hooks.implementers("slime_model_bridge")[0]) == "models"


# -- the Megatron side (slime_models.megatron): checks that need no megatron-core ------------------------------


def test_megatron_args_spell_the_shape_as_slime_scripts_do():
    args = PRESETS["glm4.5-106B-A12B"].megatron_args()
    value = {args[i]: args[i + 1] for i in range(len(args) - 1) if not args[i + 1].startswith("--")}
    assert value["--num-layers"] == "46" and value["--num-query-groups"] == "8"
    assert value["--moe-layer-freq"] == "[0]*1+[1]*45" and value["--rotary-percent"] == "0.5"
    assert {"--add-qkv-bias", "--untie-embeddings-and-output-weights", "--group-query-attention",
            "--swiglu"} <= set(args)
    assert "--qk-layernorm" not in args and "--multi-latent-attention" not in args


def test_bridge_refuses_an_hf_config_of_another_shape():
    tiny = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ValueError, match="--num-layers: given 24, HF config 2.*--hidden-size: given 896, HF config 64"):
        PRESETS["qwen2.5-0.5B"].megatron(tiny)


def test_architectures_without_a_megatron_build_say_so():
    glm4 = Glm4Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, architectures=["Glm4ForCausalLM"])
    with pytest.raises(NotImplementedError, match="Glm4ForCausalLM: no HF<->Megatron weight mapping.*fsdp"):
        bridge_for(glm4).megatron(glm4)
    import torch

    if not torch.cuda.is_available():
        deepseek = HF_CONFIGS["deepseek-v3"]()
        deepseek.architectures = ["DeepseekV3ForCausalLM"]
        with pytest.raises(NotImplementedError, match="needs Transformer Engine and CUDA"):
            bridge_for(deepseek).megatron(deepseek)


def test_rope_scaling_is_mapped_or_refused():
    from slime_models.megatron import _rope_args

    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert _rope_args("LlamaForCausalLM", llama3) == {"rope_scaling": True, "rope_scaling_factor": 8.0}
    assert _rope_args("LlamaForCausalLM", {"rope_type": "linear", "factor": 2.0}) == {
        "seq_len_interpolation_factor": 2.0}
    assert _rope_args("Qwen2ForCausalLM", {"rope_type": "default", "rope_theta": 1e6}) == {}
    with pytest.raises(NotImplementedError, match="high_freq_factor.*implements only"):
        _rope_args("LlamaForCausalLM", {**llama3, "high_freq_factor": 2.0})
    with pytest.raises(NotImplementedError, match="RoPE type 'yarn'"):
        _rope_args("Qwen3ForCausalLM", {"rope_type": "yarn", "factor": 4.0})


def test_group_limited_routing_reaches_megatron_or_is_refused():
    """HF's n_group / topk_group (mbridge passes neither): megatron-core's group-limited routing where both rank a
    group alike (by its top-2 scores: DeepSeek V3 keeps 4 of 8 groups for 8 experts), refused where they do not."""
    import dataclasses

    from slime_models.megatron import _group_routing

    deepseek = PRESETS["deepseek-v3"]
    assert _group_routing(deepseek) == {"moe_router_num_groups": 8, "moe_router_group_topk": 4}
    assert _group_routing(PRESETS["glm4.6-355B-A32B"]) == {} == _group_routing(PRESETS["qwen3-4B"])  # one group
    with pytest.raises(NotImplementedError, match="sum of its top-2 expert scores, megatron-core by its top-3"):
        _group_routing(dataclasses.replace(deepseek, moe_router_topk=6, moe_router_group_topk=2))


# -- slime's model files (scripts/models/*.sh of THUDM/slime, kept in tests/slime_format) against checkpoints -------

SLIME_MODEL_FILES = Path(__file__).resolve().parents[3] / "tests" / "slime_format" / "scripts" / "models"
# slime model file -> the preset of the checkpoint it describes (env: what the file reads, for a shorter model)
MODEL_FILES = {file.removesuffix(".sh"): (preset, {}) for preset, file in SLIME_FILE_OF.items() if preset in HF_CONFIGS}
MODEL_FILES["deepseek-v3"] = ("deepseek-v3", {"MODEL_ARGS_NUM_LAYERS": "4"})


def _checkpoint(tmp_path, preset: str, **changes) -> Path:
    """A checkpoint directory with the preset's config.json (the check reads no weights)."""
    hf = HF_CONFIGS[preset]()
    values = {**hf.to_dict(), **changes, "architectures": [PRESETS[preset].architecture]}
    values.pop("layer_types", None)  # derived from num_hidden_layers
    type(hf).from_dict(values).save_pretrained(tmp_path)
    return tmp_path


def _check(path: Path, backend: str, args: list[str]) -> None:
    hf = AutoConfig.from_pretrained(path)
    config = parse_config(["--rollout-batch-size", "2", "--hf-checkpoint", str(path), "--train-backend", backend,
                           *args], [], {})
    check_against_hf(config, hf, bridge_for(hf))


@pytest.mark.parametrize("name", sorted(MODEL_FILES))
def test_slime_model_file_agrees_with_its_checkpoint(name, tmp_path):
    """Every Megatron flag of the file is read and compared with what the bridge reads from config.json."""
    preset, env = MODEL_FILES[name]
    layers = int(env.get("MODEL_ARGS_NUM_LAYERS", 0)) or PRESETS[preset].num_layers
    first_dense = PRESETS[preset].moe_layer_freq.index(1) if PRESETS[preset].moe_layer_freq else 0
    path = _checkpoint(tmp_path, preset, num_hidden_layers=layers, **(
        {"first_k_dense_replace": first_dense} if first_dense else {}))
    args = source_model_args(SLIME_MODEL_FILES / f"{name}.sh", env)
    _check(path, "megatron", args)
    hf = AutoConfig.from_pretrained(path)  # and as `slime-core convert hf-to-megatron` reads them, with the
    assert model_args_differences(parse_model_args(args), hf, bridge_for(hf)) == []  # switches it leaves out
    values = PRESETS[preset].megatron_values()
    if name in ("qwen2.5-0.5B", "qwen3-4B", "llama3.1-8B-Instruct"):  # they describe the model only: fsdp too
        _check(path, "fsdp", args)
    assert {"num_layers", "hidden_size", "layernorm_epsilon", "rotary_base"} <= set(values)


def test_a_model_file_that_disagrees_names_both_values(tmp_path):
    deepseek = _checkpoint(tmp_path / "deepseek", "deepseek-v3", num_hidden_layers=4)
    with pytest.raises(ConfigError, match=r"--num-layers 61 disagrees with .*bridge's num_layers from config.json "
                                          r"is 4"):
        _check(deepseek, "megatron", source_model_args(SLIME_MODEL_FILES / "deepseek-v3.sh"))
    glm4 = source_model_args(SLIME_MODEL_FILES / "glm4-9B.sh")
    qwen3 = _checkpoint(tmp_path / "qwen3", "qwen3-4B", num_hidden_layers=40, hidden_size=4096,
                        intermediate_size=13696, num_key_value_heads=2, vocab_size=151552)
    with pytest.raises(ConfigError, match=r"--spec \['slime_plugins.models.glm4', 'get_glm_spec'\] disagrees .* "
                                          r"Qwen3ForCausalLM bridge's spec from config.json is None"):
        _check(qwen3, "fsdp", glm4)
    with pytest.raises(ConfigError, match=r"--moe-layer-freq \[0, 1, 1, 1\] disagrees .*is \[0, 0, 0, 1\]"):
        _check(deepseek, "megatron", ["--moe-layer-freq", "[0]+[1]*3"])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_presets_megatron_args_parse_and_agree_with_its_config(name, tmp_path):
    """`slime-core models --show NAME` prints MODEL_ARGS that slime-core's parser reads back into the same model."""
    _check(_checkpoint(tmp_path, SAME_SHAPE.get(name, name)), "megatron", PRESETS[name].megatron_args())
