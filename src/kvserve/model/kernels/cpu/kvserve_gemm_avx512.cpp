// The int8 matmul tiles of kvserve_kernels.cpp with AVX-512 VNNI: 16 weight rows per register
// (one 16-row group of the repacked layout) and vpdpbusd forming the exact int32 block sums in one
// instruction. The arithmetic of every output is the one at the top of kvserve_kernels.cpp (exact
// integer block sums, then one fma per block in block order), so these tiles give bit-for-bit the
// AVX2 tiles' results: only speed depends on the CPU.
//
// This file alone is compiled for the AVX-512 target (the pragma below); it is only entered when
// a weight's descriptor says isa = 1, which the Python backend sets only on CPUs that have
// avx512f/bw/vl and avx512_vnni. It includes no inline helper of the shared header (see there).

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

#define KVS_NO_INLINE_HELPERS
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kvserve_kernels.h"
#include "kvserve_avx512_helpers.h"

namespace {

constexpr int QK = 32;

inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// The frame every tile below shares: TT tokens' accumulators for the group's 16 rows; per block b
// (block_bytes of the group's codes at qb) block(b, qb, acc) adds its products, in block order;
// then the valid rows are stored.
template <int TT, class Block>
inline void tile16(const kvs_weight *w, int g, size_t block_bytes, int t0, float *y, int ldy, bool add, Block block) {
    const int nb = w->cols / QK;
    const uint8_t *qg = w->qs + (size_t)g * nb * block_bytes;
    __m512 acc[TT];
    for (int j = 0; j < TT; j++) acc[j] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) block(b, qg + (size_t)b * block_bytes, acc);
    const int row0 = g * 16, nvalid = w->rows - row0;
    for (int j = 0; j < TT; j++) store_rows16(acc[j], w->bias, row0, nvalid, y + (size_t)(t0 + j) * ldy + row0, add);
}

// is[j] += the exact int32 sums of one 4-value column of the low and high nibbles (u8 lo, hi)
// with token t0 + j's int8 values of block b.
template <int TT>
inline void dot_nibbles(__m512i *is, __m512i lo, __m512i hi, const int8_t *xq, int K, int t0, int b, int i) {
    for (int j = 0; j < TT; j++) {
        const int8_t *xr = xq + (size_t)(t0 + j) * K + b * QK + 4 * i;
        is[j] = _mm512_dpbusd_epi32(is[j], lo, bcast4(xr));
        is[j] = _mm512_dpbusd_epi32(is[j], hi, bcast4(xr + 16));
    }
}

// acc[j] += block b's sums is[j] times its scale d, plus its minimum m times token t0 + j's sum
// xs: the two fmas per block of the Q4 layouts (SM as q4_scales16's).
template <int TT, int SM>
inline void q4_block_fma(const kvs_weight *w, int g, int b, int nb, const __m512i *is, const float *xd,
                         const float *xs, int t0, __m512 *acc) {
    __m512 d, m;
    q4_scales16<SM>(w, g, b, nb, &d, &m);
    for (int j = 0; j < TT; j++) {
        const size_t sb = (size_t)(t0 + j) * nb + b;
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[j]), _mm512_mul_ps(d, _mm512_set1_ps(xd[sb])), acc[j]);
        acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[sb]), acc[j]);
    }
}

template <int TT, int SM>
void q4_tile16(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const float *xs, int t0, float *y,
               int ldy, bool add) {
    const int K = w->cols, nb = K / QK;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    tile16<TT>(w, g, 256, t0, y, ldy, add, [&](int b, const uint8_t *qb, __m512 *acc) {
        __m512i is[TT];
        for (int j = 0; j < TT; j++) is[j] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(qb + i * 64));
            const __m512i lo = _mm512_and_si512(raw, mask);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
            dot_nibbles<TT>(is, lo, hi, xq, K, t0, b, i);
        }
        q4_block_fma<TT, SM>(w, g, b, nb, is, xd, xs, t0, acc);
    });
}

template <int TT, bool F16>
void q8_tile16(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const float *, int t0, float *y,
               int ldy, bool add) {
    const int K = w->cols, nb = K / QK;
    const size_t s0 = (size_t)g * nb * 16;
    const __m512i zero = _mm512_setzero_si512();
    tile16<TT>(w, g, 512, t0, y, ldy, add, [&](int b, const uint8_t *qb, __m512 *acc) {
        __m512i is[TT];
        for (int j = 0; j < TT; j++) is[j] = _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(qb + i * 64));
            const __m512i a = _mm512_abs_epi8(raw);           // |q| as u8; the sign goes onto x
            const __mmask64 neg = _mm512_movepi8_mask(raw);
            for (int j = 0; j < TT; j++) {
                const __m512i x = bcast4(xq + (size_t)(t0 + j) * K + b * QK + 4 * i);
                is[j] = _mm512_dpbusd_epi32(is[j], a, _mm512_mask_sub_epi8(x, neg, zero, x));
            }
        }
        const __m512 d = scales16<F16>(w->d, s0 + (size_t)b * 16);
        for (int j = 0; j < TT; j++)
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[j]),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xd[(size_t)(t0 + j) * nb + b])), acc[j]);
    });
}

// Bit `from` of every byte of v moved to bit 4, the rest cleared (as kvserve_kernels.cpp's bit_to4).
template <int from>
inline __m512i bit_to4_16(__m512i v) {
    const __m512i m = _mm512_set1_epi8(0x10);
    if constexpr (from < 4) return _mm512_and_si512(_mm512_slli_epi16(v, 4 - from), m);
    else if constexpr (from > 4) return _mm512_and_si512(_mm512_srli_epi16(v, from - 4), m);
    else return _mm512_and_si512(v, m);
}

template <int i>
inline void q5_chunk16(const uint8_t *qb, __m512i hb, __m512i *lo, __m512i *hi) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i raw = _mm512_loadu_si512((const void *)(qb + i * 64));
    *lo = _mm512_or_si512(_mm512_and_si512(raw, mask), bit_to4_16<2 * i>(hb));
    *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), mask), bit_to4_16<2 * i + 1>(hb));
}

// Q5_K (qtype 4): the AVX2 q5k_tile16xn's exact block sums and the Q4_K scales' two fmas per block.
// The fifth-bit plane is [16 rows][4 bytes] = 64 bytes: one register for the whole group.
template <int TT>
void q5_tile16(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const float *xs, int t0, float *y,
               int ldy, bool add) {
    const int K = w->cols, nb = K / QK;
    tile16<TT>(w, g, KVS_Q5_BLOCK_BYTES, t0, y, ldy, add, [&](int b, const uint8_t *qb, __m512 *acc) {
        const __m512i hb = _mm512_loadu_si512((const void *)(qb + 256));
        __m512i lo[4], hi[4], is[TT];
        q5_chunk16<0>(qb, hb, &lo[0], &hi[0]);
        q5_chunk16<1>(qb, hb, &lo[1], &hi[1]);
        q5_chunk16<2>(qb, hb, &lo[2], &hi[2]);
        q5_chunk16<3>(qb, hb, &lo[3], &hi[3]);
        for (int j = 0; j < TT; j++) is[j] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) dot_nibbles<TT>(is, lo[i], hi[i], xq, K, t0, b, i);
        q4_block_fma<TT, 2>(w, g, b, nb, is, xd, xs, t0, acc);
    });
}

// Q6_K (qtype 3): the AVX2 Q6_K tiles' exact integers per half block (vpdpbusd here), each times its
// int8 scale per 16 values, then the same one fma per block.
template <int TT>
void q6_tile16(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const float *, int t0, float *y,
               int ldy, bool add) {
    const int K = w->cols, nb = K / QK;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30), c32 = _mm512_set1_epi8(32);
    const __m512i zero = _mm512_setzero_si512();
    tile16<TT>(w, g, KVS_Q6_BLOCK_BYTES, t0, y, ldy, add, [&](int b, const uint8_t *qb, __m512 *acc) {
        __m512i slo[TT], shi[TT];
        for (int j = 0; j < TT; j++) slo[j] = shi[j] = _mm512_setzero_si512();
        for (int i = 0; i < 4; i++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(qb + i * 64));
            const __m512i hb = _mm512_loadu_si512((const void *)(qb + 256 + (i / 2) * 64));
            const __m512i h_lo = i & 1 ? hb : _mm512_slli_epi16(hb, 4);
            const __m512i h_hi = i & 1 ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2);
            const __m512i lo = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(raw, m4), _mm512_and_si512(h_lo, m2)), c32);
            const __m512i hi = _mm512_sub_epi8(
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), m4), _mm512_and_si512(h_hi, m2)), c32);
            const __m512i alo = _mm512_abs_epi8(lo), ahi = _mm512_abs_epi8(hi);
            const __mmask64 nlo = _mm512_movepi8_mask(lo), nhi = _mm512_movepi8_mask(hi);
            for (int j = 0; j < TT; j++) {
                const int8_t *xr = xq + (size_t)(t0 + j) * K + b * QK + 4 * i;
                const __m512i xl = bcast4(xr), xh = bcast4(xr + 16);
                slo[j] = _mm512_dpbusd_epi32(slo[j], alo, _mm512_mask_sub_epi8(xl, nlo, zero, xl));
                shi[j] = _mm512_dpbusd_epi32(shi[j], ahi, _mm512_mask_sub_epi8(xh, nhi, zero, xh));
            }
        }
        const uint8_t *ks = (const uint8_t *)w->d + ((size_t)g * (nb / 8) + b / 8) * KVS_Q6_SUPER_BYTES;
        const __m512i sc_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ks + 32 + (2 * (b % 8)) * 16)));
        const __m512i sc_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ks + 32 + (2 * (b % 8) + 1) * 16)));
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)ks));
        for (int j = 0; j < TT; j++) {
            const __m512i s32 = _mm512_add_epi32(_mm512_mullo_epi32(slo[j], sc_lo), _mm512_mullo_epi32(shi[j], sc_hi));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s32),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xd[(size_t)(t0 + j) * nb + b])), acc[j]);
        }
    });
}

template <bool Q4, int SM, int TT>
inline void tile(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const float *xs, int t0, float *y,
                 int ldy, bool add) {
    if constexpr (Q4 && SM == 4) q5_tile16<TT>(w, g, xq, xd, xs, t0, y, ldy, add);
    else if constexpr (Q4) q4_tile16<TT, SM>(w, g, xq, xd, xs, t0, y, ldy, add);
    else if constexpr (SM == 3) q6_tile16<TT>(w, g, xq, xd, xs, t0, y, ldy, add);
    else q8_tile16<TT, SM == 1>(w, g, xq, xd, xs, t0, y, ldy, add);
}

template <bool Q4, int SM>
void run_groups(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y, int ldy,
                bool add, int gbeg, int gend) {
    constexpr int TT = 6;
    for (int g = gbeg; g < gend; g++) {
        int t = 0;
        for (; t + TT <= T; t += TT) tile<Q4, SM, TT>(w, g, xq, xd, xs, t, y, ldy, add);
        switch (T - t) {
            case 5: tile<Q4, SM, 5>(w, g, xq, xd, xs, t, y, ldy, add); break;
            case 4: tile<Q4, SM, 4>(w, g, xq, xd, xs, t, y, ldy, add); break;
            case 3: tile<Q4, SM, 3>(w, g, xq, xd, xs, t, y, ldy, add); break;
            case 2: tile<Q4, SM, 2>(w, g, xq, xd, xs, t, y, ldy, add); break;
            case 1: tile<Q4, SM, 1>(w, g, xq, xd, xs, t, y, ldy, add); break;
            default: break;
        }
    }
}

}  // namespace

namespace kvs {

void groups_avx512(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y,
                   int ldy, bool add, int gbeg, int gend) {
    const bool f16 = w->sdtype == 1;
    if (w->qtype == KVS_QTYPE_Q4K) run_groups<true, 2>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (w->qtype == KVS_QTYPE_Q6K) run_groups<false, 3>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (w->qtype == KVS_QTYPE_Q5K) run_groups<true, 4>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (w->qtype == 0 && f16) run_groups<true, 1>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (w->qtype == 0) run_groups<true, 0>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (f16) run_groups<false, 1>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else run_groups<false, 0>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
}

}  // namespace kvs
