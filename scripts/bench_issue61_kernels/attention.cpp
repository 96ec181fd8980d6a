// Issue 61: one thread, CPU time, best of N reps: kvs::attend_group (one query, G heads of one KV head over L
// paged rows, head_dim 64) of old.so against new.so, float16 and float32 KV, outputs compared bit for bit.
// Built and run by run.sh.
#include <vector>
#include <random>
#include "kernel_bench_common.h"
typedef void (*ag_t)(const float *, const void *, const void *, int, size_t, size_t, int, const int64_t *, int, int, int, int, float, float *, float *, float);
int main(int argc, char **argv) {
    const Libs libs = open_libs();
    const char *attend = "_ZN3kvs12attend_groupEPKfPKvS3_immiPKliiiifPfS6_f";
    ag_t fo = (ag_t)sym(libs.old_so, attend), fn = (ag_t)sym(libs.new_so, attend);
    int reps = argc > 1 ? atoi(argv[1]) : 200;
    const int D = 64, Hkv = 3, bs = 16, nblk = 64;
    std::mt19937 rng(3);
    std::normal_distribution<float> nd;
    for (int kvd : {2, 0}) {
        size_t es = kvd ? 2 : 4, tok = (size_t)Hkv * D, bstr = bs * tok;
        std::vector<uint8_t> K(nblk * bstr * es), V(nblk * bstr * es);
        for (size_t i = 0; i < nblk * bstr; i++) {
            float a = nd(rng), b = nd(rng);
            if (kvd) { ((uint16_t *)K.data())[i] = _cvtss_sh(a, 0); ((uint16_t *)V.data())[i] = _cvtss_sh(b, 0); }
            else { ((float *)K.data())[i] = a; ((float *)V.data())[i] = b; }
        }
        std::vector<int64_t> table(nblk);
        for (int i = 0; i < nblk; i++) table[i] = (i * 37) % nblk;
        for (int G : {3, 4, 1}) for (int L : {64, 200, 256, 513}) {
            std::vector<float> q(G * D), so(G * L), sn(G * L), oo(G * D), on(G * D);
            for (auto &v : q) v = nd(rng);
            const Best b = best_of(reps,
                [&] { fo(q.data(), K.data(), V.data(), kvd, bstr, tok, 64, table.data(), bs, L, D, G, 0.125f, so.data(), oo.data(), 0.f); },
                [&] { fn(q.data(), K.data(), V.data(), kvd, bstr, tok, 64, table.data(), bs, L, D, G, 0.125f, sn.data(), on.data(), 0.f); });
            const double bo = b.old_s, bn = b.new_s;
            bool same = !memcmp(oo.data(), on.data(), oo.size() * 4);
            printf("attend_group kv=%s G=%d L=%3d D=64  old %7.2f us  new %7.2f us  x%.3f  %s\n", kvd ? "f16" : "f32", G, L, bo * 1e6, bn * 1e6, bo / bn, same ? "same bits" : "DIFFERENT");
        }
    }
}
