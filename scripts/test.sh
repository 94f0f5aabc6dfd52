#!/usr/bin/env bash
# Set up the environment and run every test (core and plugins). Fails if no test ran.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
. .venv/bin/activate
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
set +e
timeout 3000 python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi
if [ "$rc" -eq 124 ]; then echo "tests ran past 50 minutes: failing"; fi
exit "$rc"
