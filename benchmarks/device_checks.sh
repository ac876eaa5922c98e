#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent device (about 15 minutes of
# device time per task: run it with a timeout that leaves room for a rerun).
#   run:  bash benchmarks/device_checks.sh        (on the device, from the repository root)
# 1. every CUDA variant of the test suite (parity with the standalone decoder on the device);
# 2. the serving step at 1024 and 4096 sessions on the device (issue target: 4096 in <= 2 ms
#    on an H200), contexts read after each step, the distance cache warm;
# 3. the same with the dense table on the device.
# Not run on a device yet when written (no device was lent); fix what breaks first.
set -uo pipefail
export PYTHONPATH=.
echo "== CUDA tests"
timeout 240 python -m pytest -q -m cuda -p no:cacheprovider tests || echo "CUDA TESTS FAILED (rc $?)"
echo "== serving, warm distance cache"
timeout 200 python benchmarks/serving.py --device cuda --sessions 1024 4096 --steps 10 --warmup 3 \
    --read contexts --no-standalone || echo "SERVING (cache) FAILED (rc $?)"
echo "== serving, dense table"
timeout 200 python benchmarks/serving.py --device cuda --sessions 4096 --steps 10 --warmup 3 \
    --read contexts --no-standalone --distances dense || echo "SERVING (dense) FAILED (rc $?)"
