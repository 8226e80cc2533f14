#!/usr/bin/env bash
R=$OUT/r; mkdir -p $R
SKIP_TESTS=1 SKIP_OPS=1 LADDER="smollm2_135m" LADDER_HTTP="smollm2_135m" LADDER_OSL=256 LADDER_REPS=3 \
  LADDER_CONC=1,2,4,8,16,32,64,128 timeout 150 bash perf/gpu_run.sh $R > $R/run.log 2>&1
mkdir -p $R/b; SKIP_TESTS=1 SKIP_OPS=1 LADDER="qwen3_5_27b" LADDER_HTTP="" LADDER_OSL=1024 LADDER_REPS=3 \
  LADDER_CONC=1 timeout 110 bash perf/gpu_run.sh $R/b > $R/run_b.log 2>&1
tar czf $OUT/bundle.tgz -C $R . ; rm -rf $R
