// What the kernel microbenchmarks (scripts/bench_issue*/) share: old.so and new.so opened side by
// side (built by kernel_bench_common.sh), symbols looked up or the run stops, the thread's CPU
// clock, kvs::linear_rows / kvs::quantize_row_q8 by their mangled names, and the best-of-N timing
// of an old call against a new one, alternated so both see the same machine.
#pragma once
#include <dlfcn.h>
#include <time.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "kvserve_kernels.h"

typedef void (*lr_t)(const kvs_weight *, const int8_t *, const float *, const float *, int, float *, int, bool, int, int);
typedef void (*qr_t)(const float *, int, int8_t *, float *, float *);
static const char *const LINEAR_ROWS = "_ZN3kvs11linear_rowsEPK10kvs_weightPKaPKfS6_iPfibii";
static const char *const QUANTIZE_ROW_Q8 = "_ZN3kvs15quantize_row_q8EPKfiPaPfS3_";

static double tcpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static void *sym(void *h, const char *s) { void *p = dlsym(h, s); if (!p) { printf("dlsym %s\n", s); exit(1); } return p; }

struct Libs { void *old_so, *new_so; };
static Libs open_libs() {
    Libs l{dlopen("./old.so", RTLD_NOW | RTLD_LOCAL), dlopen("./new.so", RTLD_NOW | RTLD_LOCAL)};
    if (!l.old_so || !l.new_so) { printf("dlopen %s\n", dlerror()); exit(1); }
    return l;
}

// Best CPU seconds of `reps` rounds, each running old() then fresh(); {old, new}.
struct Best { double old_s = 1e9, new_s = 1e9; };
template <class Old, class New> static Best best_of(int reps, Old old, New fresh) {
    Best b;
    for (int r = 0; r < reps; r++) {
        double t0 = tcpu(); old();
        double t1 = tcpu(); fresh();
        double t2 = tcpu();
        b.old_s = std::min(b.old_s, t1 - t0); b.new_s = std::min(b.new_s, t2 - t1);
    }
    return b;
}
