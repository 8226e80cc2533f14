#!/usr/bin/env bash
R=$OUT/r; mkdir -p $R
( timeout 75 python3 scratch/skinny_probe.py $R sweep > $R/probe.log 2>&1 )
echo "probe rc $?" >> $R/probe.log
tar czf $OUT/bundle.tgz -C $R . ; rm -rf $R
