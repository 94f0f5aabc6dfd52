"""Megatron arguments: every field of megatron-core's TransformerConfig / OptimizerConfig /
DistributedDataParallelConfig is a flag, accepted and passed through, checked against the checkpoint where
config.json says the same thing, or refused by name; slime's model-script flags are accepted."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is in the test extra")

from transformers import AutoConfig  # noqa: E402

from slimecore.config import Config, ConfigError, parse_config  # noqa: E402
from slimecore.megatron_args import check_against_hf, known_fields, megatron_overrides  # noqa: E402

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
        assert {f.name for f in dataclasses.fields(cls)} <= set(fields)
    assert fields["attention_dropout"].kind is float and fields["overlap_grad_reduce"].target == "ddp"
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
                                       "overlap_param_gather: true\n")
    config = parse_config(["--config", str(tmp_path / "run.yaml")], [], {})
    assert config.megatron_args == {"hidden_dropout": 0.1, "overlap_param_gather": True}
    assert config.sequence_parallel is True  # a core option keeps its own meaning


@pytest.mark.parametrize("argv,message", [
    (["--params-dtype", "bf16"], "--params-dtype is not accepted: slime-core sets it from --bf16"),
    (["--init-method", "normal"], "--init-method is not accepted: its value (transformer config field init_method)"),
    (["--normalization", "BatchNorm"], "'BatchNorm' is not one of LayerNorm, RMSNorm"),
    (["--num-layers", "four"], "--num-layers: 'four' is not of type int"),
    (["--num-layerz", "4"], "unknown argument '--num-layerz'"),
])
def test_refusals_name_the_argument(argv, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _parse(*argv)


def test_checked_against_config_json(tiny_checkpoint):
    hf = AutoConfig.from_pretrained(tiny_checkpoint)
    ok = _parse("--num-layers", str(hf.num_hidden_layers), "--num-query-groups", str(hf.num_key_value_heads),
                "--hf-checkpoint", str(tiny_checkpoint), "--swiglu")
    check_against_hf(ok, hf)  # agrees: accepted, with fsdp too (they describe the model)
    bad = _parse("--hidden-size", str(hf.hidden_size + 1), "--hf-checkpoint", str(tiny_checkpoint))
    with pytest.raises(ConfigError, match=rf"--hidden-size {hf.hidden_size + 1} disagrees with .*config.json's "
                                          rf"hidden_size \({hf.hidden_size}\)"):
        check_against_hf(bad, hf)
    fsdp = _parse("--attention-dropout", "0.1", "--hf-checkpoint", str(tiny_checkpoint))
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
