#!/usr/bin/env bash
# Install every plugin distribution in plugins/ (editable), grpo first: others may depend on it.
set -euo pipefail
cd "$(dirname "$0")/.."
for name in grpo $(ls plugins | grep -vx grpo); do
  if [ -f "plugins/$name/pyproject.toml" ]; then
    python -m pip install -q -c .ci/constraints.txt --no-build-isolation -e "plugins/$name"
  fi
done
