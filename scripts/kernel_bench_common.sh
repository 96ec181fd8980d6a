# Sourced by the kernel microbenchmarks' run.sh (scripts/bench_issue*/): sets `here` (the
# benchmark's folder), `tree` (this checkout), `ref` ($1, default main) and `work` (a temp folder,
# removed on exit); builds the kernels at git ref $ref as $work/old.so and this tree's as
# $work/new.so, each with build.py's CXX_FLAGS; `harness NAME` compiles $here/NAME.cpp (which
# includes kernel_bench_common.h) into $work/NAME. The harness then runs from $work.
set -e
here=$(cd "$(dirname "$0")" && pwd); tree=$(cd "$here/../.." && pwd); ref=${1:-main}
kernels=src/kvserve/model/kernels/cpu
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
F=$(sed -n 's/^CXX_FLAGS = \[\(.*\)\]/\1/p' "$tree/src/kvserve/model/kernels/build.py" | tr -d '",')
[ -n "$F" ] || { echo "CXX_FLAGS not found in build.py" >&2; exit 1; }
mkdir "$work/old"
git -C "$tree" archive "$ref" "$kernels" | tar -x -C "$work/old"
g++ $F -o "$work/old.so" "$work/old/$kernels"/*.cpp &
g++ $F -o "$work/new.so" "$tree/$kernels"/*.cpp
wait $!

harness() {
    g++ -O2 -mavx2 -mf16c -std=c++17 -I"$tree/$kernels" -I"$tree/scripts" -o "$work/$1" "$here/$1.cpp" -ldl
}
