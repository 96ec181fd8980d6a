// The int8 matmul of kvserve_kernels.cpp on AMX-INT8 tiles, for steps of 16 tokens or more
// (prefill chunks, batched decode): one TDPBSUD (Q4: signed activations x unsigned 4-bit codes) or
// TDPBSSD (Q8_0) forms the exact int32 block sums of 16 tokens x 16 weight rows for one block of
// 32 values, and AVX-512 applies them in the arithmetic at the top of kvserve_kernels.cpp (one fma
// per block, in block order, for every output). Integer sums are exact however they are formed, so
// these tiles give bit for bit the VNNI and AVX2 tiles' results: a token's numbers do not depend on
// whether its step was large enough to reach this path.
//
// Layout: the repacked weights need no copy. A Q8_0 block of one 16-row group is already a B tile
// (8 rows of [16 weight rows][4 bytes]); a Q4 block's 256 bytes unpack into one (low nibbles give
// B rows 0-3, high nibbles rows 4-7), once per group into a per-thread buffer that every 16-token
// tile then reads. A tiles are the quantized activations in place (16 tokens, stride K).
//
// This file alone is compiled for AMX (the pragma below); it is only entered for weights whose
// descriptor says isa = 2, which the Python backend sets only where the CPU has amx_int8 and the
// kernel was granted the tile state (kvs_amx_init). Tokens past the last full 16 go to the VNNI
// tiles. The tile configuration is loaded at the start of each call on each thread and released at
// the end, so oneDNN's own AMX kernels (bf16 paths, the embedding model) on the same threads are
// not disturbed.

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")

#define KVS_NO_INLINE_HELPERS
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kvserve_kernels.h"
#include "kvserve_avx512_helpers.h"

namespace {

constexpr int QK = 32;
constexpr int TM = 16;  // tokens per tile

struct alignas(64) TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Tiles 0-2: C (16 tokens x 16 int32), A (16 tokens x 32 int8), B (8 x 64 bytes) for block b;
// tiles 3-5 the same for block b + 1, so two blocks' products are in flight at once.
void load_config() {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int s = 0; s < 2; s++) {
        c.rows[3 * s + 0] = TM, c.colsb[3 * s + 0] = 64;
        c.rows[3 * s + 1] = TM, c.colsb[3 * s + 1] = QK;
        c.rows[3 * s + 2] = QK / 4, c.colsb[3 * s + 2] = 64;
    }
    _tile_loadconfig(&c);
}

// A per-thread buffer for a group's unpacked Q4 B tiles (nb * 512 bytes), grown as needed.
uint8_t *unpack_buffer(size_t bytes) {
    static thread_local uint8_t *buf = nullptr;
    static thread_local size_t cap = 0;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + 4095) & ~(size_t)4095;
        buf = (uint8_t *)aligned_alloc(64, cap);
        if (!buf) cap = 0;
    }
    return buf;   // nullptr if out of memory: the caller runs the VNNI tiles instead
}

// One block's int32 sums (c: 16 tokens x 16 rows) into the float accumulators, exactly as the
// VNNI tile does it.
template <bool Q4, int SM>
inline void apply_block(__m512 *acc, const int32_t *c, const kvs_weight *w, int g, const float *xd,
                        const float *xs, int nb, int t0, int b) {
    if (Q4) {
        __m512 d, m;
        q4_scales16<SM>(w, g, b, nb, &d, &m);
        for (int j = 0; j < TM; j++) {
            const size_t sb = (size_t)(t0 + j) * nb + b;
            const __m512i is = _mm512_load_si512((const void *)(c + j * 16));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(xd[sb])), acc[j]);
            acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[sb]), acc[j]);
        }
    } else {
        const __m512 d = scales16<SM == 1>(w->d, ((size_t)g * nb + b) * 16);
        for (int j = 0; j < TM; j++) {
            const __m512i is = _mm512_load_si512((const void *)(c + j * 16));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xd[(size_t)(t0 + j) * nb + b])), acc[j]);
        }
    }
}

#define KVS_TDP(c, a, b)                     \
    do {                                     \
        if constexpr (Q4) _tile_dpbsud(c, a, b); \
        else _tile_dpbssd(c, a, b);          \
    } while (0)

// Tokens [0, T16) (a multiple of 16) of groups [gbeg, gend).
template <bool Q4, int SM>
void run_groups_amx(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T16, float *y,
                    int ldy, bool add, int gbeg, int gend) {
    const int K = w->cols, nb = K / QK;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    alignas(64) int32_t cbuf[2][TM * 16];
    uint8_t *bq = Q4 ? unpack_buffer((size_t)nb * 512) : nullptr;
    for (int g = gbeg; g < gend; g++) {
        const uint8_t *B;
        if (Q4) {
            const uint8_t *qg = w->qs + (size_t)g * nb * 256;
            for (int b = 0; b < nb; b++)
                for (int i = 0; i < 4; i++) {
                    const __m512i raw = _mm512_loadu_si512((const void *)(qg + (size_t)b * 256 + i * 64));
                    _mm512_store_si512((void *)(bq + (size_t)b * 512 + i * 64), _mm512_and_si512(raw, mask));
                    _mm512_store_si512((void *)(bq + (size_t)b * 512 + (4 + i) * 64),
                                       _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask));
                }
            B = bq;
        } else {
            B = w->qs + (size_t)g * nb * 512;
        }
        const int row0 = g * 16, nvalid = w->rows - row0;
        for (int t0 = 0; t0 < T16; t0 += TM) {
            __m512 acc[TM];
            for (int j = 0; j < TM; j++) acc[j] = _mm512_setzero_ps();
            const int8_t *xa = xq + (size_t)t0 * K;
            int b = 0;
            for (; b + 2 <= nb; b += 2) {
                _tile_zero(0);
                _tile_zero(3);
                _tile_loadd(1, xa + b * QK, K);
                _tile_loadd(2, B + (size_t)b * 512, 64);
                _tile_loadd(4, xa + (b + 1) * QK, K);
                _tile_loadd(5, B + (size_t)(b + 1) * 512, 64);
                KVS_TDP(0, 1, 2);
                KVS_TDP(3, 4, 5);
                _tile_stored(0, cbuf[0], 64);
                _tile_stored(3, cbuf[1], 64);
                apply_block<Q4, SM>(acc, cbuf[0], w, g, xd, xs, nb, t0, b);
                apply_block<Q4, SM>(acc, cbuf[1], w, g, xd, xs, nb, t0, b + 1);
            }
            if (b < nb) {
                _tile_zero(0);
                _tile_loadd(1, xa + b * QK, K);
                _tile_loadd(2, B + (size_t)b * 512, 64);
                KVS_TDP(0, 1, 2);
                _tile_stored(0, cbuf[0], 64);
                apply_block<Q4, SM>(acc, cbuf[0], w, g, xd, xs, nb, t0, b);
            }
            for (int j = 0; j < TM; j++)
                store_rows16(acc[j], w->bias, row0, nvalid, y + (size_t)(t0 + j) * ldy + row0, add);
        }
    }
}

#undef KVS_TDP

}  // namespace

extern "C" {

// Ask Linux for the AMX tile state (once per process; every thread may then use the tiles).
// Returns 1 if granted, 0 if not (no AMX, an old kernel, or a hypervisor that hides it).
int kvs_amx_init(void) {
    static int granted = -1;
    if (granted < 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 0;
    }
    return granted;
}

}  // extern "C"

namespace kvs {

void groups_amx(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y, int ldy,
                bool add, int gbeg, int gend) {
    // Q6_K (a scale per 16 values) and Q5_K (a fifth-bit plane) run on the VNNI tiles, same bits
    int T16 = w->qtype == KVS_QTYPE_Q6K || w->qtype == KVS_QTYPE_Q5K ? 0 : T / TM * TM;
    if (T16 > 0 && w->qtype != 1 && !unpack_buffer((size_t)(w->cols / QK) * 512)) T16 = 0;
    if (T16 > 0) {
        const bool f16 = w->sdtype == 1;
        load_config();
        if (w->qtype == KVS_QTYPE_Q4K) run_groups_amx<true, 2>(w, xq, xd, xs, T16, y, ldy, add, gbeg, gend);
        else if (w->qtype == 0 && f16) run_groups_amx<true, 1>(w, xq, xd, xs, T16, y, ldy, add, gbeg, gend);
        else if (w->qtype == 0) run_groups_amx<true, 0>(w, xq, xd, xs, T16, y, ldy, add, gbeg, gend);
        else if (f16) run_groups_amx<false, 1>(w, xq, xd, xs, T16, y, ldy, add, gbeg, gend);
        else run_groups_amx<false, 0>(w, xq, xd, xs, T16, y, ldy, add, gbeg, gend);
        _tile_release();
    }
    if (T16 < T) {
        const int nb = w->cols / QK;
        groups_avx512(w, xq + (size_t)T16 * w->cols, xd + (size_t)T16 * nb, xs ? xs + (size_t)T16 * nb : nullptr,
                      T - T16, y + (size_t)T16 * ldy, ldy, add, gbeg, gend);
    }
}

}  // namespace kvs
