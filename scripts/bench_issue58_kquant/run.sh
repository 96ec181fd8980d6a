#!/bin/sh
# Issue 58 K-quant prompt-tile microbenchmarks: the kernels at git ref $1 (default main) as old.so,
# this tree's as new.so, each compiled with build.py's flags; then one thread, CPU time, best of
# REPS, old and new alternated, outputs compared bit for bit.
#     sh scripts/bench_issue58_kquant/run.sh [REF] [REPS] [T] [TYPE] [CHUNKED]
# (CHUNKED 1: one call per 16-row group, the forward's prompt row chunks)
set -e
here=$(cd "$(dirname "$0")" && pwd); tree=$(cd "$here/../.." && pwd); ref=${1:-main}; reps=${2:-10}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
F="-O3 -mavx2 -mfma -mf16c -fopenmp -fPIC -shared -pthread -std=c++17"
mkdir "$work/old"
git -C "$tree" archive "$ref" src/kvserve/model/kernels/cpu | tar -x -C "$work/old"
g++ $F -o "$work/old.so" "$work"/old/src/kvserve/model/kernels/cpu/*.cpp &
g++ $F -o "$work/new.so" "$tree"/src/kvserve/model/kernels/cpu/*.cpp
wait
g++ -O2 -mavx2 -mf16c -std=c++17 -I"$tree/src/kvserve/model/kernels/cpu" -o "$work/kquant" "$here/kquant.cpp" -ldl
cd "$work" && OMP_NUM_THREADS=1 ./kquant "$reps" ${3:-0} "$4" ${5:-0}
