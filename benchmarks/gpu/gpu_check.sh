#!/usr/bin/env bash
# One prepared run for a GPU machine: Pallas correctness (compiled, not interpreted), then the
# benchmark sections of the RTX 3090 benchmark (grid up to 65,536 points, kde, peak, max_n up to
# 1,048,576 points, tiles, crossover), then KDE at a million points as a user runs it
# (`kde_million.py`: the CLI end to end, then the engine case of issue 41), within about 8
# minutes in all (a lease holds 15 minutes of device time, the machine's start included: the
# rest is for one rerun), then tables and a comparison with the RTX 3090 results
# (../shared/seed/kmv_benchmark_rtx3090.json, where it is found).
#
#   bash benchmarks/gpu/gpu_check.sh OUTDIR        # on the GPU machine, repo root
#   bash benchmarks/gpu/gpu_check.sh OUTDIR --dry  # the same steps on CPU, tiny sizes, after
#                                                  # pallas_lowering.py's pre-flight
#   GPU_CHECK_STEPS="check kde grid" bash benchmarks/gpu/gpu_check.sh OUTDIR
#
# GPU_CHECK_STEPS chooses the steps (default "check bench kde"): check (Pallas correctness),
# bench (kernel_mv.py's sections), kde (kde_million.py: the CLI, then the engine case), grid
# (kde_auto_grid.py, uniform and mixture, d = 2 and 8: prune True, False, "auto" and the xla
# path's rule).
#
# Writes to OUTDIR: pallas_check.json/.log, kernel_mv_gpu.json/.log (every section, rewritten
# after each one, so a cut run keeps what it measured), kde_million_gpu.json/.log (rewritten
# after each section), kde_auto_grid_gpu.json/.log (the grid step), tables.md, summary.txt,
# compare_rtx3090.md (when the RTX 3090 JSON is found); with --dry also
# pallas_lowering.json/.log. Exit status: 1 if the pre-flight (--dry)
# or the Pallas check failed or the benchmark did not write its JSON, else 0.
# Time: every step has a hard timeout; inside the benchmark each section has a budget
# (--section-budget) and configurations that do not fit are recorded as skipped.
# Where scalegp is not installed (the GPU machine has no package index), the working tree is
# staged under a temporary folder with cli/ as scalegp.cli and a `scalegp` command on PATH.
set -u

OUT=${1:?usage: bash benchmarks/gpu/gpu_check.sh OUTDIR [--dry]}
DRY=${2:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 1
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
command -v "$PY" >/dev/null || PY=python3
if ! "$PY" -c "import scalegp.cli" 2>/dev/null; then
  STAGE=$(mktemp -d)
  cp -r "$ROOT/scalegp" "$STAGE/scalegp" && cp -r "$ROOT/cli" "$STAGE/scalegp/cli"
  mkdir -p "$STAGE/bin"
  printf '#!/bin/sh\nexec %s -m scalegp "$@"\n' "$(command -v "$PY")" >"$STAGE/bin/scalegp"
  chmod +x "$STAGE/bin/scalegp"
  export PYTHONPATH="$STAGE:$PYTHONPATH" PATH="$STAGE/bin:$PATH"
fi
T0=$SECONDS
status=0
STEPS=" ${GPU_CHECK_STEPS:-check bench kde} "
check=skipped bench=skipped kde=skipped grid=skipped

if [ "$DRY" = "--dry" ]; then
  DEVICE=cpu
  CHECK_ARGS=(--device cpu --quick)
  BENCH_ARGS=(
    --sizes 256 512 --dims 2 8 --outs 1 4 --impls xla dense torch_chunked
    --kde-sizes 256 --kde-dims 2
    --peak-sizes 512 --peak-modes fwd fwd_bwd --peak-impls xla dense
    --ladder 256 512 --ladder-impls xla dense --ladder-timeout 60
    --tile-sizes 256 --tile-outs 4 --tile-impl xla --tiles 64,64 128,128
    --cross-sizes 128 --cross-shapes 8x4 --cross-impls dense xla --cross-rounds 2
    --ref-max-n 512 --repeats 3 --sample-budget-s 0.3 --timeout 120
  )
else
  DEVICE=gpu
  CHECK_ARGS=(--device gpu)
  BENCH_ARGS=(
    --sizes 1024 4096 16384 65536 --dims 8 32 --outs 1 16
    --impls pallas xla dense torch_dense torch_chunked pykeops
    --kde-sizes 16384 65536 --kde-dims 8
    --peak-sizes 16384 65536 --peak-modes fwd fwd_bwd --peak-impls pallas xla dense
    --ladder 16384 65536 262144 1048576 --ladder-impls pallas xla dense --ladder-timeout 60
    --tile-sizes 65536 --tile-outs 16 --tile-impl pallas
    --tiles 64,64,64 64,64,16 128,64,16 64,128,16 128,128,16 32,64,16
    --cross-sizes 1024 2048 --cross-shapes 8x16 --cross-impls xla pallas --cross-rounds 3
    --ref-max-n 4096 --repeats 5 --sample-budget-s 0.5 --timeout 60
  )
fi
BUDGETS=(grid=70 kde=15 peak=25 max_n=35 tiles=15 crossover=10)

if [ "$DRY" = "--dry" ] && [[ $STEPS == *" check "* ]]; then
  # The GPU path's Triton lowering (and, with `triton` installed, its compile for sm_90), which
  # interpret mode never reaches. Not on the GPU machine: its newer jaxlib lowers differently.
  echo "== pallas lowering for CUDA"
  timeout -k 10 300 "$PY" benchmarks/gpu/pallas_lowering.py --tiles 64,64,64 32,64,16 \
    --shapes 8x16 32x1 --out "$OUT/pallas_lowering.json" 2>&1 | tee "$OUT/pallas_lowering.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "pallas lowering failed"; status=1; }
fi

if [[ $STEPS == *" check "* ]]; then
  echo "== pallas check ($DEVICE)"
  timeout -k 10 150 "$PY" benchmarks/gpu/pallas_check.py "${CHECK_ARGS[@]}" \
    --out "$OUT/pallas_check.json" 2>&1 | tee "$OUT/pallas_check.log"
  check=${PIPESTATUS[0]}
  [ "$check" -eq 0 ] || { echo "pallas check: exit status $check"; status=1; }
fi

if [[ $STEPS == *" bench "* ]]; then
  echo "== benchmark sections ($DEVICE), $((SECONDS - T0)) s so far"
  timeout -k 10 195 "$PY" benchmarks/kernel_mv.py --device "$DEVICE" \
    --sections grid kde peak max_n tiles crossover \
    --max-total-s 175 --section-budget "${BUDGETS[@]}" "${BENCH_ARGS[@]}" \
    --out "$OUT/kernel_mv_$DEVICE.json" 2>&1 | tee "$OUT/kernel_mv_$DEVICE.log"
  bench=${PIPESTATUS[0]}
  [ "$bench" -eq 0 ] || echo "benchmark: exit status $bench (partial results are kept)"
  [ -s "$OUT/kernel_mv_$DEVICE.json" ] || status=1
fi

if [[ $STEPS == *" kde "* ]]; then
  echo "== kde at a million points ($DEVICE), $((SECONDS - T0)) s so far"
  KDE_ARGS=(--sections cli engine)
  [ "$DRY" = "--dry" ] && KDE_ARGS+=(--quick)
  timeout -k 10 "${KDE_TIMEOUT:-120}" "$PY" benchmarks/kde_million.py "${KDE_ARGS[@]}" \
    --out "$OUT/kde_million_$DEVICE.json" 2>&1 | tee "$OUT/kde_million_$DEVICE.log"
  kde=${PIPESTATUS[0]}
  [ "$kde" -eq 0 ] || echo "kde_million: exit status $kde (sections written before the cut are kept)"
fi

if [[ $STEPS == *" grid "* ]]; then
  echo "== prune=\"auto\" grid ($DEVICE), $((SECONDS - T0)) s so far"
  GRID_ARGS=(--dims 2 8 --layouts uniform mixture --repeats 3)
  [ "$DRY" = "--dry" ] && GRID_ARGS=(--quick)
  timeout -k 10 "${GRID_TIMEOUT:-240}" "$PY" benchmarks/kde_auto_grid.py --device "$DEVICE" \
    "${GRID_ARGS[@]}" --out "$OUT/kde_auto_grid_$DEVICE.json" 2>&1 \
    | tee "$OUT/kde_auto_grid_$DEVICE.log" >/dev/null
  grid=${PIPESTATUS[0]}
  tail -3 "$OUT/kde_auto_grid_$DEVICE.log"
  [ "$grid" -eq 0 ] || echo "kde_auto_grid: exit status $grid (problems written before the cut are kept)"
fi

if [ -s "$OUT/kernel_mv_$DEVICE.json" ]; then
  "$PY" benchmarks/report.py tables "$OUT/kernel_mv_$DEVICE.json" -o "$OUT/tables.md"
  for rtx3090 in "$ROOT/shared/seed/kmv_benchmark_rtx3090.json" \
                 "$ROOT/../shared/seed/kmv_benchmark_rtx3090.json"; do
    if [ -s "$rtx3090" ]; then
      "$PY" benchmarks/report.py compare "$OUT/kernel_mv_$DEVICE.json" "$rtx3090" \
        -o "$OUT/compare_rtx3090.md"
      break
    fi
  done
fi

{
  echo "gpu_check: device $DEVICE, $((SECONDS - T0)) s, pallas check exit $check," \
       "benchmark exit $bench, kde_million exit $kde, auto grid exit $grid"
  ls -l "$OUT"
} | tee "$OUT/summary.txt"
exit $status
