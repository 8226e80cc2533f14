#!/usr/bin/env bash
# The one script run on the GPU machine (H200): build, GPU tests, benchmarks; logs + JSON to a folder.
#
#   perf/gpu_run.sh [OUTDIR]        (OUTDIR defaults to $OUT, else perf/results/gpu_<date>)
#   QUICK=1 perf/gpu_run.sh ...     shorter benchmark sweep
#   PYTEST_ARGS="-k attention" ...  a subset of the GPU tests
#   PYTEST_FILES="tests/test_gpu_models.py" ...  other test files (default: test_launch, test_cuda_*, test_gpu_*)
#   PROFILE="qwen3_5_9b:1,64 ..."  per-kernel decode profiles (perf/decode_profile.py) first
#   SKIP_TESTS=1 ...  no GPU tests
#   BUNDLE=1 ...  pack everything under OUTDIR into OUTDIR/bundle.tgz (the device returns 8 files)
#   MOE_BENCH=1 / GEMM_BENCH=1 / PDL_BENCH=1 ...  with SKIP_OPS: just the MoE / decode-GEMM op
#     benchmarks / the GEMM chains with PDL off and on (perf/pdl_chain.py; PDL_TS="1,4" picks t)
#   GEMM_NCU=1 ...  with SKIP_OPS: Nsight Compute counters of the 9B decode GEMMs (perf/gemm_ncu.py)
#   LADDER_ARGS="--prefill-graphs on" ...  extra perf/ladder.py arguments for every ladder
#   GREEDY_BATCH=/path/smollm2.gguf ...  greedy alone vs in a batch of 64 (perf/greedy_batch.py)
#   LM_HEAD_COST=1 ...  the lm head with a bf16 vs an fp32 store at decode shapes (perf/lm_head_cost.py)
#   QUANT_BENCH=1 ...  FP8 / NVFP4 projections against bf16 on the 9B / 27B shapes (perf/quant_gemv.py)
#   LADDER="qwen3_5_9b qwen3_5_9b:fp8 qwen3_5_9b:nvfp4" ...  a ladder entry may name its weights
#   SPEC_MECH="qwen3_5_9b" SPEC_CONC=1,8 SPEC_DRAFTS=3 SPEC_P=0,0.8,1 ...  speculative decoding at
#     controlled acceptance (SPEC_DRAFTER=mtp: the shape's MTP head drafts; SPEC_ADAPTIVE=0,1); SPEC_REAL=1
#     (with SMOLLM2_GGUF) prompt lookup / n-gram on SmolLM2
#
# Wheels the GPU image lacks (pyzmq, falcon, gunicorn, orjson) are installed from ./.whl when it
# exists (fetch them beforehand with ../shared/tools/gpu-wheels.sh from the project root).
set -uo pipefail
cd "$(dirname "$0")/.."
# the commit the results are labelled with: from the caller's checkout (the device's copy of the
# tree carries a stale .git, so `git rev-parse` there names the wrong commit)
if [ -z "${GIT_COMMIT:-}" ]; then
  echo "gpu_run.sh: set GIT_COMMIT to the checkout's commit (git rev-parse HEAD where you edit)"; exit 2
fi
export GIT_COMMIT
OUTDIR="${1:-${OUT:-perf/results/gpu_$(date +%Y%m%d_%H%M%S)}}"
mkdir -p "$OUTDIR"
PY="${PYTHON:-python3}"
status=0

if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUTDIR/wheels.log" 2>&1 && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}" || { echo "wheel install failed"; status=1; }
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"

# the Cython hot loop, built in place for this Python (no dependency resolution: the image has them)
if ! "$PY" setup.py build_ext --inplace > "$OUTDIR/build.log" 2>&1; then
  "$PY" -m pip install -e . --no-build-isolation --no-deps >> "$OUTDIR/build.log" 2>&1 || { echo "build failed (see build.log)"; status=1; }
fi

{ echo "GIT_COMMIT=$GIT_COMMIT"; nvidia-smi; nvcc --version; "$PY" -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"; } \
  > "$OUTDIR/env.txt" 2>&1

for spec in ${PROFILE:-}; do
  echo "== decode profile $spec"
  "$PY" perf/decode_profile.py --shape "${spec%%:*}" --batch "${spec#*:}" --out "$OUTDIR" 2>&1 \
    | tee "$OUTDIR/profile_${spec%%:*}.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

if [ -n "${GREEDY_BATCH:-}" ]; then
  echo "== greedy alone vs batch of 64"
  "$PY" perf/greedy_batch.py --model "$GREEDY_BATCH" --out "$OUTDIR" --label "${GREEDY_LABEL:-}" 2>&1 \
    | tee "$OUTDIR/greedy_batch.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -n "${LM_HEAD_COST:-}" ]; then
  echo "== lm head bf16 vs fp32 logits"
  "$PY" perf/lm_head_cost.py --out "$OUTDIR" 2>&1 | tee "$OUTDIR/lm_head_cost.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${QUANT_BENCH:-}" ]; then
  echo "== FP8 / NVFP4 projections"
  "$PY" perf/quant_gemv.py --out "$OUTDIR" ${QUICK:+--quick} 2>&1 | tee "$OUTDIR/quant_gemv.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -z "${SKIP_TESTS:-}" ]; then
echo "== GPU tests"
"$PY" -m pytest -m gpu -q -rfEs --timeout 1200 ${PYTEST_ARGS:-} ${PYTEST_FILES:-tests/test_launch.py tests/test_cuda_*.py tests/test_gpu_*.py} 2>&1 | tee "$OUTDIR/pytest_gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -z "${SKIP_OPS:-}" ]; then
echo "== kernel resources (sm_90)"
"$PY" -m pytest -q -s tests/test_kernels_compile.py 2>&1 | tee "$OUTDIR/kernels_compile.log" | tail -n 5
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== op benchmarks"
"$PY" perf/bench_ops.py --out "$OUTDIR" ${QUICK:+--quick} 2>&1 | tee "$OUTDIR/bench_ops.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

else
if [ -n "${MOE_BENCH:-}" ]; then
echo "== MoE op benchmark"
"$PY" perf/bench_ops.py --out "$OUTDIR" --moe-only 2>&1 | tee "$OUTDIR/bench_moe.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -n "${PDL_BENCH:-}" ]; then
echo "== decode GEMMs in a chain, PDL off / on"
"$PY" perf/pdl_chain.py --out "$OUTDIR" ${PDL_TS:+--ts $PDL_TS} 2>&1 | tee "$OUTDIR/pdl_chain.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ -n "${GEMM_NCU:-}" ]; then
echo "== decode GEMM counters (ncu)"
ncu --clock-control none --target-processes all --profile-from-start off --csv \
  --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,gpc__cycles_elapsed.max,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers \
  "$PY" perf/gemm_ncu.py > "$OUTDIR/gemm_ncu.csv" 2> "$OUTDIR/gemm_ncu.log"
[ $? -eq 0 ] || status=1
fi
if [ -n "${GEMM_BENCH:-}" ]; then
echo "== decode GEMM benchmark"
"$PY" perf/bench_ops.py --out "$OUTDIR" --gemm-only 2>&1 | tee "$OUTDIR/bench_gemm.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
fi

# speculative decoding (perf/spec_bench.py): SPEC_MECH="qwen3_5_9b ..." controlled acceptance
# (SPEC_CONC, SPEC_DRAFTS, SPEC_P), SPEC_REAL=1 prompt lookup / n-gram on the real SmolLM2
for shape in ${SPEC_MECH:-}; do
  echo "== speculative mechanics $shape"
  "$PY" perf/spec_bench.py --part mechanics --shape "$shape" --conc "${SPEC_CONC:-1,8,32,64}" \
    --drafts "${SPEC_DRAFTS:-3}" --p "${SPEC_P:-0,0.8,1}" --osl "${LADDER_OSL:-256}" --out "$OUTDIR" \
    --drafter "${SPEC_DRAFTER:-replay}" --adaptive "${SPEC_ADAPTIVE:-0,1}" 2>&1 \
    | tee "$OUTDIR/spec_mech_$shape.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
if [ -n "${SPEC_REAL:-}" ]; then
  echo "== speculative decoding on the real SmolLM2"
  "$PY" perf/spec_bench.py --part real --model "${SMOLLM2_GGUF:?SPEC_REAL needs SMOLLM2_GGUF}" --out "$OUTDIR" ${SPEC_PROFILE:+--profile} 2>&1 \
    | tee "$OUTDIR/spec_real.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

# the concurrency ladder, engine-only (perf/ladder.py); LADDER="" skips it
for spec in ${LADDER-smollm2_135m qwen3_5_9b qwen3_5_27b qwen3_5_35b_a3b}; do
  shape="${spec%%:*}"; weights=bf16; [ "$spec" != "$shape" ] && weights="${spec#*:}"
  echo "== ladder $shape ($weights)"
  "$PY" perf/ladder.py --shape "$shape" --weights "$weights" --osl "${LADDER_OSL:-256}" --conc "${LADDER_CONC:-1,2,4,8,16,32,64,128}" \
    --reps "${LADDER_REPS:-3}" --out "$OUTDIR" ${LADDER_ARGS:-} 2>&1 | tee "$OUTDIR/ladder_${shape}_$weights.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

# the same ladder through met serve --load-format dummy and streaming HTTP clients
for shape in ${LADDER_HTTP-smollm2_135m qwen3_5_9b}; do
  echo "== http ladder $shape"
  "$PY" perf/ladder.py --http --shape "$shape" --osl "${LADDER_OSL:-256}" --conc "${LADDER_CONC:-1,2,4,8,16,32,64,128}" \
    --reps "${LADDER_REPS:-3}" --out "$OUTDIR" ${LADDER_ARGS:-} 2>&1 | tee "$OUTDIR/ladder_http_$shape.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

if [ -n "${BUNDLE:-}" ]; then
  tar czf /tmp/bundle.tgz -C "$OUTDIR" . && find "$OUTDIR" -type f -delete && mv /tmp/bundle.tgz "$OUTDIR/"
fi
echo "gpu_run.sh: status $status, logs in $OUTDIR"
exit $status
