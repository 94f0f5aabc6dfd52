#!/usr/bin/env bash
# Install the plugin distributions under plugins/ into the active environment, editable, pinned by the CI
# constraints. Order matters: gspo depends on grpo (slime-core-grpo), so grpo comes first. The constraints keep
# verifiers' mcp pin when openenv-core comes in.
set -euo pipefail
cd "$(dirname "$0")/.."
for name in grpo sft gspo ppo search_r1 models reasoning_gym verifiers openenv opd; do
  python -m pip install -q -c .ci/constraints.txt --no-build-isolation -e "plugins/$name"
done
