#!/usr/bin/env bash
# yesno end to end from a clean clone, the environment installed (issue 12):
# `snakemake --cores all` and `snakemake --version` timed in the same run, then the test WER.
# Usage: bench/yesno_end_to_end.sh [CLONE_DIR]   (default /tmp/asrflow-e2e; removed first)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
clone="${1:-/tmp/asrflow-e2e}"
rm -rf "$clone" && git clone -q "$repo" "$clone" && cd "$clone"
. "$repo/.venv/bin/activate"
export GIT_PYTHON_REFRESH=quiet
uptime
/usr/bin/time -f "snakemake --version: %e s" snakemake --version
/usr/bin/time -f "snakemake --cores all: %e s wall, %U s user, %S s sys" snakemake --cores all > snakemake.log 2>&1
uptime
python -c "import json; m = json.load(open('exp/eval/metrics.json')); print(f\"test WER {100 * m['wer']:.2f} % ({m['word_errors']} errors), CER {100 * m['cer']:.2f} %\")"
