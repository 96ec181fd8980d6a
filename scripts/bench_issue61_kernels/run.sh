#!/bin/sh
# Issue 61 kernel microbenchmarks: the kernels at git ref $1 (default main) as old.so, this tree's as new.so,
# each compiled with build.py's flags; then one thread, CPU time, best of many reps, old and new alternated.
#     sh scripts/bench_issue61_kernels/run.sh [REF] [REPS]
set -e
here=$(cd "$(dirname "$0")" && pwd); tree=$(cd "$here/../.." && pwd); ref=${1:-main}; reps=${2:-20}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
F="-O3 -mavx2 -mfma -mf16c -fopenmp -fPIC -shared -pthread -std=c++17"
mkdir "$work/old"
git -C "$tree" archive "$ref" src/kvserve/model/kernels/cpu | tar -x -C "$work/old"
g++ $F -o "$work/old.so" "$work"/old/src/kvserve/model/kernels/cpu/*.cpp
g++ $F -o "$work/new.so" "$tree"/src/kvserve/model/kernels/cpu/*.cpp
g++ -O2 -mavx2 -mf16c -std=c++17 -I"$tree/src/kvserve/model/kernels/cpu" -o "$work/gemm" "$here/gemm.cpp" -ldl
g++ -O2 -mavx2 -mf16c -std=c++17 -o "$work/attention" "$here/attention.cpp" -ldl
cd "$work" && ./gemm "$reps" && ./attention $((reps * 10))
