#!/usr/bin/env bash
# The committed full CPU run, in five parts with hard time budgets (7,000 s in all; the committed
# run took 5,214 s on 2 cores), merged into one JSON:
#
#   bash benchmarks/cpu_full.sh [OUT.json]     # default benchmarks/results/kernel_mv_cpu_full.json
#
#  part1   grid at 1,024 / 4,096 / 16,384 points, d 2 8 32, o 1 16, fwd and fwd_bwd, ours and
#          every peer;
#  part2a  grid at 65,536 for the memory-linear paths: xla and numpy_chunked at every d and o;
#  part2b  the same for torch_chunked and pykeops at d = 8 only (minutes per call there);
#  part3   peak memory at 4,096 / 16,384 / 65,536, and the max_n ladders;
#  part4   kde, tiles, crossover.
# A configuration that does not fit its part's budget is recorded as skipped, not dropped.
# Parts are written to a temporary folder and removed once merged into OUT (which keeps each
# part's options under config.runs); if the merge fails they are kept there, and the script says
# where, so a cut run can be merged by hand (python benchmarks/report.py merge ...). Run it on an
# idle machine: see benchmarks/README.md.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${1:-benchmarks/results/kernel_mv_cpu_full.json}
PY=${PYTHON:-python}
COMMON=(--device cpu --preset full --repeats 5 --sample-budget-s 5)
PARTS=$(mktemp -d "${TMPDIR:-/tmp}/cpu_full.XXXXXX")
parts=()

part() {  # part NAME ARGS...: run one part, remember its JSON
  local name=$1; shift
  local json="$PARTS/$(basename "${OUT%.json}").$name.json"
  echo "== $name: $*"
  "$PY" benchmarks/kernel_mv.py "${COMMON[@]}" "$@" --out "$json" && parts+=("$json")
}

part part1 --sections grid --sizes 16384 4096 1024 --dims 8 2 32 --outs 16 1 \
  --timeout 300 --max-total-s 2700
part part2a --sections grid --sizes 65536 --dims 8 2 32 --outs 16 1 \
  --impls xla numpy_chunked --timeout 300 --max-total-s 900
part part2b --sections grid --sizes 65536 --dims 8 --outs 16 1 \
  --impls torch_chunked pykeops --timeout 300 --max-total-s 700
part part3 --sections peak max_n --peak-sizes 4096 16384 65536 --timeout 300 \
  --ladder-timeout 300 --max-total-s 1500 --section-budget peak=600 max_n=900
part part4 --sections kde tiles crossover --kde-sizes 1024 4096 16384 65536 --timeout 300 \
  --max-total-s 1200 --section-budget kde=800 tiles=250 crossover=150

[ ${#parts[@]} -gt 0 ] || { echo "no part wrote its JSON"; rm -rf "$PARTS"; exit 1; }
if "$PY" benchmarks/report.py merge "${parts[@]}" -o "$OUT"; then
  rm -rf "$PARTS"
else
  echo "merge failed; the parts are in $PARTS"
  exit 1
fi
