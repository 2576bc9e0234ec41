#!/usr/bin/env bash
# The GPU checks in one run (under 5 minutes on an H200): the `cuda` tests, then the step-time
# micro-benchmark. Results go to $OUT (default docs/figures).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/figures}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
PYTHONPATH=. python -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tee "$OUT/cuda_tests.txt"
tests=${PIPESTATUS[0]}
PYTHONPATH=. timeout 240 python benchmarks/gpu_step_time.py --out "$OUT" 2>&1 | tee "$OUT/gpu_bench.txt"
exit $((tests || PIPESTATUS[0]))
