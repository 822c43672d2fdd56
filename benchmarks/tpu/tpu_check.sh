#!/usr/bin/env bash
# One prepared run for a TPU machine: the Mosaic backend compiled (correctness against float64,
# the chip's exp/log and split products, the speeds of issue 60 beside xla, expressions, the
# 1,048,576² forward, the memory analysis, the pruned kernels: benchmarks/tpu/mosaic_check.py,
# about 8 minutes),
# then, where asked, the seed's benchmark sections through benchmarks/kernel_mv.py (about 4
# minutes: a call of its own). Where
# scalegp's dependencies are missing, scikit-learn and typer come from the machine's own index.
#
#   bash benchmarks/tpu/tpu_check.sh OUTDIR                        # on the TPU machine, repo root
#   TPU_CHECK_STEPS=bench bash benchmarks/tpu/tpu_check.sh OUTDIR  # the seed's sections
#   TPU_CHECK_SECTIONS="check speed" bash benchmarks/tpu/tpu_check.sh OUTDIR   # mosaic_check's
#   TPU_CHECK_ARGS=--sweep bash benchmarks/tpu/tpu_check.sh OUTDIR      # with the tile sweep
#   TPU_CHECK_STEPS="tests" TPU_CHECK_TESTS=tests/ops/backends/mosaic/test_pruned.py \
#     bash benchmarks/tpu/tpu_check.sh OUTDIR            # the backend's tests, compiled
#   TPU_CHECK_STEPS=kde bash benchmarks/tpu/tpu_check.sh OUTDIR   # the KDE end to end (issue 61)
#   TPU_CHECK_STEPS=gp TPU_GP_SIZES="2000 10000" bash benchmarks/tpu/tpu_check.sh OUTDIR
#                                                 # the GP's compile times, fits end to end (62)
#   TPU_CHECK_STEPS=gp_million bash benchmarks/tpu/tpu_check.sh OUTDIR
#                     # the GP on 10^6 points, and 10^6 rows' predictions (a call of its own)
#   TPU_CHECK_STEPS=paired TPU_PAIRED_BEFORE=tmpcall/before bash benchmarks/tpu/tpu_check.sh OUTDIR
#                     # this tree against another (a folder holding its scalegp), alternating
#
# Writes OUTDIR/mosaic_check.json (rewritten after every case) and .log; with the tests step
# tests.log; with the bench step kernel_mv_tpu.json, .log and tables.md; with the kde step
# kde_million_tpu.json and .log; with the gp step compile_times_tpu.json and gp_scale_tpu_N.json
# per size, co2_fit.log (the quick start's GP fit by the command line, timed), and their logs;
# with the gp_million step gp_million_tpu.json and .log; with the paired step paired_trees.json.
# Exit status: 1 when a correctness case fails its bound, a test fails, a command fails, or a
# benchmark wrote no JSON.
set -u
OUT=${1:?usage: bash benchmarks/tpu/tpu_check.sh OUTDIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ! "$PY" -c "import sklearn, typer" 2>/dev/null; then
  SITE=$(mktemp -d)
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --isolated --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target "$SITE" scikit-learn typer >/dev/null 2>&1 \
    || echo "could not install scikit-learn and typer (the engine's checks need neither)"
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
set -o pipefail
STEPS=" ${TPU_CHECK_STEPS:-check} "
status=0

if [[ $STEPS == *" check "* ]]; then
  timeout -k 10 "${TPU_CHECK_TIMEOUT:-520}" "$PY" benchmarks/tpu/mosaic_check.py \
    --sections ${TPU_CHECK_SECTIONS:-names probe check check_expression speed speed_expression \
    million memory pruned} \
    ${TPU_CHECK_ARGS:-} --out "$OUT/mosaic_check.json" 2>&1 | tee "$OUT/mosaic_check.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ $STEPS == *" tests "* ]]; then
  # the Mosaic backend's tests, compiled on the chip (one process: one program holds the chip)
  timeout -k 10 "${TPU_TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider \
    --tb=short -m "${TPU_TESTS_MARK:-slow or not slow}" ${TPU_CHECK_TESTS:-tests/ops/backends/mosaic} 2>&1 \
    | tee "$OUT/tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [[ $STEPS == *" bench "* ]]; then
  # the seed's sections that fit one call (benchmarks/results/kernel_mv_tpu_v5e.json); one child
  # per section, and a configuration costs 10-25 s of compilation on the chip: tiles, peak and
  # crossover need a call of their own (TPU_BENCH_SECTIONS)
  timeout -k 10 "${TPU_BENCH_TIMEOUT:-380}" "$PY" benchmarks/kernel_mv.py --device tpu \
    --sections ${TPU_BENCH_SECTIONS:-grid kde max_n} --max-total-s 330 \
    --section-budget grid=110 kde=90 max_n=120 tiles=120 crossover=90 peak=90 \
    --sizes 65536 --dims 8 --outs 16 --impls pallas xla \
    --kde-sizes 65536 --kde-dims 2 --peak-sizes 65536 --peak-modes fwd_bwd \
    --peak-impls pallas xla --ladder 262144 1048576 --ladder-impls pallas \
    --ladder-timeout 60 --tile-sizes 65536 --tile-outs 16 \
    --tiles 512,1024,64 1024,2048,64 256,1024,64 --cross-sizes 1024 2048 --cross-shapes 8x16 \
    --cross-impls xla pallas --cross-rounds 3 --ref-max-n 16384 --repeats 5 \
    --sample-budget-s 0.5 --timeout 60 --out "$OUT/kernel_mv_tpu.json" 2>&1 \
    | tee "$OUT/kernel_mv_tpu.log"
  if [ -s "$OUT/kernel_mv_tpu.json" ]; then
    "$PY" benchmarks/report.py tables "$OUT/kernel_mv_tpu.json" -o "$OUT/tables.md"
  else
    status=1
  fi
fi
# The command line is scalegp.cli, which only an install maps from cli/: a staged copy of the
# package holds it, with a `scalegp` command on PATH (`stage_cli`; then run under
# PYTHONPATH="$STAGE:$PYTHONPATH" PATH="$STAGE/bin:$PATH").
stage_cli() {
  STAGE=$(mktemp -d)
  cp -r scalegp "$STAGE/" && cp -r cli "$STAGE/scalegp/cli" && mkdir -p "$STAGE/bin"
  printf '#!/usr/bin/env bash\nexec %s -m scalegp "$@"\n' "$PY" > "$STAGE/bin/scalegp"
  chmod +x "$STAGE/bin/scalegp"
}

if [[ $STEPS == *" kde "* ]]; then
  # benchmarks/kde_million.py on the chip: the command line on 10^6 points (a first run, then
  # one on the compilation cache it filled), the cv bandwidth there and on the host CPU, the
  # estimator at 10^7 points and at d 8.
  stage_cli
  PYTHONPATH="$STAGE:$PYTHONPATH" PATH="$STAGE/bin:$PATH" timeout -k 10 \
    "${TPU_KDE_TIMEOUT:-560}" "$PY" benchmarks/kde_million.py \
    --sections ${TPU_KDE_SECTIONS:-cli bandwidth scale} --cli-warm \
    --check-rows "${TPU_KDE_CHECK_ROWS:-200}" ${TPU_KDE_ARGS:-} \
    --out "$OUT/kde_million_tpu.json" 2>&1 | tee "$OUT/kde_million_tpu.log"
  [ -s "$OUT/kde_million_tpu.json" ] || status=1
fi
if [[ $STEPS == *" gp "* ]]; then
  # The GP on the chip (issue 62): ScalableGPRegressor end to end at each size
  # (benchmarks/gp_scale.py, a child per fit; fitted twice in it, so that refit_s shows the time
  # without compilation; a child past twice TPU_GP_BUDGET becomes an error row), then each
  # program's compile seconds (benchmarks/tpu/compile_times.py).
  for n in ${TPU_GP_SIZES:-2000 10000}; do  # "none": no fits
    [ "$n" = none ] && continue
    timeout -k 10 "${TPU_GP_TIMEOUT:-300}" "$PY" benchmarks/gp_scale.py --n "$n" --skip-peers \
      --refit --budget "${TPU_GP_BUDGET:-140}" ${TPU_GP_ARGS:-} \
      --out "$OUT/gp_scale_tpu_$n.json" 2>&1 | tee "$OUT/gp_scale_tpu_$n.log"
    [ -s "$OUT/gp_scale_tpu_$n.json" ] || status=1
  done
  if [ "${TPU_GP_CO2:-1}" = 1 ]; then
    # the quick start's GP: the command line's fit of the Mauna Loa CO2 record, timed whole
    stage_cli
    start=$(date +%s.%N)
    # from the stage: `python -m scalegp` in the tree would import the tree's package first
    (cd "$STAGE" && PYTHONPATH="$STAGE:$PYTHONPATH" PATH="$STAGE/bin:$PATH" timeout -k 10 \
      "${TPU_GP_CO2_TIMEOUT:-200}" scalegp gp fit "$ROOT/examples/data/co2_weekly.csv" \
      --target co2 --test-size 0.2 --model "$OUT/co2_gp.npz" --force > "$OUT/co2_fit.log" 2>&1)
    rc=$?
    echo "co2 fit: exit $rc, $("$PY" -c "import time; print(round(time.time() - $start, 1))") s" \
      | tee -a "$OUT/co2_fit.log"
    [ $rc -eq 0 ] || status=1
  fi
  timeout -k 10 "${TPU_GP_COMPILE_TIMEOUT:-240}" "$PY" benchmarks/tpu/compile_times.py \
    --sections gp --gp-n ${TPU_GP_COMPILE_N:-10000} --out "$OUT/compile_times_tpu.json" 2>&1 \
    | tee "$OUT/compile_times_tpu.log"
  [ -s "$OUT/compile_times_tpu.json" ] || status=1
fi
if [[ $STEPS == *" gp_million "* ]]; then
  # issue 62's largest case: one fit of 10^6 points and the mean and standard deviation of 10^6
  # test rows, in this process (benchmarks/tpu/gp_million.py rewrites its JSON after each phase,
  # so a run cut short keeps what it measured); about 5.5 minutes on a v5e
  timeout -k 10 "${TPU_GP_MILLION_TIMEOUT:-540}" "$PY" benchmarks/tpu/gp_million.py \
    --n 1000000 --num-test 1000000 --paired-rows 65536 ${TPU_GP_MILLION_ARGS:-} \
    --out "$OUT/gp_million_tpu.json" 2>&1 | tee "$OUT/gp_million_tpu.log"
  [ -s "$OUT/gp_million_tpu.json" ] || status=1
fi
if [[ $STEPS == *" paired "* ]]; then
  # K v forward and backward, and a 1,024-column product, in fresh processes alternating
  # between the two trees (benchmarks/tpu/paired_trees.py: 12 processes at its defaults)
  timeout -k 10 "${TPU_PAIRED_TIMEOUT:-420}" "$PY" benchmarks/tpu/paired_trees.py     --trees "before=${TPU_PAIRED_BEFORE:?set TPU_PAIRED_BEFORE}" "after=$ROOT"     ${TPU_PAIRED_ARGS:-} --out "$OUT/paired_trees.json" 2>&1 | tee "$OUT/paired_trees.log"
  [ -s "$OUT/paired_trees.json" ] || status=1
fi
exit $status
