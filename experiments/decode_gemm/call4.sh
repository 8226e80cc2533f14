#!/usr/bin/env bash
R=$OUT/r; mkdir -p $R
( timeout 90 python3 scratch/skinny_probe.py $R sweep > $R/probe.log 2>&1 )
echo "probe rc $?" >> $R/probe.log
for spec in $(python3 - $R <<'PY'
import json,sys
try:
    d=json.load(open(sys.argv[1]+'/skinny_probe.json'))
except Exception:
    sys.exit(0)
for r in d['rows']:
    if r['n']==4096 and r['t'] in (8,) and r['best']:
        print(f"4096:12288:{r['t']}:"+",".join(str(v) for v in r['best'][0][1]))
PY
); do
  timeout 60 ncu --clock-control none --kernel-name regex:tma --launch-skip 2 --launch-count 1 \
     --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
     --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,l1tex__t_sector_hit_rate.pct,lts__t_sector_hit_rate.pct \
     python3 scratch/skinny_probe.py $R "ncu:$spec" >> $R/ncu.log 2>&1
done
SKIP_TESTS=1 SKIP_OPS=1 LADDER="" LADDER_HTTP="qwen3_5_9b" LADDER_OSL=1024 LADDER_REPS=3 \
  LADDER_CONC=1,2,4,8,16,32,64,128 timeout 340 bash perf/gpu_run.sh $R > $R/run.log 2>&1
tar czf $OUT/bundle.tgz -C $R . ; rm -rf $R
