#!/usr/bin/env bash
# The GPU checks in one run, at most about 10 minutes: the sum of its parts' limits (20 + 45 +
# 170 + 50 + 40 + 140 + 90 + 35 s), the install and the header's commands (a session's 15 device
# minutes also pay for the machine's start; each part is cut at its own limit and keeps what it
# wrote, and killed 5 s later if it is still running: Lightning turns the first signal into an
# exception, which pytest reports and goes on from, and a call stuck in C never sees it): the
# `cuda` tests (the three that start NCCL apart, as a hang in its set-up cannot be interrupted in C
# code by pytest-timeout, and the compiled one apart, as its compilations may be slow), the
# end-to-end benchmark (as many configurations as fit in E2E_BUDGET_S seconds), the step-time
# micro-benchmark against the measured link bandwidth, then the random scenarios. Results go to
# $OUT (default docs/figures). Wheels in .whl/ (torchao, for the comparison) are installed first
# when present; carry `.whl`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/figures}
E2E_BUDGET_S=${E2E_BUDGET_S:-80}
STEP_PARAMS=${STEP_PARAMS:-300000000}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
# At most 8 files come back from $OUT: the machine's description goes with the tests' output.
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
  nproc
  free -g | head -2
  # Pinning: how long registering 4 GiB takes here (host RAM may grow as it is first used), and
  # whether it works at all; the tests and benchmarks fall back to pageable memory otherwise.
  timeout -k 5 45 python3 - <<'PY'
import time, torch
from lightning_offload_optim import host_state
torch.zeros(1, device="cuda")  # the CUDA context first: time the pinning alone
started = time.perf_counter()
try:
    buffer, _ = host_state._pinned_empty(1 << 30, torch.float32, torch.device("cuda"))
    print(f"pinned 4 GiB in {time.perf_counter() - started:.2f} s: is_pinned {buffer.is_pinned()}")
except Exception as error:
    print(f"pinning 4 GiB failed after {time.perf_counter() - started:.2f} s: {error!r}")
PY
  # matplotlib's first import builds its font cache: here, not inside a benchmark's limit.
  timeout -k 5 20 python3 -c "import matplotlib.pyplot" || echo "matplotlib failed to import"
} 2>&1 | tee "$OUT/cuda_tests.txt"
# One hung test (a collective's set-up) must not take the others' time: 90 s each where
# pytest-timeout is installed (an unknown option would stop pytest). The random scenarios come
# last, in what time is left: the benchmarks matter more than 20 more seeds.
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=90")
nccl="fsdp2_on_one_gpu or ddp_bucket_views or tensor_parallel_on_one_gpu"
compiled="compiled_model"
timeout -k 5 170 python3 -m pytest -v -m cuda -p no:cacheprovider --durations=8 $per_test \
  -k "not ($nccl or $compiled)" tests/test_cuda.py 2>&1 | tee -a "$OUT/cuda_tests.txt"
tests=${PIPESTATUS[0]}
timeout -k 5 50 python3 -m pytest -v -m cuda -p no:cacheprovider $per_test -k "$nccl" \
  tests/test_cuda.py 2>&1 | tee -a "$OUT/cuda_tests.txt"
nccl_tests=${PIPESTATUS[0]}
timeout -k 5 40 python3 -m pytest -v -m cuda -p no:cacheprovider $per_test -k "$compiled" \
  tests/test_cuda.py 2>&1 | tee -a "$OUT/cuda_tests.txt"
compiled_test=${PIPESTATUS[0]}
timeout -k 5 $((E2E_BUDGET_S + 60)) python3 benchmarks/gpu_end_to_end.py --budget-s "$E2E_BUDGET_S" \
  --steps 6 --out "$OUT" 2>&1 | tee "$OUT/gpu_end_to_end.txt"
e2e=${PIPESTATUS[0]}
[ "$e2e" = 124 ] && e2e=0  # cut at its limit: the CSV holds every configuration it finished
timeout -k 5 90 python3 benchmarks/gpu_step_time.py --params "$STEP_PARAMS" --steps 5 --out "$OUT" 2>&1 \
  | tee "$OUT/gpu_bench.txt"
bench=${PIPESTATUS[0]}
[ "$bench" = 124 ] && bench=0  # cut at its limit: it writes its results after every row
timeout -k 5 35 python3 -m pytest -v -m cuda -p no:cacheprovider $per_test tests/test_randomized.py \
  2>&1 | tee -a "$OUT/cuda_tests.txt"
random=${PIPESTATUS[0]}
[ "$random" = 124 ] && random=0  # cut at its limit: the seeds it ran are in the output
echo "exit codes: tests $tests, NCCL tests $nccl_tests, compiled test $compiled_test," \
  "end-to-end $e2e, step time $bench, random scenarios $random" | tee -a "$OUT/cuda_tests.txt"
exit $((tests || nccl_tests || compiled_test || bench || e2e || random))
