#!/usr/bin/env bash
# Build the wheel folder that scripts/gpu-check.sh installs from, on a machine that can reach PyPI:
#
#   bash scripts/gpu-wheels.sh [DIR]            # default DIR: wheels/gpu (git-ignored: copy it to the GPU machine)
#
# The GPU machine has torch (and triton) and no network. The folder holds what the check needs beyond them:
# megatron-core, mbridge and einops; transformers at the pin the project is tested with, and what it needs;
# pluggy, PyYAML, numpy, pytest and pytest-timeout; peft, accelerate and psutil (the LoRA tests); aiohttp (slime-core's default plugins import it);
# setuptools (the editable installs of slime-core and its
# plugins); the sglang wheel without its dependencies, and pybase64, the one package beside torch that the code
# of its weight-sync wire uses (MultiprocessingSerializer and SafeUnpickler in sglang/srt/utils/common.py,
# FlattenedTensorBucket in sglang/srt/weight_sync/tensor_bucket.py). The test loads those classes from the
# wheel's source files: importing sglang.srt.utils would pull torchvision, PIL, IPython, pydantic, aiohttp
# and more (SGLang's server), which a bare GPU machine does not have.
# Wheels are for this interpreter's Python and platform; for another one set GPU_WHEELS_PLATFORM (pip matches each
# manylinux tag exactly, so name several), e.g. for CPython 3.12 on x86-64:
#   GPU_WHEELS_PLATFORM="--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_17_x86_64
#     --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64
#     --platform manylinux_2_5_x86_64"
# GPU_WHEELS_HAVE names the distributions the GPU machine already has: left out of the folder. For an image with the
# usual scientific stack (its huggingface-hub 1.x serves transformers, so hub 2.x's own needs go too):
#   GPU_WHEELS_HAVE="numpy pyyaml aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl idna
#     pytest iniconfig pluggy packaging setuptools einops safetensors tokenizers huggingface_hub tqdm pygments h11
#     anyio pytest_timeout peft accelerate psutil httpcore2 httpx2 truststore"
# leaves six wheels, 28 MiB: transformers, megatron-core, mbridge, sglang, pybase64, regex.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$root/wheels/gpu}"
mkdir -p "$dir"
python="${PYTHON:-python3}"
read -r -a platform <<< "${GPU_WHEELS_PLATFORM:-}"
download() { "$python" -m pip download -q --disable-pip-version-check --dest "$dir" "${platform[@]}" "$@"; }

# With their dependencies (none of these depends on torch)
download transformers==5.24.0 pluggy pyyaml numpy "pytest>=8" pytest-timeout einops setuptools aiohttp
# Without: each would pull torch (megatron-core, mbridge) or SGLang's whole GPU server (sglang)
download --no-deps "megatron-core>=0.16,<0.17" "mbridge>=0.15.1,<0.16" sglang==0.5.15.post1 pybase64 \
  peft accelerate psutil  # peft (LoRA tests) and what it needs beside torch, transformers and the above
# What torch already brought (filelock, fsspec, typing-extensions) and hf-xet, the hub's download accelerator
# (huggingface-hub imports it only to download; the check runs offline)
# and the command-line tooling of transformers and the hub (typer, rich and theirs, pydantic included; pytest
# needs pygments)
rm -f "$dir"/filelock-*.whl "$dir"/fsspec-*.whl "$dir"/typing_extensions-*.whl "$dir"/hf_xet-*.whl \
  "$dir"/typer-*.whl "$dir"/rich-*.whl "$dir"/click-*.whl "$dir"/markdown_it_py-*.whl \
  "$dir"/mdurl-*.whl "$dir"/shellingham-*.whl "$dir"/pydantic-*.whl "$dir"/pydantic_core-*.whl \
  "$dir"/annotated_types-*.whl "$dir"/annotated_doc-*.whl "$dir"/typing_inspection-*.whl

# What the GPU machine already has (GPU_WHEELS_HAVE: distribution names, space-separated) stays out of the folder:
# on an image with the scientific Python stack the folder shrinks to what is really missing
for name in ${GPU_WHEELS_HAVE:-}; do
  norm=$(echo "$name" | tr 'A-Z-.' 'a-z__')
  for whl in "$dir"/*.whl; do
    base=$(basename "$whl"); dist=$(echo "${base%%-*}" | tr 'A-Z-.' 'a-z__')
    [ "$dist" = "$norm" ] && rm -f "$whl"
  done
done

bytes=$(du -sb "$dir" | cut -f1)
echo "wheel folder $dir: $(ls "$dir" | wc -l) files, $((bytes / 1024 / 1024)) MiB"
if [ "$bytes" -gt $((60 * 1024 * 1024)) ]; then
  echo "warning: over 60 MiB; drop what the GPU machine already has (numpy, transformers) from the folder" >&2
fi
