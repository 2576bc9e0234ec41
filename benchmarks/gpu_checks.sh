#!/usr/bin/env bash
# The GPU checks in one run (under 10 minutes on an H200): the `cuda` tests, the step-time
# micro-benchmark against the measured link bandwidth, then the end-to-end benchmark (as many of
# its configurations as fit in E2E_BUDGET_S seconds). Results go to $OUT (default docs/figures).
# Wheels in .whl/ (torchao, for the comparison) are installed first when present; carry `.whl`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/figures}
E2E_BUDGET_S=${E2E_BUDGET_S:-240}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# At most 8 files come back from $OUT: the machine's description goes with the tests' output.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/cuda_tests.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/cuda_tests.txt"
timeout 180 python3 -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tee -a "$OUT/cuda_tests.txt"
tests=${PIPESTATUS[0]}
timeout 150 python3 benchmarks/gpu_step_time.py --steps 5 --out "$OUT" 2>&1 | tee "$OUT/gpu_bench.txt"
bench=${PIPESTATUS[0]}
timeout $((E2E_BUDGET_S + 120)) python3 benchmarks/gpu_end_to_end.py --budget-s "$E2E_BUDGET_S" \
  --out "$OUT" 2>&1 | tee "$OUT/gpu_end_to_end.txt"
e2e=${PIPESTATUS[0]}
exit $((tests || bench || e2e))
