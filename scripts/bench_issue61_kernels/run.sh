#!/bin/sh
# Issue 61 kernel microbenchmarks: the kernels at git ref $1 (default main) as old.so, this tree's as new.so,
# each compiled with build.py's flags; then one thread, CPU time, best of many reps, old and new alternated.
#     sh scripts/bench_issue61_kernels/run.sh [REF] [REPS]
. "$(dirname "$0")/../kernel_bench_common.sh"
reps=${2:-20}
harness gemm
harness attention
cd "$work" && ./gemm "$reps" && ./attention $((reps * 10))
