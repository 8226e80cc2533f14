#!/usr/bin/env bash
# next: the persistent / dynamic-unit TMA kernel (tma_dyn.cu) against cuBLAS and the static TMA ring
# run from the repository root with this branch checked out:  bash experiments/decode_gemm/call7.sh
R=$OUT/r; mkdir -p $R
( timeout 100 python3 experiments/decode_gemm/skinny_probe.py $R sweep > $R/probe.log 2>&1 )
echo "probe rc $?" >> $R/probe.log
tar czf $OUT/bundle.tgz -C $R . ; rm -rf $R
