#!/usr/bin/env bash
# Every GPU path checked by one command, on a bare GPU machine (torch and triton installed, no network):
#
#   bash scripts/gpu-check.sh [--wheels DIR] [--cpu] [--budget SECONDS]
#
# 1. installs what it needs from the wheel folder that scripts/gpu-wheels.sh made beforehand (default
#    wheels/gpu; no index is contacted), then slime-core and the grpo, gspo, ppo and models plugins, editable;
# 2. runs the GPU tests (pytest -m gpu): trainer, ops, algorithm and conversion tests parametrised on CUDA, the
#    megatron GPU checks; what needs Ray, SGLang's server or Transformer Engine is skipped by name;
# 3. runs the GPU benchmarks: benchmarks/train_throughput.py (fsdp and megatron, Qwen2.5-0.5B and 1.5B shapes,
#    16k tokens per micro-batch, bf16; megatron's log-prob gap to fsdp) and benchmarks/head_logprobs.py (peak
#    memory of the chunked LM head) and benchmarks/weight_wire.py (seconds per full weight sync over CUDA IPC,
#    opened by SGLang's own classes), each writing JSON to benchmarks/results/gpu-check-<date>-<mode>/;
# 4. prints a short table of the figures (all its output is also kept there, in gpu-check.log).
# With OUT set (a folder whose files are collected afterwards, as on a lent device machine) everything it writes
# goes under $OUT instead, packed at the end into one file, $OUT/gpu-check-<date>-<mode>.tar.gz (unpack it into
# benchmarks/results/); the pack is remade after every step, so a run stopped from outside leaves what it had done.
# --budget SECONDS: the whole check's time limit (a lent machine's per-command limit, say): every step's own limit is
# cut to what is left (minus 20 s to pack), and a step that no longer fits is skipped by name.
# Without CUDA (or with --cpu) it runs in its CPU mode: every GPU test is skipped by name and the benchmarks
# run on the tiny model, so the rest of the script is exercised. Exit status: that of the tests.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
wheels="$root/wheels/gpu"
force_cpu=0
budget=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$(cd "$2" && pwd)"; shift 2 ;;
    --cpu) force_cpu=1; shift ;;
    --budget) budget="$2"; shift 2 ;;
    *) echo "usage: bash scripts/gpu-check.sh [--wheels DIR] [--cpu] [--budget SECONDS]" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0 \
  PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
started=$(date +%s)
step() { echo; echo "== $* ($(( $(date +%s) - started )) s)"; }
limit() {  # limit SECONDS: a step's own limit, cut to what --budget leaves (at least 1)
  local left
  if [ "$budget" -gt 0 ]; then left=$(( budget - 20 - ($(date +%s) - started) )); else left=$1; fi
  [ "$left" -lt 1 ] && left=1  # (timeout 0 would mean no limit)
  echo $(( left < $1 ? left : $1 ))
}

mode=$("$python" -c "import torch; print('gpu' if torch.cuda.is_available() else 'cpu')" 2>/dev/null) \
  || { echo "torch does not import with $python (set PYTHON to the interpreter that has it)" >&2; exit 1; }
[ "$force_cpu" = 1 ] && mode=cpu && export CUDA_VISIBLE_DEVICES=""
name="gpu-check-$(date -u +%Y-%m-%dT%H%MZ)-$mode"
if [ -n "${OUT:-}" ]; then out="$OUT/$name"; else out="$root/benchmarks/results/$name"; fi
mkdir -p "$out" || exit 1
pack() {  # with OUT set: (re)make $OUT/$name.tar.gz from what the check has written so far
  [ -n "${OUT:-}" ] || return 0
  # the log is still being written: tar's "file changed as we read it" (exit 1) is expected
  tar --warning=no-file-changed -czf "$OUT/.$name.tar.gz" -C "$OUT" "$name"
  [ $? -le 1 ] && mv -f "$OUT/.$name.tar.gz" "$OUT/$name.tar.gz"
}

check() {  # the whole check; its output is kept in $out/gpu-check.log
step "install from $wheels"
if [ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
  echo "wheel folder: $(ls "$wheels" | wc -l) files, $(du -sm "$wheels" | cut -f1) MiB"
  # --no-deps: the folder is the closure of what is missing beside torch; pip leaves what is installed alone
  "$python" -m pip install -q --no-index --no-deps "$wheels"/*.whl || exit 1
else
  echo "no wheel folder at $wheels: using what is installed (make one with scripts/gpu-wheels.sh)"
fi
"$python" -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/grpo -e plugins/gspo \
  -e plugins/ppo -e plugins/models || exit 1

"$python" - "$out/versions.json" <<'EOF'
import importlib.metadata as md, importlib.util, json, platform, sys, time
import torch
have = lambda m: importlib.util.find_spec(m) is not None
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        **{name: version(name) for name in ("transformers", "megatron-core", "mbridge", "sglang", "triton")},
        "transformer_engine": have("transformer_engine"), "ray": have("ray")}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(" ".join(f"{k}={v}" for k, v in info.items()))
EOF

step "GPU tests (pytest -m gpu)"
# the files that hold device-parametrised and gpu-marked tests; each imports without Ray or SGLang's server
# (and without click and rich, the CLI's, which the wheel folder leaves out: the megatron conversion tests of
# tests/megatron/test_megatron_convert.py go through the CLI and hold no gpu-marked test)
timeout "$(limit 400)" "$python" -m pytest -q -m gpu -rs -p no:cacheprovider --continue-on-collection-errors \
  --junitxml="$out/gpu-tests.xml" tests/test_ops.py tests/test_fsdp_trainer.py tests/test_algorithm_gradients.py \
  tests/test_weight_wire.py tests/megatron/test_megatron_backend.py \
  2>&1 | tee "$out/gpu-tests.log" | tail -40
tests_status=${PIPESTATUS[0]}
[ "$tests_status" = 5 ] && tests_status=0  # no test selected: nothing failed
[ "$tests_status" = 124 ] && echo "GPU tests: stopped at the time limit (--budget)"
pack

bench() {  # bench NAME TIMEOUT COMMAND...: run one benchmark, keep its log, say why it did not finish
  local what=$1 seconds
  seconds=$(limit "$2")
  shift 2
  echo "-- $what"
  if [ "$seconds" -lt 10 ]; then echo "$what: skipped, no time left (--budget $budget)"; return; fi
  if timeout "$seconds" "$@" > "$out/$what.log" 2>&1; then tail -3 "$out/$what.log"
  else echo "$what: failed or timed out after ${seconds} s (exit $?), see $out/$what.log"; tail -5 "$out/$what.log"; fi
  pack
}

step "benchmarks ($mode)"
if [ "$mode" = gpu ]; then
  work=(--bf16 --use-dynamic-batch-size --max-tokens-per-gpu 16384)
  for shape in qwen2.5-0.5B qwen2.5-1.5B; do
    bench "train_fsdp_$shape" 240 "$python" benchmarks/train_throughput.py --backend fsdp --shape "$shape" \
      --steps 4 --warmup 1 --out "$out/train_fsdp_$shape.json" -- "${work[@]}"
    bench "train_megatron_$shape" 300 "$python" benchmarks/train_throughput.py --backend megatron --shape "$shape" \
      --steps 4 --warmup 1 --compare-fsdp --out "$out/train_megatron_$shape.json" -- "${work[@]}"
  done
  bench head_logprobs 120 "$python" benchmarks/head_logprobs.py --tokens 16384 --dtype bf16 \
    --out "$out/head_logprobs.json"
else
  echo "megatron benchmarks: skipped (needs CUDA; megatron-core runs on the CPU only under the test shim)"
  bench train_fsdp_tiny 300 "$python" benchmarks/train_throughput.py --backend fsdp --shape tiny --samples 8 \
    --group 4 --prompt-len 16 --response-len 32 --steps 3 --warmup 1 --out "$out/train_fsdp_tiny.json"
  bench head_logprobs 300 "$python" benchmarks/head_logprobs.py --tokens 256 --chunk 64 --out "$out/head_logprobs.json"
fi
# seconds per full weight sync over SGLang's tensor wire (CUDA IPC; shared memory and the tiny model on a CPU)
bench weight_wire 240 "$python" benchmarks/weight_wire.py --out "$out/weight_wire.json"

step "summary ($out)"
"$python" - "$out" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'benchmark':34s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'peak GiB':>9s} {'lp gap mean/max':>16s}")
for path in sorted(out.glob("train_*.json")):
    s = json.loads(path.read_text())["summary"]
    gap = (f"{s['logprob_abs_diff_mean']:.4f}/{s['logprob_abs_diff_max']:.3f}" if "logprob_abs_diff_mean" in s else "")
    mfu = f"{s['mfu']:.1%}" if "mfu" in s else "-"
    peak = f"{s['peak_memory_gib']:.1f}" if "peak_memory_gib" in s else "-"
    print(f"{path.stem:34s} {s['perf/actor_train_tok_per_s']:10.0f} {s['perf/actor_train_tflops']:8.2f} {mfu:>6s} "
          f"{peak:>9s} {gap:>16s}")
head = out / "head_logprobs.json"
if head.exists():
    h = json.loads(head.read_text())
    print(f"LM head log-probs, {h['tokens']} tokens x {h['vocab']} vocabulary ({h['dtype']}): peak "
          f"{h['full']['peak_bytes'] / 2**20:.0f} MiB whole logits, {h['chunked']['peak_bytes'] / 2**20:.0f} MiB chunked; "
          f"{h['full']['seconds']:.2f} s / {h['chunked']['seconds']:.2f} s")
wire = out / "weight_wire.json"
if wire.exists():
    for row in json.loads(wire.read_text())["results"]:
        print(f"weight sync {row['shape']:14s} {row['transport']:10s} {row['seconds']:.3f} s per full sync "
              f"({row['bytes'] / 2**30:.2f} GiB), bit-exact: {row['exact']}")
EOF
step "done: tests exit $tests_status"
return "$tests_status"
}

check 2>&1 | tee "$out/gpu-check.log"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
  pack && rm -rf "$out" && echo "results packed into $OUT/$name.tar.gz ($(du -k "$OUT/$name.tar.gz" | cut -f1) KiB)"
fi
exit "$status"
