#!/usr/bin/env bash
R=$OUT/r; mkdir -p $R
( timeout 100 python3 scratch/skinny_probe.py $R sweep > $R/probe.log 2>&1 )
echo "probe rc $?" >> $R/probe.log
cuobjdump -sass -fun skinny_n1_d16_ks2_w_bf16 $R/skinny.cubin 2>&1 | grep -E "LDG|HMMA|LDS|BAR|BRA" | awk '{print $2}' | head -150 | tr '\n' ' ' > $R/sass_w.txt
cuobjdump -sass -fun skinny_n1_d4_ks2_p_bf16 $R/skinny.cubin 2>&1 | grep -E "LDG|HMMA|LDS|BAR|BRA" | awk '{print $2}' | head -150 | tr '\n' ' ' > $R/sass_p.txt
SKIP_TESTS=1 SKIP_OPS=1 LADDER="smollm2_135m qwen3_5_9b" LADDER_HTTP="smollm2_135m" LADDER_OSL=1024 LADDER_REPS=3 \
  LADDER_CONC=1,2,4,8,16,32,64,128 timeout 470 bash perf/gpu_run.sh $R > $R/run.log 2>&1
tar czf $OUT/bundle.tgz -C $R . ; rm -rf $R
