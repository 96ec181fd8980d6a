#!/bin/sh
# Issue 58 K-quant prompt-tile microbenchmarks: the kernels at git ref $1 (default main) as old.so,
# this tree's as new.so, each compiled with build.py's flags; then one thread, CPU time, best of
# REPS, old and new alternated, outputs compared bit for bit.
#     sh scripts/bench_issue58_kquant/run.sh [REF] [REPS] [T] [TYPE] [CHUNKED]
# (CHUNKED 1: one call per 16-row group, the forward's prompt row chunks)
. "$(dirname "$0")/../kernel_bench_common.sh"
harness kquant
cd "$work" && OMP_NUM_THREADS=1 ./kquant "${2:-10}" ${3:-0} "$4" ${5:-0}
