"""Megatron arguments: every flag of Megatron-LM's model groups and every field of megatron-core's TransformerConfig /
MLATransformerConfig / OptimizerConfig / DistributedDataParallelConfig is a flag, accepted and passed through,
checked against the checkpoint where config.json says the same thing, or refused by name; each of slime's model files
(tests/slime_format/scripts/models, THUDM/slime at the commit in COMMIT there) parses. The flag table is generated
(slimecore.trainers.megatron_flags); a test regenerates it from the installed megatron-core and compares."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is in the test extra")

from transformers import AutoConfig  # noqa: E402

from slimecore.config import Config, ConfigError, parse_config  # noqa: E402
from slimecore.trainers.megatron_args import (check_against_hf, generate_flag_table, known_fields,  # noqa: E402
                                     megatron_overrides, source_model_args)

HERE = Path(__file__).resolve().parent
# slime's own (not Megatron's) flags in its model files: the glm5 files end with "# slime specific args"
SLIME_OWN_FLAGS = {"--allgather-cp"}
SLIME_MODEL_FILES = sorted((HERE / "slime_format" / "scripts" / "models").glob("*.sh"))

SLIME_SCRIPT = ("--swiglu --num-layers 4 --hidden-size 64 --group-query-attention --use-rotary-position-embeddings "
                "--disable-bias-linear --normalization RMSNorm --attention-dropout 0.0 --hidden-dropout 0.0 "
                "--attention-softmax-in-fp32 --attention-backend flash --accumulate-allreduce-grads-in-fp32 "
                "--optimizer sgd --overlap-grad-reduce --no-gradient-accumulation-fusion --moe-router-topk-scaling-factor 2.5")


def _parse(*argv: str) -> Config:
    return parse_config(["--rollout-batch-size", "2", *argv], [], {})


def test_every_config_field_is_known_and_typed():
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    import dataclasses

    fields = known_fields()
    for cls in (TransformerConfig, OptimizerConfig, DistributedDataParallelConfig):
        assert {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")} <= set(fields)
    assert fields["attention_dropout"].kind == "float" and fields["overlap_grad_reduce"].target == "ddp"
    assert fields["optimizer"].target == "optimizer" and fields["attention_backend"].choices


def test_a_slime_script_parses_and_splits_by_config():
    config = _parse(*SLIME_SCRIPT.split())
    args = config.megatron_args
    assert args["num_layers"] == 4 and args["swiglu"] is True and args["gradient_accumulation_fusion"] is False
    assert args["moe_router_topk_scaling_factor"] == 2.5 and args["normalization"] == "RMSNorm"
    assert Config.from_dict(config.to_dict()).megatron_args == args  # reaches every Ray process
    transformer = megatron_overrides(config, "transformer")
    from megatron.core.transformer.enums import AttnBackend

    assert transformer["attention_backend"] is AttnBackend.flash and transformer["attention_dropout"] == 0.0
    assert "num_layers" not in transformer and "normalization" not in transformer  # the model comes from the HF config
    assert megatron_overrides(config, "optimizer") == {"optimizer": "sgd"}
    assert megatron_overrides(config, "ddp") == {"overlap_grad_reduce": True}


def test_yaml_takes_megatron_keys(tmp_path):
    (tmp_path / "run.yaml").write_text("rollout_batch_size: 2\nhidden_dropout: 0.1\nsequence_parallel: true\n"
                                       "tensor_model_parallel_size: 2\noverlap_param_gather: true\n")
    config = parse_config(["--config", str(tmp_path / "run.yaml")], [], {})
    assert config.megatron_args == {"hidden_dropout": 0.1, "overlap_param_gather": True}
    assert config.sequence_parallel is True  # a core option keeps its own meaning


@pytest.mark.parametrize("argv,message", [
    (["--params-dtype", "bf16"], "--params-dtype is not accepted: slime-core sets it from --bf16"),
    (["--init-method", "normal"], "--init-method is not accepted: its value (transformer init_method) is not"),
    (["--normalization", "BatchNorm"], "'BatchNorm' is not one of LayerNorm, RMSNorm"),
    (["--num-layers", "four"], "--num-layers: 'four' is not of type int"),
    (["--num-layerz", "4"], "unknown argument '--num-layerz' (did you mean --num-layers?)"),
    (["--kv-lora-rnk", "4"], "unknown argument '--kv-lora-rnk' (did you mean --kv-lora-rank?)"),
    (["--moe-layer-freq", "[0]*x"], "--moe-layer-freq: '[0]*x' is not an integer or a Python list of integers"),
    (["--moe-router-load-balancing-type", "aux"], "'aux' is not one of aux_loss, seq_aux_loss"),
    (["--moe-aux-loss-coeff"], "--moe-aux-loss-coeff needs a value"),
])
def test_refusals_name_the_argument(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _parse(*argv)


def test_checked_against_config_json(tiny_checkpoint):
    hf = AutoConfig.from_pretrained(tiny_checkpoint)
    ok = _parse("--num-layers", str(hf.num_hidden_layers), "--num-query-groups", str(hf.num_key_value_heads),
                "--hf-checkpoint", str(tiny_checkpoint), "--swiglu")
    check_against_hf(ok, hf)  # agrees: accepted, with fsdp too (they describe the model)
    bad = _parse("--hidden-size", str(hf.hidden_size + 1), "--hf-checkpoint", str(tiny_checkpoint))
    with pytest.raises(ConfigError, match=rf"--hidden-size {hf.hidden_size + 1} disagrees with .*config.json's "
                                          rf"hidden_size is {hf.hidden_size};"):
        check_against_hf(bad, hf)
    fsdp = _parse("--attention-dropout", "0.1", "--hf-checkpoint", str(tiny_checkpoint), "--train-backend", "fsdp")
    with pytest.raises(ConfigError, match="--attention-dropout is a Megatron argument: it applies with "
                                          "--train-backend megatron"):
        check_against_hf(fsdp, hf)
    check_against_hf(_parse("--attention-dropout", "0.1", "--train-backend", "megatron"), hf)


def test_cli_names_a_disagreeing_model_flag_before_ray(tiny_checkpoint):
    hf = AutoConfig.from_pretrained(tiny_checkpoint)
    proc = subprocess.run([sys.executable, "-m", "slimecore_cli", "train", "--plugin", "grpo", "--rollout-batch-size",
                           "2", "--hf-checkpoint", str(tiny_checkpoint), "--num-layers", str(hf.num_hidden_layers + 2)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"--num-layers {hf.num_hidden_layers + 2} disagrees with" in " ".join(proc.stderr.split())
    assert "Started a local Ray instance" not in proc.stderr


def test_the_flag_table_is_what_the_installed_megatron_core_and_megatron_lm_parser_define():
    """slimecore/trainers/megatron_flags.py is generated; a megatron-core or Megatron-LM change shows up here.
    Regenerate with `python -m slimecore.trainers.megatron_args tests/megatron_lm/arguments-core_v0.16.1.py.txt`."""
    from slimecore.trainers.megatron_flags import FLAGS, MEGATRON_CORE

    installed = importlib.metadata.version("megatron-core")
    if installed != MEGATRON_CORE:
        pytest.skip(f"the table is for megatron-core {MEGATRON_CORE}, {installed} is installed")
    source = (HERE / "megatron_lm" / f"arguments-core_v{MEGATRON_CORE}.py.txt").read_text()
    assert generate_flag_table(source) == FLAGS


def test_megatron_lm_spellings_and_values():
    config = _parse("--norm-epsilon", "1e-6", "--disable-bias-linear", "--no-rope-fusion", "--apply-layernorm-1p",
                    "--moe-layer-freq", "[0]*2+[1]*3", "--moe-aux-loss-coeff", "0", "--moe-router-load-balancing-type",
                    "seq_aux_loss", "aux_loss", "--spec", "slime_plugins.models.glm4", "get_glm_spec",
                    "--q-lora-rank", "1536", "--mscale", "1.0", "--num-experts", "8", "--use-rope-scaling")
    args = config.megatron_args
    assert args["layernorm_epsilon"] == 1e-6 and args["add_bias_linear"] is False
    assert args["apply_rope_fusion"] is False and args["layernorm_zero_centered_gamma"] is True
    assert args["moe_layer_freq"] == [0, 0, 1, 1, 1] and args["moe_aux_loss_coeff"] == 0.0  # one value: a number
    assert args["moe_router_load_balancing_type"] == ["seq_aux_loss", "aux_loss"]
    assert args["spec"] == ["slime_plugins.models.glm4", "get_glm_spec"] and args["q_lora_rank"] == 1536
    assert _parse("--moe-layer-freq", "[0, 0, 0, 1]").megatron_args["moe_layer_freq"] == [0, 0, 0, 1]
    assert _parse("--moe-layer-freq", "2").megatron_args["moe_layer_freq"] == 2
    transformer = megatron_overrides(config, "transformer")  # settings pass through; model fields do not
    assert transformer == {"apply_rope_fusion": False, "moe_aux_loss_coeff": 0.0,
                           "moe_router_load_balancing_type": ["seq_aux_loss", "aux_loss"]}


@pytest.mark.parametrize("path", SLIME_MODEL_FILES, ids=lambda p: p.stem)
def test_every_slime_model_file_parses(path):
    """slime's scripts/models/*.sh, sourced as its run scripts do and passed verbatim."""
    args = source_model_args(path)
    assert "--num-layers" in args
    slime_own = [a for a in args if a in SLIME_OWN_FLAGS]
    if slime_own:  # decided by slime's flag table (issue part 1), not a Megatron flag: named, the rest parses
        with pytest.raises(ConfigError, match=re.escape(slime_own[0])):
            _parse(*args)
        args = [a for a in args if a not in SLIME_OWN_FLAGS]
    config = _parse(*args)
    assert config.megatron_args["num_layers"] > 0 and config.megatron_args["hidden_size"] > 0


def test_parsing_megatron_flags_does_not_import_megatron_core():
    code = ("import sys; from slimecore.config import parse_config, ConfigError\n"
            "parse_config(['--rollout-batch-size', '2', '--moe-layer-freq', '[0]+[1]*3', '--hidden-dropout', '0.1'],"
            " [], {})\n"
            "try:\n    parse_config(['--no-such-flag'], [], {})\nexcept ConfigError:\n    pass\n"
            "assert not [m for m in sys.modules if m.startswith('megatron')], 'megatron imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
