#!/usr/bin/env bash
# Graph replays with programmatic edges against plain stream order, counted (kernels_cuda/README.md,
# "Programmatic dependent launch"): each variant runs tests/test_launch.py::test_pdl_chain_* and
# the serve-like step-graph test with METRALE_PDL=1, REPS times, and counts failures; variant
# "default" also runs the 35B-A3B warm-up + C=1 ladder rungs. This is how the non-coherent-load
# race was found (2026-11-30): trigger at entry with ld.global.nc activation loads failed 3/6
# chain runs and 2/2 serving runs; with coherent loads 0/6 and 0/2.
#
#   GIT_COMMIT=<hash> perf/pdl_race.sh [OUTDIR]      (REPS=3 by default)
#
# Variants (kernel sources copied to /tmp and edited there, selected with METRALE_KERNELS_DIR):
#   default   the tree as is (MT_PDL_TRIGGER 1: trigger at entry)
#   trig0     MT_PDL_TRIGGER 0 (no explicit trigger: a successor starts as the last CTA exits)
#   trig3     MT_PDL_TRIGGER 3 (trigger at the end of each entry point, after its stores)
#   blas      the default with METRALE_GEMM_TUNE=0 (every GEMM a cuBLAS call, no GEMV)
# Writes OUTDIR/pdl_race.json: {variant: {chain_failed, chain_passed, serve_failed, ...}}.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -n "${GIT_COMMIT:-}" ] || { echo "set GIT_COMMIT"; exit 2; }
OUTDIR="${1:-${OUT:-perf/results/pdl_race_$(date +%Y%m%d_%H%M%S)}}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
REPS="${REPS:-3}"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > "$OUTDIR/wheels.log" 2>&1
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
"$PY" setup.py build_ext --inplace > "$OUTDIR/build.log" 2>&1

variant_dir() {   # $1 variant -> a kernels dir
  local d=/tmp/pdl_kernels_$1
  rm -rf "$d"; cp -r kernels_cuda "$d"
  case $1 in
    trig0) sed -i 's/^#define MT_PDL_TRIGGER [0-9]$/#define MT_PDL_TRIGGER 0/' "$d/common.cuh" ;;
    trig3) sed -i 's/^#define MT_PDL_TRIGGER [0-9]$/#define MT_PDL_TRIGGER 3/' "$d/common.cuh" ;;
  esac
  echo "$d"
}

count() {   # $1 failed|passed, $2 a pytest log -> the number in its summary line (0 if none)
  local n; n=$(tail -n 3 "$2" | grep -o "[0-9]* $1" | head -1 | grep -o "[0-9]*"); echo "${n:-0}"
}

summary="{"
for v in ${VARIANTS:-default trig0 trig3 blas}; do
  kd=$(variant_dir "$v")
  want=1; [ "$v" = trig0 ] && want=0; [ "$v" = trig3 ] && want=3
  grep -q "^#define MT_PDL_TRIGGER $want\$" "$kd/common.cuh" || echo "variant $v: trigger edit failed"
  extra=""; [ "$v" = blas ] && extra="METRALE_GEMM_TUNE=0"
  cf=0; cp=0
  for i in $(seq "$REPS"); do
    env METRALE_PDL=1 METRALE_KERNELS_DIR="$kd" $extra "$PY" -m pytest -m gpu -q -p no:cacheprovider --runxfail \
      tests/test_launch.py -k pdl_chain > "$OUTDIR/${v}_chain_$i.log" 2>&1
    cf=$((cf + $(count failed "$OUTDIR/${v}_chain_$i.log"))); cp=$((cp + $(count passed "$OUTDIR/${v}_chain_$i.log")))
  done
  env METRALE_PDL=1 METRALE_KERNELS_DIR="$kd" $extra "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    tests/test_gpu_step_graphs.py -k serve_like > "$OUTDIR/${v}_serve.log" 2>&1
  sf=$(count failed "$OUTDIR/${v}_serve.log"); sp=$(count passed "$OUTDIR/${v}_serve.log")
  moe="null"
  if [ "$v" = default ]; then
    env METRALE_PDL=1 METRALE_KERNELS_DIR="$kd" timeout 120 "$PY" perf/ladder.py --shape qwen3_5_35b_a3b --osl 64 --conc 1 \
      --reps 1 --out "$OUTDIR/ladder_$v" > "$OUTDIR/${v}_35b.log" 2>&1 && moe='"ok"' || moe='"failed"'
  fi
  echo "$v: chain failed $cf passed $cp; serve-like failed $sf passed $sp; 35B $moe"
  summary="$summary\"$v\": {\"chain_failed\": $cf, \"chain_passed\": $cp, \"serve_failed\": $sf, \"serve_passed\": $sp, \"moe_35b\": $moe},"
done
echo "${summary%,}, \"commit\": \"$GIT_COMMIT\", \"reps\": $REPS}" > "$OUTDIR/pdl_race.json"
cat "$OUTDIR/pdl_race.json"
