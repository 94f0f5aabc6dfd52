"""slime's own run script, ``scripts/run-qwen3-4B.sh`` of THUDM/slime 624b824 (kept verbatim as
tests/slime_format/scripts/run-qwen3-4B.sh), runs under slime-core on CPU for 2 steps.

Only what a different machine changes is substituted: the paths (a tiny Qwen3 checkpoint, as --ref-load the
Megatron-LM root slime's tools/convert_hf_to_torch_dist.py would make of it, prompt files, the save directory), the
model file it sources sized to that checkpoint (slime's qwen3-4B.sh with the tiny model's numbers: the same flags),
the GPU counts (one device per trainer and engine), and the sizes that make it a 2-step CPU run (steps, batch,
response lengths). The environment provides what the script calls around the run: ``ray start`` and ``ray stop``
(slime-core starts its own local Ray), ``pkill`` and ``sleep`` (the script's clean-up of a previous run would kill
every Python process on the machine), ``ray job submit -- python3 train.py ARGS`` (runs the command with the runtime
environment's variables) and ``train.py`` (slime's entry point: ``slime-core train ARGS``, with the test-only plugin
that installs megatron-core's CPU shim, tests/megatron/cpu_plugin.py, as this machine has no CUDA). Every flag the
script passes reaches slime-core's parser as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("slime_grpo", reason="the grpo plugin is installed by scripts/setup.sh")
pytest.importorskip("megatron.core", reason="slime's scripts train with Megatron (--train-backend megatron)")
SCRIPTS = Path(__file__).parent / "slime_format" / "scripts"
SHIMS = {
    "pkill": "#!/bin/sh\nexit 0\n",
    "sleep": "#!/bin/sh\nexit 0\n",
    # ray start / stop: nothing (slime-core starts its own Ray); ray job submit ... -- CMD: CMD with the runtime env
    "ray": """#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
if args[:2] != ["job", "submit"]:
    sys.exit(0)
env = dict(os.environ)
for arg in args[:args.index("--")]:
    if arg.startswith("--runtime-env-json="):
        env.update(json.loads(arg.split("=", 1)[1]).get("env_vars", {}))
command = args[args.index("--") + 1:]
os.execvpe(command[0], command, env)
""",
}
# slime's train.py is slime-core train here; a machine without CUDA runs megatron-core under the CPU shim's plugin
CPU_PLUGIN = Path(__file__).parent / "megatron" / "cpu_plugin.py"
TRAIN_PY = f"import sys\n\nfrom slimecore_cli.main import cli\n\ncli(['train', *sys.argv[1:], '--plugin', {str(CPU_PLUGIN)!r}])\n"


def _tiny_model_file(checkpoint: Path) -> str:
    """slime's scripts/models/qwen3-4B.sh with the tiny checkpoint's numbers in place of Qwen3-4B's."""
    config = json.loads((checkpoint / "config.json").read_text())
    numbers = {"--num-layers": config["num_hidden_layers"], "--hidden-size": config["hidden_size"],
               "--ffn-hidden-size": config["intermediate_size"], "--num-attention-heads": config["num_attention_heads"],
               "--num-query-groups": config["num_key_value_heads"], "--vocab-size": config["vocab_size"],
               "--kv-channels": config["head_dim"], "--norm-epsilon": config["rms_norm_eps"]}
    text = (SCRIPTS / "models" / "qwen3-4B.sh").read_text()
    for flag, value in numbers.items():
        text, n = re.subn(rf"({flag}) \S+", rf"\g<1> {value}", text)
        assert n == 1, flag
    return text


def _substituted_script(root: Path, checkpoint: Path) -> str:
    """The run script with this machine's paths, GPU counts and a 2-step CPU run's sizes."""
    text = (SCRIPTS / "run-qwen3-4B.sh").read_text()
    subs = {  # (old, new): paths
        "/root/Qwen3-4B_torch_dist": str(root / "Qwen3-tiny_torch_dist"),  # --ref-load: a Megatron-LM root
        "/root/Qwen3-4B_slime/": str(root / "save") + "/", "/root/Qwen3-4B": str(checkpoint),
        "/root/dapo-math-17k/dapo-math-17k.jsonl": str(root / "dapo.jsonl"),
        "/root/aime-2024/aime-2024.jsonl": str(root / "aime.jsonl"),
    }
    sizes = {  # flag: value; GPU counts, then the sizes of a 2-step CPU run
        "--tensor-model-parallel-size": 1, "--rollout-num-gpus-per-engine": 1, "--num-rollout": 2,
        "--rollout-batch-size": 2, "--n-samples-per-prompt": 2, "--global-batch-size": 4,
        "--rollout-max-response-len": 8, "--n-samples-per-eval-prompt": 1, "--eval-max-response-len": 8,
    }
    for old, new in subs.items():
        assert old in text, old
        text = text.replace(old, new)
    for flag, value in sizes.items():
        text, n = re.subn(rf"^(\s*{flag}) \S+$", rf"\g<1> {value}", text, flags=re.M)
        assert n == 1, flag
    return text


@pytest.fixture
def slime_checkout(tmp_path):
    """A directory laid out as the script expects, with the shims on PATH."""
    from transformers import AutoConfig

    from slimecore.testing.tiny import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "Qwen3-tiny", "qwen3")
    # what slime's tools/convert_hf_to_torch_dist.py makes of it (Megatron-LM's save_checkpoint layout)
    sys.path.insert(0, str(Path(__file__).parent / "megatron"))
    import scoring_checks

    from slimecore.testing.distributed import run_ranks

    run_ranks(scoring_checks.megatron_lm_root, str(checkpoint), str(tmp_path / "Qwen3-tiny_torch_dist"), world=1,
              timeout=300)
    (tmp_path / "scripts" / "models").mkdir(parents=True)
    (tmp_path / "scripts" / "run-qwen3-4B.sh").write_text(_substituted_script(tmp_path, checkpoint))
    (tmp_path / "scripts" / "models" / "qwen3-4B.sh").write_text(_tiny_model_file(checkpoint))
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "label": str(2 * i)} for i in range(8)]
    for name in ("dapo.jsonl", "aime.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in rows[:4 if name == "aime.jsonl" else 8]))
    (tmp_path / "train.py").write_text(TRAIN_PY)
    (tmp_path / "bin").mkdir()
    for name, body in SHIMS.items():
        (tmp_path / "bin" / name).write_text(body)
        (tmp_path / "bin" / name).chmod(0o755)
    rope = AutoConfig.from_pretrained(checkpoint).rope_parameters["rope_theta"]
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "NUM_GPUS": "1", "MODEL_ARGS_ROTARY_BASE": f"{rope:g}"}
    return tmp_path, env


def test_slimes_run_qwen3_4b_script_runs_unchanged_for_two_steps(slime_checkout):
    root, env = slime_checkout
    original = (SCRIPTS / "run-qwen3-4B.sh").read_text()
    assert "--advantage-estimator grpo" in original and "--ref-load" in original and "--balance-data" in original
    proc = subprocess.run(["bash", "scripts/run-qwen3-4B.sh"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    [run] = [p for p in (root / "runs").iterdir() if p.is_dir() and not p.is_symlink()]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["rollout/step"] for s in steps if "train/loss" in s] == [0, 1]  # 2 training steps
    config = (run / "config.yaml").read_text()
    assert "train_backend: megatron" in config and "balance_data: true" in config
    assert f"ref_load: {root / 'Qwen3-tiny_torch_dist'}" in config  # the Megatron-LM root, as slime's script gives it
    assert (root / "save" / "iter_0000001").is_dir()  # --save-interval 20: the last step is saved too
