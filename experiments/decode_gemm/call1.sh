#!/usr/bin/env bash
# scratch: session 4 call 1
R=$OUT/r; mkdir -p $R
export GIT_COMMIT=$1
( timeout 120 python3 scratch/skinny_probe.py $R sweep > $R/probe.log 2>&1 ) 
echo "probe rc $?" >> $R/probe.log
# ncu on two configs
for spec in "$2" "$3"; do
  [ -z "$spec" ] && continue
  timeout 90 ncu --clock-control none --kernel-name regex:skinny --launch-skip 2 --launch-count 1 \
     --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section SchedulerStats --section LaunchStats \
     python3 scratch/skinny_probe.py $R "ncu:$spec" >> $R/ncu.log 2>&1
done
SKIP_OPS=1 LADDER="" LADDER_HTTP="" PYTEST_FILES="tests/test_warmup.py tests/test_cuda_sampling.py tests/test_engine_publish.py" \
  timeout 200 bash perf/gpu_run.sh $R > $R/run.log 2>&1
timeout 90 python3 perf/step_jitter.py --shape smollm2_135m --out $R > $R/jitter.log 2>&1
tar czf $OUT/bundle.tgz -C $R . ; rm -rf $R
