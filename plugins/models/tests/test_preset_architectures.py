"""The presets added on existing bridges (GLM-4.5-355B / 4.6 / 4.7, GLM-Z1, Kimi K2, Moonlight), each on a tiny random
config of its own kind: the bridge reads the settings that set it apart (q/k norms, routed scaling, group-limited
routing, YaRN, no q LoRA, two shared experts) and transformers' own model class for the architecture builds and runs
it, and the fsdp backend trains it one GRPO step. GLM-4.6's tiny config is ``tiny_hf_configs()["glm4.6-moe"]`` in
tests/megatron, where the Megatron build is checked against HF too (logits, export: ``MORE_ARCHITECTURES`` of
test_megatron_backend.py); the DeepSeek-V3 family (Kimi K2, Moonlight) builds in Megatron only with Transformer
Engine and CUDA (slime_models.megatron)."""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4Config

from slime_models.plugin import bridge_for

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "megatron"))
from megatron_checks import (TINY_SHAPES, _hooks, grpo_config, rank_part, synthetic_batch,  # noqa: E402
                             tiny_hf_configs)

_DEEPSEEK_FAMILY = dict(**{**TINY_SHAPES, "num_key_value_heads": 4}, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
                        architectures=["DeepseekV3ForCausalLM"])
TINY = {
    "glm4.6": lambda: tiny_hf_configs()["glm4.6-moe"],
    "glm-z1": lambda: Glm4Config(**TINY_SHAPES, head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
                                 pad_token_id=0, architectures=["Glm4ForCausalLM"]),
    "kimi-k2": lambda: DeepseekV3Config(**_DEEPSEEK_FAMILY, q_lora_rank=32, n_shared_experts=1,
                                        routed_scaling_factor=2.827, rope_parameters={
                                            "rope_type": "yarn", "rope_theta": 5e4, "factor": 32.0, "beta_fast": 1.0,
                                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                            "original_max_position_embeddings": 16}),
    "moonlight": lambda: DeepseekV3Config(**_DEEPSEEK_FAMILY, q_lora_rank=None, n_shared_experts=2,
                                          routed_scaling_factor=2.446,
                                          rope_parameters={"rope_type": "default", "rope_theta": 5e4}),
}
# what each kind's bridge must read from its config.json (the preset's distinguishing Megatron values)
EXPECTED = {
    "glm4.6": {"qk_layernorm": True, "moe_router_topk_scaling_factor": 2.5, "moe_router_num_groups": 2,
               "moe_router_group_topk": 1, "rotary_percent": 0.5, "moe_layer_freq": [0, 1]},
    "glm-z1": {"post_self_attn_layernorm": True, "rotary_interleaved": True, "add_qkv_bias": True},
    "kimi-k2": {"q_lora_rank": 32, "rotary_scaling_factor": 32.0, "mscale_all_dim": 1.0,
                "moe_router_topk_scaling_factor": 2.827, "moe_shared_expert_intermediate_size": 32},
    "moonlight": {"q_lora_rank": None, "rotary_scaling_factor": 1.0, "moe_shared_expert_intermediate_size": 64,
                  "moe_router_topk_scaling_factor": 2.446},
}


@pytest.mark.parametrize("kind", sorted(TINY))
def test_tiny_config_of_the_preset_kind_reads_as_its_preset_and_runs_in_transformers(kind):
    hf = TINY[kind]()
    values = bridge_for(hf).megatron_values()
    assert {key: values[key] for key in EXPECTED[kind]} == EXPECTED[kind]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf).to(torch.float32).eval()  # transformers' own class for it
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, hf.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize("kind", sorted(TINY))
def test_fsdp_trains_the_preset_kind_one_step(kind, tmp_path):
    from slimecore.testing.tiny import build_tokenizer
    from slimecore.trainers.trainer import Trainer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(TINY[kind]()).to(torch.float32).save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    trainer = Trainer(grpo_config(str(tmp_path)), _hooks(), backend="fsdp")
    before = {name: weight.clone() for name, weight in trainer.backend.named_weights().items()}
    metrics = trainer.train(0, copy.deepcopy(rank_part(synthetic_batch(), 1, 0)))
    after = trainer.backend.named_weights()
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    assert sum(not torch.equal(before[name], after[name]) for name in before) > len(before) // 2
