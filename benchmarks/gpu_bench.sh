#!/usr/bin/env bash
# The prepared check for a single-GPU machine (torch, transformers, accelerate installed; no network needed):
#     bash benchmarks/gpu_bench.sh [OUT_DIR]
# Smoke test of every GPU script, then tokens/s and MFU of pretrain_fsdp.py; see benchmarks/gpu_bench.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_bench.py "$@"
