#!/bin/bash
# Interleaved A/B of two revisions, each measured with its own benchmark scripts.
#
#   bash benchmarks/ab_revisions.sh BEFORE_REV AFTER_REV [ROUNDS]     (outputs in /tmp/ab-revisions)
#
# Makes a detached git worktree per revision (/tmp/ab-revisions/{before,after}), then for
# each round runs, before then after: benchmarks/decode.py --quick --batches 1024, the
# serving step at 1,024 sessions, and a 400-conversation synthetic eval (the nine
# methods both revisions have; its report's "timings" hold the phases). Run it on an
# idle machine: under load the rounds measure the load.
set -euo pipefail
BEFORE=$1; AFTER=$2; ROUNDS=${3:-3}
PY=${PYTHON:-python}
OUT=/tmp/ab-revisions; mkdir -p $OUT
for side in before after; do
  rev=$BEFORE; [ $side = after ] && rev=$AFTER
  [ -d $OUT/$side ] || git worktree add -q --detach $OUT/$side $rev
done
METHODS=pointwise,map-matched,history-concatenation,maximal-marginal-relevance,resolved-query-oracle,geodesic,fitted,gated,mixed
for round in $(seq 1 $ROUNDS); do
  for side in before after; do
    cd $OUT/$side
    export PYTHONPATH=$OUT/$side
    $PY benchmarks/decode.py --quick --batches 1024 --standalone 1 > $OUT/decode_${side}_$round.txt 2>&1
    $PY benchmarks/serving.py --sessions 1024 --steps 10 --no-standalone > $OUT/serving_${side}_$round.txt 2>&1
    $PY -m mapmatched_torch eval --conversations 400 --methods $METHODS --bootstrap 200 \
        --json $OUT/eval_${side}_$round.json > $OUT/eval_${side}_$round.txt 2>&1
  done
done
echo "outputs in $OUT"
