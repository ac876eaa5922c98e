#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent device (15 minutes of device time per
# task: run it with a timeout that leaves room for a rerun; it finishes in at most 8 minutes).
#   on the device, from the repository root:   bash benchmarks/device_checks.sh
#   anywhere, CPU only (CI runs this):         bash benchmarks/device_checks.sh --dry-run
# Writes its figures as JSON and its logs under $OUT (default: out/device):
# 1. the CUDA tests: every test with a CUDA variant, the compiled Triton kernels among them
#    (parity with the torch path and brute force), -> cuda_tests.log;
# 2. benchmarks/gpu_targets.py: viterbi / fixed lag / log_partition fwd+bwd at B = 65,536,
#    T = 12, M = 32, Triton against the torch path, parity checked on the same inputs
#    -> gpu_targets.json;
# 3. benchmarks/serving.py on the device, 5,000-node graph, dense table, contexts precomputed:
#    the device step (step_slots(synchronize=False)) and its CUDA-graph replay at 4,096 and
#    65,536 sessions (the serving step's targets: 1 ms and 5 ms), and the synchronizing step
#    at 4,096 for comparison -> serving_device.log, serving_captured.log, serving_slots.log.
# Worst case (every timeout reached): 470 s.
# --dry-run: step 2 on tiny shapes with Triton's interpreter, step 3 on a small CPU graph; no
# timing from a dry run is a speed. Not yet run on a device when written (no device was lent).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"  # the device machine has python3 with torch; CI passes its venv
OUT="${OUT:-out/device}"
mkdir -p "$OUT"
failed=0
step() {  # step NAME TIMEOUT_S COMMAND...: run, log, remember a failure, go on
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "!! $name FAILED (rc $rc)"
        failed=1
    fi
}
if [ "${1:-}" = "--dry-run" ]; then
    export TRITON_INTERPRET=1
    step gpu_targets 120 "$PYTHON" benchmarks/gpu_targets.py --dry-run --out "$OUT/gpu_targets.json"
    step serving 120 "$PYTHON" benchmarks/serving.py --sessions 4 --nodes 300 --steps 2 --warmup 1 \
        --read contexts --distances dense --no-standalone --input device --precompute-contexts --turn-capacity 16
else
    "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use --dry-run')" || exit 2
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1
    step cuda_tests 150 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider tests
    step gpu_targets 110 "$PYTHON" benchmarks/gpu_targets.py --out "$OUT/gpu_targets.json"
    serving=(benchmarks/serving.py --device cuda --nodes 5000 --steps 10 --warmup 3 --read contexts --distances dense
             --no-standalone --precompute-contexts --turn-capacity 16)
    step serving_device 80 "$PYTHON" "${serving[@]}" --input device --sessions 4096 65536
    step serving_captured 80 "$PYTHON" "${serving[@]}" --input captured --sessions 4096 65536
    step serving_slots 50 "$PYTHON" "${serving[@]}" --input slots --sessions 4096
fi
echo "== done: $([ $failed -eq 0 ] && echo all passed || echo SOME FAILED); outputs in $OUT"
exit $failed
