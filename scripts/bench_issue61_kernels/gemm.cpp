// Issue 61: one thread, CPU time, best of N reps: kvs::linear_rows of old.so against new.so on the default
// model's shapes (Q4_1 float16 scales; the Q8_0 lm head at T <= 4, 32, 33), outputs compared bit for bit.
// Built and run by run.sh.
#include <vector>
#include <random>
#include "kernel_bench_common.h"
int main(int argc, char **argv) {
    const Libs libs = open_libs();
    lr_t fo = (lr_t)sym(libs.old_so, LINEAR_ROWS), fn = (lr_t)sym(libs.new_so, LINEAR_ROWS);
    qr_t qo = (qr_t)sym(libs.old_so, QUANTIZE_ROW_Q8), qn = (qr_t)sym(libs.new_so, QUANTIZE_ROW_Q8);
    int reps = argc > 1 ? atoi(argv[1]) : 30; int onlyT = argc > 2 ? atoi(argv[2]) : 0; bool onlynew = argc > 3;
    struct S { int rows, cols, qt; } shapes[] = {{960, 576, 0}, {576, 576, 0}, {3072, 576, 0}, {576, 1536, 0}, {49152, 576, 1}};
    int Ts[] = {1, 2, 3, 4, 8, 16, 32, 33, 48, 64};
    std::mt19937 rng(1);
    double tot_o = 0, tot_n = 0;
    for (auto s : shapes) {
        int ng = (s.rows + 15) / 16, nb = s.cols / 32;
        std::vector<uint8_t> qs((size_t)ng * nb * (s.qt ? 512 : 256));
        for (auto &b : qs) b = rng();
        std::vector<uint16_t> d((size_t)ng * nb * 16), m((size_t)ng * nb * 16);
        for (auto &v : d) v = _cvtss_sh((float)(rng() % 1000) * 1e-5f, 0);
        for (auto &v : m) v = _cvtss_sh(-(float)(rng() % 1000) * 1e-4f, 0);
        kvs_weight w{};
        w.qtype = s.qt; w.rows = s.rows; w.cols = s.cols; w.isa = 0; w.sdtype = 1;
        w.qs = qs.data(); w.d = d.data(); w.m = s.qt ? nullptr : m.data();
        for (int T : Ts) {
            if (s.qt == 1 && T > 4 && T != 32 && T != 33) continue;
            if (onlyT && (T != onlyT || s.qt)) continue;
            std::vector<float> x((size_t)T * s.cols);
            std::normal_distribution<float> nd;
            for (auto &v : x) v = nd(rng);
            std::vector<int8_t> xq((size_t)T * s.cols), xq2((size_t)T * s.cols);
            std::vector<float> xd((size_t)T * nb), xs((size_t)T * nb), xd2((size_t)T * nb), xs2((size_t)T * nb);
            for (int t = 0; t < T; t++) {
                qo(x.data() + (size_t)t * s.cols, s.cols, xq.data() + (size_t)t * s.cols, xd.data() + t * nb, xs.data() + t * nb);
                qn(x.data() + (size_t)t * s.cols, s.cols, xq2.data() + (size_t)t * s.cols, xd2.data() + t * nb, xs2.data() + t * nb);
            }
            if (memcmp(xq.data(), xq2.data(), xq.size()) || memcmp(xd.data(), xd2.data(), xd.size() * 4) || memcmp(xs.data(), xs2.data(), xs.size() * 4)) { printf("QUANT MISMATCH\n"); return 1; }
            std::vector<float> yo((size_t)T * s.rows), yn((size_t)T * s.rows);
            const Best lin = best_of(reps,
                [&] { if (!onlynew) fo(&w, xq.data(), xd.data(), xs.data(), T, yo.data(), s.rows, false, 0, 1); },
                [&] { fn(&w, xq.data(), xd.data(), xs.data(), T, yn.data(), s.rows, false, 0, 1); });
            auto quantize = [&](qr_t q) {
                for (int t = 0; t < T; t++) q(x.data() + (size_t)t * s.cols, s.cols, xq2.data() + (size_t)t * s.cols, xd2.data() + t * nb, xs2.data() + t * nb);
            };
            const Best quant = best_of(reps, [&] { quantize(qo); }, [&] { quantize(qn); });
            const double bo = lin.old_s, bn = lin.new_s, bqo = quant.old_s, bqn = quant.new_s;
            bool same = !memcmp(yo.data(), yn.data(), yo.size() * 4);
            double mac = (double)s.rows * s.cols * T;
            printf("%s %5dx%4d T=%2d  old %8.1f us %5.1f GMAC/s  new %8.1f us %5.1f GMAC/s  x%.3f  quant old %.1f new %.1f us  %s\n",
                   s.qt ? "Q8_0" : "Q4_1", s.rows, s.cols, T, bo * 1e6, mac / bo * 1e-9, bn * 1e6, mac / bn * 1e-9, bo / bn,
                   bqo * 1e6, bqn * 1e6, same ? "same bits" : "DIFFERENT");
            if ((T == 32 || T == 33) && !s.qt) { tot_o += bo; tot_n += bn; }
        }
    }
    printf("Q4_1, T=32+33, all shapes: old %.1f us new %.1f us x%.3f\n", tot_o * 1e6, tot_n * 1e6, tot_o / tot_n);
}
