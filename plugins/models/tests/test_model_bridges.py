import types

from transformers import LlamaConfig, Qwen2Config

from slimecore.config import Config
from slimecore.plugins import installed_entry_points, load_plugins


def test_bridges_by_architecture():
    assert "models" in installed_entry_points()
    hooks = load_plugins(["models"])
    qwen = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, architectures=["Qwen2ForCausalLM"])
    bridge = hooks.model_bridge(config=Config.make(), hf_config=qwen)
    assert bridge.architecture == "Qwen2ForCausalLM"
    assert bridge.shape["num_query_groups"] == 2 and bridge.shape["kv_channels"] == 16
    assert bridge.shape["add_qkv_bias"] is True and bridge.shape["ffn_hidden_size"] == 128
    llama = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                        num_attention_heads=4, architectures=["LlamaForCausalLM"], tie_word_embeddings=True)
    shape = hooks.model_bridge(config=Config.make(), hf_config=llama).shape
    assert shape["num_query_groups"] == 4 and shape["untie_embeddings_and_output_weights"] is False
    assert shape["rotary_base"] is not None
    unknown = types.SimpleNamespace(architectures=["GPT2LMHeadModel"])
    assert hooks.model_bridge(config=Config.make(), hf_config=unknown) is None
