// Issue 58: one thread, CPU time, best of N reps: kvs::linear_rows of old.so against new.so on the
// K-quant prompt path (T >= 2) of the 1.1B and 3B Llama shapes, Q4_0 beside them as the bar; the
// weights are random GGUF blocks repacked by new.so (the layouts are shared), outputs compared bit
// for bit. Built and run by run.sh:  ./kquant REPS [T] [TYPE]
#include <string>
#include <vector>
#include <random>
#include "kernel_bench_common.h"
typedef void (*rk_t)(const uint8_t *, int, int, uint8_t *, uint8_t *);
typedef int (*rq4_t)(int, const uint8_t *, int, int, uint8_t *, void *, void *, int);
typedef size_t (*sz3_t)(int, int, int);

struct Packed { std::vector<uint8_t> qs, d; std::vector<uint16_t> d16; kvs_weight w{}; };

// GGUF blocks of type name, random codes and sane fp16 scales, repacked into the kernels' layout.
static void make(void *h, const std::string &type, int rows, int cols, std::mt19937 &rng, Packed &p) {
    const int nsb = cols / 256, nb = cols / 32;
    auto half = [&](float lo, float hi) { return (uint16_t)_cvtss_sh(lo + (hi - lo) * (rng() % 1000) / 1000.0f, 0); };
    sz3_t qsb = (sz3_t)sym(h, "kvs_packed_qs_bytes"), ksb = (sz3_t)sym(h, "kvs_packed_kscale_bytes");
    p.w.rows = rows; p.w.cols = cols; p.w.isa = 0;
    if (type == "Q4_0") {
        std::vector<uint8_t> raw((size_t)rows * nb * 18);
        for (auto &b : raw) b = rng();
        for (size_t i = 0; i < (size_t)rows * nb; i++) { uint16_t v = half(1e-3f, 2e-2f); memcpy(&raw[i * 18], &v, 2); }
        p.qs.resize(qsb(0, rows, cols)); p.d16.resize((size_t)((rows + 15) / 16) * 16 * nb);
        std::vector<uint16_t> m(p.d16.size());
        rq4_t f = (rq4_t)sym(h, "kvs_repack_q4");
        if (f(2, raw.data(), rows, cols, p.qs.data(), p.d16.data(), m.data(), 1)) { printf("repack q4\n"); exit(1); }
        p.w.qtype = 0; p.w.sdtype = 1; p.w.d = p.d16.data(); p.w.m = nullptr;   // SM 5, as the loader runs Q4_0
    } else {
        const int qt = type == "Q4_K" ? 2 : type == "Q6_K" ? 3 : 4, bb = qt == 2 ? 144 : qt == 3 ? 210 : 176;
        std::vector<uint8_t> raw((size_t)rows * nsb * bb);
        for (auto &b : raw) b = rng();
        for (size_t i = 0; i < (size_t)rows * nsb; i++) {
            uint8_t *b = &raw[i * bb];
            uint16_t v = half(1e-4f, 2e-3f), v2 = half(1e-4f, 2e-3f);
            if (qt == 3) memcpy(b + 208, &v, 2);
            else { memcpy(b, &v, 2); memcpy(b + 2, &v2, 2); }
        }
        p.qs.resize(qsb(qt, rows, cols)); p.d.resize(ksb(qt, rows, cols));
        rk_t f = (rk_t)sym(h, qt == 2 ? "kvs_repack_q4_k_super" : qt == 3 ? "kvs_repack_q6_k" : "kvs_repack_q5_k_super");
        f(raw.data(), rows, cols, p.qs.data(), p.d.data());
        p.w.qtype = qt; p.w.sdtype = 2; p.w.d = p.d.data(); p.w.m = nullptr;
    }
    p.w.qs = p.qs.data();
}

int main(int argc, char **argv) {
    const Libs libs = open_libs();
    void *hn = libs.new_so;
    lr_t fo = (lr_t)sym(libs.old_so, LINEAR_ROWS), fn = (lr_t)sym(hn, LINEAR_ROWS);
    qr_t qn = (qr_t)sym(hn, QUANTIZE_ROW_Q8);
    int reps = argc > 1 ? atoi(argv[1]) : 10, onlyT = argc > 2 ? atoi(argv[2]) : 0;
    std::string onlytype = argc > 3 ? argv[3] : "";
    const bool chunked = argc > 4 && atoi(argv[4]);
    auto run = [&](lr_t f, const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y) {
        const int ng = chunked ? (w->rows + 15) / 16 : 1;
        for (int g = 0; g < ng; g++) f(w, xq, xd, xs, T, y, w->rows, false, g, ng);
    };
    struct S { const char *name; int rows, cols; } shapes[] = {
        {"3B q/o", 3072, 3072}, {"3B gate", 8192, 3072}, {"3B down", 3072, 8192},
        {"1.1B q/o", 2048, 2048}, {"1.1B gate", 5632, 2048}, {"1.1B down", 2048, 5632}};
    const char *types[] = {"Q4_0", "Q4_K", "Q5_K", "Q6_K"};
    int Ts[] = {64, 2, 3, 512};
    std::mt19937 rng(1);
    for (auto s : shapes)
        for (int T : Ts) {
            if (onlyT && T != onlyT) continue;
            if (!onlyT && T != 64 && s.rows != 3072) continue;
            const int nb = s.cols / 32;
            std::vector<float> x((size_t)T * s.cols);
            std::normal_distribution<float> nd;
            for (auto &v : x) v = nd(rng);
            std::vector<int8_t> xq((size_t)T * s.cols);
            std::vector<float> xd((size_t)T * nb), xs((size_t)T * nb);
            for (int t = 0; t < T; t++)
                qn(x.data() + (size_t)t * s.cols, s.cols, xq.data() + (size_t)t * s.cols, xd.data() + t * nb, xs.data() + t * nb);
            double q40 = 0;
            for (const char *type : types) {
                if (!onlytype.empty() && onlytype != type && std::string(type) != "Q4_0") continue;
                Packed p;
                make(hn, type, s.rows, s.cols, rng, p);
                std::vector<float> yo((size_t)T * s.rows), yn((size_t)T * s.rows);
                const Best b = best_of(reps,
                    [&] { run(fo, &p.w, xq.data(), xd.data(), xs.data(), T, yo.data()); },
                    [&] { run(fn, &p.w, xq.data(), xd.data(), xs.data(), T, yn.data()); });
                const double bo = b.old_s, bn = b.new_s;
                const bool same = !memcmp(yo.data(), yn.data(), yo.size() * 4);
                const double mac = (double)s.rows * s.cols * T;
                if (!strcmp(type, "Q4_0")) q40 = bn;
                printf("%-9s %s T=%3d  old %9.1f us %5.1f GMAC/s  new %9.1f us %5.1f GMAC/s  x%.3f  new/Q4_0 %.2f  %s\n",
                       s.name, type, T, bo * 1e6, mac / bo * 1e-9, bn * 1e6, mac / bn * 1e-9, bo / bn, bn / q40,
                       same ? "same bits" : "DIFFERENT");
                fflush(stdout);
            }
        }
}
