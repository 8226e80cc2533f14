#!/usr/bin/env bash
R=$OUT/r; mkdir -p $R
( timeout 150 python3 scratch/skinny_probe.py $R sweep > $R/probe.log 2>&1 )
echo "probe rc $?" >> $R/probe.log
for spec in $(python3 - $R <<'PY'
import json,sys
d=json.load(open(sys.argv[1]+'/skinny_probe.json'))
for r in d['rows']:
    if r['n']==4096 and r['t'] in (8,64) and r['best']:
        print(f"4096:12288:{r['t']}:"+",".join(str(v) for v in r['best'][0][1]))
PY
); do
  timeout 90 ncu --clock-control none --kernel-name regex:skinny --launch-skip 2 --launch-count 1 \
     --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
     --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__warps_active.avg.per_cycle_active,l1tex__t_sector_hit_rate.pct,lts__t_sector_hit_rate.pct \
     python3 scratch/skinny_probe.py $R "ncu:$spec" >> $R/ncu.log 2>&1
done
tar czf $OUT/bundle.tgz -C $R . ; rm -rf $R
