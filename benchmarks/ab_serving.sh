#!/bin/bash
# A/B serving latency: a base commit and the working tree, alternately, same command.
#
#   bash benchmarks/ab_serving.sh BASE_REF ROUNDS [serving.py flags...]
#   bash benchmarks/ab_serving.sh HEAD 2 --sessions 1024 --input slots --distances dense
#
# The base is checked out as a temporary git worktree (removed afterwards) and run with
# the same interpreter; each round runs the base, then the working tree. On a VM whose
# speed drifts, compare within a round.
set -euo pipefail
base_ref=$1 rounds=$2
shift 2
root=$(git rev-parse --show-toplevel)
python=${PYTHON:-$root/.venv/bin/python}
base=$(mktemp -d)
git -C "$root" worktree add -q --detach "$base" "$base_ref"
trap 'git -C "$root" worktree remove --force "$base"' EXIT
for round in $(seq "$rounds"); do
  for tree in "$base" "$root"; do
    label=$([ "$tree" = "$base" ] && echo "base $base_ref" || echo "working tree")
    echo "== round $round: $label"
    (cd "$tree" && OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$tree" "$python" benchmarks/serving.py --no-standalone "$@" | tail -1)
  done
done
