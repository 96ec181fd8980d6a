// Longer than 420 lines on purpose: the quantized GEMM/GEMV family shares static inline AVX2
// helpers (block decode, int8 dot products) that must stay in one translation unit to inline.
// kvserve CPU kernels: GGUF block-quantized matmul (Q4_0, Q4_1, Q4_K, Q8_0) on int8 activations.
//
// Built by kvserve.model.kernels.build with: g++ -O3 -mavx2 -mfma -mf16c -fPIC -shared -pthread
// (plus -mavxvnni where the CPU has AVX-VNNI) and called through ctypes. Explicit AVX2 flags (not
// -march=native) so the same binary is valid on every AVX2 host; the AVX-512 VNNI variant of the
// tiles lives in kvserve_gemm_avx512.cpp and the AMX-INT8 one in kvserve_gemm_amx.cpp, each
// compiled for its target and chosen per weight (isa).
//
// One arithmetic for every call size, every ISA variant and every thread count. For output row r
// and token t, with weights w = d * q + m per block of 32 (m = 0 for Q8_0) and the activations
// quantized per block to int8 (xq, scale xd, xs = xd * sum(xq)):
//
//     acc = 0
//     for each block b, in order:  isum = sum_k q[r][k] * xq[t][k]          (exact int32)
//                                  acc = fma(float(isum), d[r][b] * xd[t][b], acc)
//                                  acc = fma(m[r][b], xs[t][b], acc)       (Q4 only)
//     y[t][r] = acc (+ bias[r])
//
// The integer sums are exact however they are formed (vpmaddubsw + vpmaddwd on AVX2, vpdpbusd on
// VNNI, 8 or 16 rows per register, tdpbsud/tdpbssd on AMX for 16 tokens x 16 rows at once) and
// the float chain of one output is the same sequence of roundings everywhere: a request's numbers do not depend on the batch it shares, on how its
// prompt was chunked, on the thread count, or on which x86-64 CPU runs it. SIMD lanes run across
// output rows, never across K, which is what lets a tile of tokens reuse each weight load (a GEMM
// for prefill and batched decode) without changing any output's reduction order.
//
// Weight layout after repacking (kvs_repack / kvs_pack_q4, once at load); rows in groups of 16
// (the last group zero-padded), per group g and block b:
//
//   Q4 (Q4_0, Q4_1, Q4_K):  qs [g][b][i = 0..3][16 rows][4 bytes]: byte j of row r holds
//                           q[r][32b + 4i + j] (low nibble) and q[r][32b + 16 + 4i + j] (high)
//                           so one 64-byte load gives 16 rows x 8 values, an AND and a shift+AND
//                           two u8 vectors whose lanes (4 bytes = 1 int32 lane) are rows.
//                           d, m [g][b][16 rows] float16 or float32: w = d * q + m, q in 0..15
//                           (Q4_0 with float16 d may come without m: then m = -8 d, formed exactly)
//   Q8_0:                   qs [g][b][i = 0..7][16 rows][4 bytes] int8 q[r][32b + 4i + j],
//                           d [g][b][16 rows] float16 or float32: w = d * q
//   Q4_K (qtype 2):         qs as Q4; the scales stay per 256-value super-block s as the file has
//                           them, KVS_KSUPER_BYTES = 320 bytes per group and super-block at d:
//                           [g][s] { fp16 d[16 rows], fp16 dmin[16 rows], u8 sc[8 blocks][16 rows],
//                           u8 mn[8 blocks][16 rows] }: block b = 8s + j has the block scale
//                           d * sc[j] and minimum -(dmin * mn[j]), formed by the kernels. Both are
//                           exact float32 products (11-bit fp16 mantissa times a 6-bit integer), so
//                           the arithmetic above is unchanged; a row reads 148 bytes per 256
//                           values (the file: 144), where per-block float32 scales read 192.
//   Q6_K (qtype 3):         qs [g][b] 384 bytes: the low 4 bits as Q4's 256 bytes, then the high 2
//                           bits [p = 0..1][16 rows][4 bytes]: byte j of row r holds, from bit 0,
//                           those of q[r][32b + 4i + j] and q[r][32b + 16 + 4i + j] for i = 2p,
//                           then the same for i = 2p + 1; d [g][s] 288 bytes: { fp16 d[16 rows],
//                           int8 sc[16 sub-blocks of 16][16 rows] }: w = d * sc * (q - 32), 6.56
//                           bits a weight as in the file. Its scale per 16 values folds into the
//                           exact integer sum: isum = sc_lo * sum_lo + sc_hi * sum_hi over the
//                           block's two halves, then acc = fma(float(isum), d * xd, acc).
//   Q5_K (qtype 4):         qs [g][b] 320 bytes: Q4's 256 bytes of low nibbles, then [16 rows][4
//                           bytes] of fifth bits: bit 2i + u of byte j of row r is that of
//                           q[r][32b + 16u + 4i + j]; scales as Q4_K's (320 bytes per group and
//                           super-block): w = d * sc * q - dmin * mn, q in 0..31; 5.63 bits a weight.
//
// Block scales stay float16 where GGUF stores them so (Q4_0, Q4_1, Q8_0: 20 bytes per 32 Q4
// weights instead of 24, what a decode step reads); the kernels widen them to float32 exactly
// before any arithmetic.
//
// Threads: OpenMP, and the library is loaded after torch, so `libgomp.so.1` resolves to the copy
// torch already loaded: the kernels run on torch's own thread team. A private pool measured
// badly: its spinning workers and torch's fought for the same 2 cores (decode 20x slower).
// Calls are serialized by a mutex (one scratch buffer): one forward at a time per process.

#include <immintrin.h>
#include <omp.h>

#include <pthread.h>
#include <atomic>
#include <vector>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVS_QK 32

#include "kvserve_kernels.h"

extern "C" {

int kvs_version(void) { return 13; }

}  // extern "C"

namespace {

int g_nth = 1;  // threads per call, set from torch.get_num_threads()

// Bumped by every quantize_row_q8, the one writer of the int8 activations the tiles read: a thread's
// Q6_K activation sums and permuted copy (q6_prepared) made while it is unchanged are still those of
// the same activations (the forward's phases are ordered by barriers, so a relaxed count suffices).
std::atomic<uint64_t> g_xq_epoch{0};
pthread_mutex_t g_call_mu = PTHREAD_MUTEX_INITIALIZER;

// ---------------------------------------------------------------------------------------------
// SIMD helpers

inline float hsum_ps(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// u8 x s8 dot of 32 pairs -> 8 x int32 partial sums
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// s8 x s8 dot of 32 pairs -> 8 x int32 partial sums
inline __m256i dot_s8s8(__m256i a, __m256i b) {
    return dot_u8s8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

}  // namespace

namespace kvs {

// Quantize one row of K floats to int8 blocks of 32. xs may be NULL.
void quantize_row_q8(const float *x, int K, int8_t *xq, float *xd, float *xs) {
    const int nb = K / KVS_QK;
    const __m256 sign_bit = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < nb; b++) {
        const float *p = x + b * KVS_QK;
        __m256 v0 = _mm256_loadu_ps(p), v1 = _mm256_loadu_ps(p + 8);
        __m256 v2 = _mm256_loadu_ps(p + 16), v3 = _mm256_loadu_ps(p + 24);
        __m256 amax = _mm256_andnot_ps(sign_bit, v0);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v1));
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v2));
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v3));
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float max_abs = _mm_cvtss_f32(m4);
        const float d = max_abs / 127.0f;
        const float id = max_abs != 0.0f ? 127.0f / max_abs : 0.0f;
        xd[b] = d;
        const __m256 mul = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), _MM_ROUND_NEAREST));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), _MM_ROUND_NEAREST));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), _MM_ROUND_NEAREST));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), _MM_ROUND_NEAREST));
        if (xs) {
            __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            xs[b] = d * (float)hsum_ps(_mm256_cvtepi32_ps(s));
        }
        i0 = _mm256_packs_epi32(i0, i1);  // lanes interleave; fixed by the permute below
        i2 = _mm256_packs_epi32(i2, i3);
        i0 = _mm256_packs_epi16(i0, i2);
        const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        i0 = _mm256_permutevar8x32_epi32(i0, perm);
        _mm256_storeu_si256((__m256i *)(xq + b * KVS_QK), i0);
    }
    g_xq_epoch.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace kvs

namespace {

using kvs::quantize_row_q8;

// ---------------------------------------------------------------------------------------------
// AVX2 tiles: 8 rows (half h of a 16-row group) x TT tokens, every block of K.

// An empty asm that takes v in a register and gives it back: the compiler must have v's value at
// this point of the loop. Without it GCC reassociates a tile's integer sums (exact, so it may)
// into a tree that computes every product of the block first and spills them to the stack: the
// AVX2 Q4 tile ran at ~95 GMAC/s per thread that way and at ~145 with the sums kept in registers
// in source order (Zen 5, one thread, 1536 x 576 at 2-128 tokens). The values are the same.
template <typename V>
inline void keep_in_register(V &v) { __asm__("" : "+x"(v)); }

inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// Store 8 row results of one token: the valid lanes only (the last group may be padding).
inline void store_rows8(__m256 v, const float *bias, int row0, int nvalid, float *dst, bool add) {
    if (bias) v = _mm256_add_ps(v, nvalid == 8 ? _mm256_loadu_ps(bias + row0) : [&] {
        alignas(32) float b[8] = {0};
        for (int i = 0; i < nvalid; i++) b[i] = bias[row0 + i];
        return _mm256_load_ps(b);
    }());
    if (nvalid == 8) {
        _mm256_storeu_ps(dst, add ? _mm256_add_ps(_mm256_loadu_ps(dst), v) : v);
        return;
    }
    alignas(32) float o[8];
    _mm256_store_ps(o, v);
    for (int i = 0; i < nvalid; i++) dst[i] = add ? dst[i] + o[i] : o[i];
}

// Row group g's 16 outputs (acc0: rows 0-7, acc1: rows 8-15, a group past the last row cut short)
// for tokens t0 .. t0 + n - 1, acc[j] being token t0 + j's.
inline void store_group16(const kvs_weight *w, int g, const __m256 *acc0, const __m256 *acc1, int n, int t0,
                          float *y, int ldy, bool add) {
    const int row0 = g * 16, rest = w->rows - row0;
    for (int j = 0; j < n; j++) {
        float *yt = y + (size_t)(t0 + j) * ldy + row0;
        store_rows8(acc0[j], w->bias, row0, rest < 8 ? rest : 8, yt, add);
        if (rest > 8) store_rows8(acc1[j], w->bias, row0 + 8, rest - 8 < 8 ? rest - 8 : 8, yt + 8, add);
    }
}

// 8 block scales (float16 or float32) at element idx, widened to float32 (exact).
template <bool F16>
inline __m256 scales8(const void *p, size_t idx) {
    if (F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + idx)));
    return _mm256_loadu_ps((const float *)p + idx);
}

// The block scale d and minimum m of 8 rows (half h of group g) for block b: stored per block
// (SM 0: float32, 1: float16), or formed from the Q4_K super-block layout (SM 2, see the top of the
// file): d = d_s * sc, m = -(dmin_s * mn), both exact products in float32 (an fp16 times a 6-bit
// integer), so the bits are those of the per-block float32 layout.
// SM 2-4 are the K-quant layouts (Q4_K, Q6_K, Q5_K); SM 5 is Q4_0 with float16 d and no stored m.
constexpr bool kquant_sm(int sm) { return sm >= 2 && sm <= 4; }

template <int SM>
inline void q4_scales8(const kvs_weight *w, int g, int h, int b, int nb, __m256 *d, __m256 *m) {
    if (SM == 2) {
        const uint8_t *p = (const uint8_t *)w->d + ((size_t)g * (nb / 8) + b / 8) * KVS_KSUPER_BYTES;
        const __m256 ds = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + h * 16)));
        const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + h * 16)));
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 64 + (b % 8) * 16 + h * 8))));
        const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 192 + (b % 8) * 16 + h * 8))));
        *d = _mm256_mul_ps(ds, sc);
        *m = _mm256_xor_ps(_mm256_mul_ps(dm, mn), _mm256_set1_ps(-0.0f));
        return;
    }
    const size_t at = ((size_t)g * nb + b) * 16 + h * 8;
    *d = scales8<SM == 1 || SM == 5>(w->d, at);
    // SM 5: a Q4_0 weight without its minima (m NULL): m = -8 d, the exact float32 product the
    // repack stored (kvs_repack_q4 checks it is a float16), formed here instead of read: a decode
    // step reads 18 bytes per 32 weights, the file's, instead of 20.
    *m = SM == 5 ? _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f)) : scales8<SM == 1>(w->m, at);
}

template <int TT, int SM>
void q4_tile8(const kvs_weight *w, int g, int h, const int8_t *xq, const float *xd, const float *xs, int t0,
              float *y, int ldy, bool add) {
    const int K = w->cols, nb = K / KVS_QK;
    const uint8_t *qg = w->qs + (size_t)g * nb * 256 + h * 32;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[TT];
    for (int j = 0; j < TT; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *qb = qg + (size_t)b * 256;
        __m256i is[TT];
        for (int j = 0; j < TT; j++) is[j] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qb + i * 64));
            const __m256i lo = _mm256_and_si256(raw, mask);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            for (int j = 0; j < TT; j++) {
                const int8_t *xr = xq + (size_t)(t0 + j) * K + b * KVS_QK + 4 * i;
#if defined(__AVXVNNI__)
                is[j] = _mm256_dpbusd_avx_epi32(is[j], lo, bcast4(xr));
                is[j] = _mm256_dpbusd_avx_epi32(is[j], hi, bcast4(xr + 16));
#else
                // int16 partial sums: 16 products of at most 15 * 127 each, no overflow
                is[j] = _mm256_add_epi16(is[j], _mm256_maddubs_epi16(lo, bcast4(xr)));
                is[j] = _mm256_add_epi16(is[j], _mm256_maddubs_epi16(hi, bcast4(xr + 16)));
                keep_in_register(is[j]);
#endif
            }
        }
        __m256 d, m;
        q4_scales8<SM>(w, g, h, b, nb, &d, &m);
        for (int j = 0; j < TT; j++) {
#if defined(__AVXVNNI__)
            const __m256i s32 = is[j];
#else
            const __m256i s32 = _mm256_madd_epi16(is[j], _mm256_set1_epi16(1));
#endif
            const size_t sb = (size_t)(t0 + j) * nb + b;
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(d, _mm256_set1_ps(xd[sb])), acc[j]);
            acc[j] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[sb]), acc[j]);
        }
    }
    const int row0 = g * 16 + h * 8, nvalid = w->rows - row0 < 8 ? w->rows - row0 : 8;
    for (int j = 0; j < TT; j++) store_rows8(acc[j], w->bias, row0, nvalid, y + (size_t)(t0 + j) * ldy + row0, add);
}

template <int TT, bool F16>
void q8_tile8(const kvs_weight *w, int g, int h, const int8_t *xq, const float *xd, const float *, int t0,
              float *y, int ldy, bool add) {
    const int K = w->cols, nb = K / KVS_QK;
    const uint8_t *qg = w->qs + (size_t)g * nb * 512 + h * 32;
    const size_t s0 = (size_t)g * nb * 16 + h * 8;
    __m256 acc[TT];
    for (int j = 0; j < TT; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *qb = qg + (size_t)b * 512;
        __m256i is[TT];
        for (int j = 0; j < TT; j++) is[j] = _mm256_setzero_si256();
        for (int i = 0; i < 8; i++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qb + i * 64));
            const __m256i a = _mm256_sign_epi8(raw, raw);   // |q| as u8 (the sign goes onto x)
            for (int j = 0; j < TT; j++) {
                const __m256i sx = _mm256_sign_epi8(bcast4(xq + (size_t)(t0 + j) * K + b * KVS_QK + 4 * i), raw);
#if defined(__AVXVNNI__)
                is[j] = _mm256_dpbusd_avx_epi32(is[j], a, sx);
#else
                is[j] = _mm256_add_epi32(is[j], _mm256_madd_epi16(_mm256_maddubs_epi16(a, sx), _mm256_set1_epi16(1)));
                keep_in_register(is[j]);
#endif
            }
        }
        const __m256 d = scales8<F16>(w->d, s0 + (size_t)b * 16);
        for (int j = 0; j < TT; j++)
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[j]),
                                     _mm256_mul_ps(d, _mm256_set1_ps(xd[(size_t)(t0 + j) * nb + b])), acc[j]);
    }
    const int row0 = g * 16 + h * 8, nvalid = w->rows - row0 < 8 ? w->rows - row0 : 8;
    for (int j = 0; j < TT; j++) store_rows8(acc[j], w->bias, row0, nvalid, y + (size_t)(t0 + j) * ldy + row0, add);
}

// Bit `from` of every byte of v moved to bit 4 (a 16-bit shift; the bits it carries across a byte
// boundary never land on bit 4), the rest cleared.
template <int from>
inline __m256i bit_to4(__m256i v) {
    const __m256i m = _mm256_set1_epi8(0x10);
    if constexpr (from < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - from), m);
    else if constexpr (from > 4) return _mm256_and_si256(_mm256_srli_epi16(v, from - 4), m);
    else return _mm256_and_si256(v, m);
}

// 8 int8 sub-block scales as int32 lanes holding the scale in both int16 halves (for vpmaddwd).
inline __m256i q6_scale_pairs(const uint8_t *p) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}


// ---------------------------------------------------------------------------------------------
// Decode tiles of the K-quants: a whole 16-row group x one token. Each output lane runs exactly the
// arithmetic of the 8-row tiles above (the same exact integer sums, the same float chain); the two
// halves share every activation broadcast, consume whole 64-byte lines of codes in address order
// (the 8-row tiles read half of each line and come back for the other half), and the super-block's
// fp16 scales are widened once per 8 blocks instead of once per block.

inline __m256 cvt_ph8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

// 8 u8 at p as float32 (exact); the load folds into vpmovzxbd.
inline __m256 u8x8_ps(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

// is += the u8 x s8 products of lo (with xa) and hi (with xb) of 4-bit codes: int16 lanes (at most
// 8 x 2 x 15 x 127 per block).
inline void kq_dot(__m256i &is, __m256i lo, __m256i hi, __m256i xa, __m256i xb) {
#if defined(__AVXVNNI__)
    is = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(is, lo, xa), hi, xb);
#else
    is = _mm256_add_epi16(is, _mm256_maddubs_epi16(lo, xa));
    is = _mm256_add_epi16(is, _mm256_maddubs_epi16(hi, xb));
    keep_in_register(is);
#endif
}

// Q5_K's is += the products of chunk i (lo with xa, hi with xb): int16 sums over a chunk pair in t
// (4 x 2 x 31 x 127 < 2^15), widened to int32 once per pair; the exact sum of the chunks' products.
template <int i>
inline void q5_dot(__m256i &is, __m256i &t, __m256i lo, __m256i hi, __m256i xa, __m256i xb) {
#if defined(__AVXVNNI__)
    (void)t;
    is = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(is, lo, xa), hi, xb);
#else
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb));
    if constexpr (i % 2 == 0) {
        t = p;
        keep_in_register(t);
    } else {
        is = _mm256_add_epi32(is, _mm256_madd_epi16(_mm256_add_epi16(t, p), _mm256_set1_epi16(1)));
        keep_in_register(is);
    }
#endif
}

// Q4_K (Q5 false) and Q5_K (Q5 true), 16 rows x token t0.
template <bool Q5>
void q4k_tile16x1(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const float *xs, int t0,
                  float *y, int ldy, bool add) {
    constexpr int BB = Q5 ? KVS_Q5_BLOCK_BYTES : 256;
    const int K = w->cols, nb = K / KVS_QK, ns = nb / 8;
    const uint8_t *qb = w->qs + (size_t)g * nb * BB;
    const uint8_t *p = (const uint8_t *)w->d + (size_t)g * ns * KVS_KSUPER_BYTES;
    const int8_t *x = xq + (size_t)t0 * K;
    const float *xdt = xd + (size_t)t0 * nb, *xst = xs + (size_t)t0 * nb;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int s = 0; s < ns; s++, p += KVS_KSUPER_BYTES) {
        const __m256 ds0 = cvt_ph8(p), ds1 = cvt_ph8(p + 16), dm0 = cvt_ph8(p + 32), dm1 = cvt_ph8(p + 48);
        for (int j = 0; j < 8; j++, qb += BB, x += KVS_QK) {
            __m256i is0 = _mm256_setzero_si256(), is1 = _mm256_setzero_si256();
            __m256i hb0 = _mm256_setzero_si256(), hb1 = _mm256_setzero_si256();
            __m256i t0 = _mm256_setzero_si256(), t1 = _mm256_setzero_si256();   // Q5: a chunk pair's int16 sums
            if constexpr (Q5) {
                hb0 = _mm256_loadu_si256((const __m256i *)(qb + 256));
                hb1 = _mm256_loadu_si256((const __m256i *)(qb + 288));
            }
#define KVS_KQ_CHUNK(i)                                                                              \
            {                                                                                        \
                const __m256i r0 = _mm256_loadu_si256((const __m256i *)(qb + (i) * 64));             \
                const __m256i r1 = _mm256_loadu_si256((const __m256i *)(qb + (i) * 64 + 32));        \
                __m256i lo0 = _mm256_and_si256(r0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), mask); \
                __m256i lo1 = _mm256_and_si256(r1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), mask); \
                if constexpr (Q5) {                                                                  \
                    lo0 = _mm256_or_si256(lo0, bit_to4<2 * (i)>(hb0));                               \
                    hi0 = _mm256_or_si256(hi0, bit_to4<2 * (i) + 1>(hb0));                           \
                    lo1 = _mm256_or_si256(lo1, bit_to4<2 * (i)>(hb1));                               \
                    hi1 = _mm256_or_si256(hi1, bit_to4<2 * (i) + 1>(hb1));                           \
                }                                                                                    \
                const __m256i xa = bcast4(x + 4 * (i)), xb = bcast4(x + 16 + 4 * (i));               \
                if constexpr (Q5) {                                                                  \
                    q5_dot<(i)>(is0, t0, lo0, hi0, xa, xb);                                          \
                    q5_dot<(i)>(is1, t1, lo1, hi1, xa, xb);                                          \
                } else {                                                                             \
                    kq_dot(is0, lo0, hi0, xa, xb);                                            \
                    kq_dot(is1, lo1, hi1, xa, xb);                                            \
                }                                                                                    \
            }
            KVS_KQ_CHUNK(0) KVS_KQ_CHUNK(1) KVS_KQ_CHUNK(2) KVS_KQ_CHUNK(3)
#undef KVS_KQ_CHUNK
            const __m256 sc0 = u8x8_ps(p + 64 + j * 16), sc1 = u8x8_ps(p + 72 + j * 16);
            const __m256 mn0 = u8x8_ps(p + 192 + j * 16), mn1 = u8x8_ps(p + 200 + j * 16);
#if !defined(__AVXVNNI__)
            if constexpr (!Q5) {
                is0 = _mm256_madd_epi16(is0, _mm256_set1_epi16(1));
                is1 = _mm256_madd_epi16(is1, _mm256_set1_epi16(1));
            }
#endif
            const int b = s * 8 + j;
            const __m256 xdb = _mm256_set1_ps(xdt[b]), xsb = _mm256_set1_ps(xst[b]);
            // acc + m xs with m = -(dm mn): one fnmadd, the same rounding (the negation is exact)
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is0), _mm256_mul_ps(_mm256_mul_ps(ds0, sc0), xdb), acc0);
            acc0 = _mm256_fnmadd_ps(_mm256_mul_ps(dm0, mn0), xsb, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is1), _mm256_mul_ps(_mm256_mul_ps(ds1, sc1), xdb), acc1);
            acc1 = _mm256_fnmadd_ps(_mm256_mul_ps(dm1, mn1), xsb, acc1);
        }
    }
    store_group16(w, g, &acc0, &acc1, 1, t0, y, ldy, add);
}

// The 6-bit codes of one chunk i (8 rows x 4 bytes, both halves of the block) as unsigned q in
// 0..63 (q - 32 without the - 32: the 32 x activation sum is taken off the exact integer sum once
// per block, see q6_tile16x1).
inline void q6_ucodes(__m256i raw, __m256i hb, int i, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i h_lo = i & 1 ? hb : _mm256_slli_epi16(hb, 4);                       // bits 4-5 <- 0-1 / 4-5
    const __m256i h_hi = i & 1 ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 2);  // bits 4-5 <- 6-7 / 2-3
    *lo = _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_and_si256(h_lo, m2));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), _mm256_and_si256(h_hi, m2));
}

// The sums of one token's int8 activations over each 16-value half of block b, packed as the int16
// pair (lo, hi) of one int32 (|sum| <= 16 x 127), for vpmaddwd against a row's (sc_lo, sc_hi).
inline int32_t x_half_sums(const int8_t *x) {
    const __m128i a = _mm_loadu_si128((const __m128i *)x), b = _mm_loadu_si128((const __m128i *)(x + 16));
    const __m128i one = _mm_set1_epi8(1);
    // u8 ones x s8 values -> int16 pair sums, then int32 sums of 4: lanes 0-1 of lo, 2-3 of hi
    __m128i s = _mm_hadd_epi32(_mm_madd_epi16(_mm_maddubs_epi16(one, a), _mm_set1_epi16(1)),
                               _mm_madd_epi16(_mm_maddubs_epi16(one, b), _mm_set1_epi16(1)));
    s = _mm_hadd_epi32(s, s);   // lane 0: lo sum, lane 1: hi sum
    return (int32_t)(((uint32_t)_mm_extract_epi32(s, 1) << 16) | ((uint32_t)_mm_cvtsi128_si32(s) & 0xFFFF));
}

// Q6_K, 16 rows x token t0. Per output the exact integer sum of the written-out arithmetic
// (sum over the block of sc * (q - 32) * x), formed as sc_lo * sum(q * x)_lo + sc_hi * sum(q * x)_hi
// - 32 (sc_lo * X_lo + sc_hi * X_hi) with unsigned codes q (X: the activations' sum over that half):
// the identity is exact in int32, so the float chain sees the same integer; signed codes would need
// four sign flips and a - 32 per chunk (vpmaddubsw takes the unsigned codes as they are). int16 pair sums: 2 chunks x 2 x 63 x 127 < 2^15.
void q6_tile16x1(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const int32_t *xh, int t0,
                 float *y, int ldy, bool add) {
    const int K = w->cols, nb = K / KVS_QK, ns = nb / 8;
    const uint8_t *qb = w->qs + (size_t)g * nb * KVS_Q6_BLOCK_BYTES;
    const uint8_t *ks = (const uint8_t *)w->d + (size_t)g * ns * KVS_Q6_SUPER_BYTES;
    const int8_t *x = xq + (size_t)t0 * K;
    const float *xdt = xd + (size_t)t0 * nb;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int s = 0; s < ns; s++, ks += KVS_Q6_SUPER_BYTES) {
        const __m256 d0 = cvt_ph8(ks), d1 = cvt_ph8(ks + 16);
        for (int j = 0; j < 8; j++, qb += KVS_Q6_BLOCK_BYTES, x += KVS_QK) {
            __m256i a[2][2][2];   // [chunk pair][rows 0-7, 8-15][lo, hi half]: int16 pair sums
            for (int pr = 0; pr < 2; pr++) {
                const __m256i hb0 = _mm256_loadu_si256((const __m256i *)(qb + 256 + pr * 64));
                const __m256i hb1 = _mm256_loadu_si256((const __m256i *)(qb + 256 + pr * 64 + 32));
                for (int u = 0; u < 2; u++) {
                    const int i = 2 * pr + u;
                    __m256i lo0, hi0, lo1, hi1;
                    q6_ucodes(_mm256_loadu_si256((const __m256i *)(qb + i * 64)), hb0, i, &lo0, &hi0);
                    q6_ucodes(_mm256_loadu_si256((const __m256i *)(qb + i * 64 + 32)), hb1, i, &lo1, &hi1);
                    const __m256i xa = bcast4(x + 4 * i), xb = bcast4(x + 16 + 4 * i);
                    const __m256i p0 = _mm256_maddubs_epi16(lo0, xa), p1 = _mm256_maddubs_epi16(hi0, xb);
                    const __m256i p2 = _mm256_maddubs_epi16(lo1, xa), p3 = _mm256_maddubs_epi16(hi1, xb);
                    if (u == 0) {
                        a[pr][0][0] = p0, a[pr][0][1] = p1, a[pr][1][0] = p2, a[pr][1][1] = p3;
                    } else {
                        a[pr][0][0] = _mm256_add_epi16(a[pr][0][0], p0);
                        a[pr][0][1] = _mm256_add_epi16(a[pr][0][1], p1);
                        a[pr][1][0] = _mm256_add_epi16(a[pr][1][0], p2);
                        a[pr][1][1] = _mm256_add_epi16(a[pr][1][1], p3);
                    }
                    keep_in_register(a[pr][0][0]);
                    keep_in_register(a[pr][0][1]);
                    keep_in_register(a[pr][1][0]);
                    keep_in_register(a[pr][1][1]);
                }
            }
            // scales of sub-blocks 2j (lo) and 2j + 1 (hi), rows 0-15: (sc, sc) pairs and (sc_lo, sc_hi) pairs
            const __m128i vl = _mm_loadu_si128((const __m128i *)(ks + 32 + (2 * j) * 16));
            const __m128i vh = _mm_loadu_si128((const __m128i *)(ks + 32 + (2 * j + 1) * 16));
            const __m256i sl0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(vl, vl)), sl1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(vl, vl));
            const __m256i sh0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(vh, vh)), sh1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(vh, vh));
            const __m256i lh0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(vl, vh)), lh1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(vl, vh));
            const __m256i xx = _mm256_set1_epi32(xh[s * 8 + j]);
            __m256i s0 = _mm256_add_epi32(_mm256_madd_epi16(a[0][0][0], sl0), _mm256_madd_epi16(a[0][0][1], sh0));
            __m256i s1 = _mm256_add_epi32(_mm256_madd_epi16(a[0][1][0], sl1), _mm256_madd_epi16(a[0][1][1], sh1));
            s0 = _mm256_add_epi32(s0, _mm256_add_epi32(_mm256_madd_epi16(a[1][0][0], sl0), _mm256_madd_epi16(a[1][0][1], sh0)));
            s1 = _mm256_add_epi32(s1, _mm256_add_epi32(_mm256_madd_epi16(a[1][1][0], sl1), _mm256_madd_epi16(a[1][1][1], sh1)));
            s0 = _mm256_sub_epi32(s0, _mm256_slli_epi32(_mm256_madd_epi16(lh0, xx), 5));
            s1 = _mm256_sub_epi32(s1, _mm256_slli_epi32(_mm256_madd_epi16(lh1, xx), 5));
            const __m256 xdb = _mm256_set1_ps(xdt[s * 8 + j]);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, xdb), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, xdb), acc1);
        }
    }
    store_group16(w, g, &acc0, &acc1, 1, t0, y, ldy, add);
}

// Q6_K prompt tiles' activations: each 32-value block of n bytes (a multiple of 32) with its int8
// pairs reordered so that chunk i's 4-byte lanes hold values (4i, 4i+1, 16+4i+2, 16+4i+3) at
// 4i..4i+3 and (4i+2, 4i+3, 16+4i, 16+4i+1) at 16+4i..16+4i+3: q6_pair_codes' order. As 16 pairs
// P0..P15 (P8.. the block's upper half): P0 P9 P2 P11 P4 P13 P6 P15 | P1 P8 P3 P10 P5 P12 P7 P14.
inline void q6_permute_x(const int8_t *x, size_t n, int8_t *xp) {
    for (size_t k = 0; k < n; k += KVS_QK) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(x + k));
        const __m256i s = _mm256_permute2x128_si256(a, a, 1);   // the two halves swapped
        const __m256i lo = _mm256_blend_epi16(a, s, 0xAA);
        const __m256i hi = _mm256_blend_epi16(_mm256_srli_si256(s, 2), _mm256_slli_si256(a, 2), 0xAA);
        _mm256_storeu_si256((__m256i *)(xp + k), _mm256_blend_epi32(lo, hi, 0xF0));
    }
}

// Chunk i's 6-bit codes of 8 rows (raw: nibbles, hb: the pair's high bits) as two vectors whose
// 4-byte row lanes each hold two codes of the block's lower sub-block then two of its upper one:
// v1 = (q[4i], q[4i+1], q[16+4i+2], q[16+4i+3]), v2 = (q[4i+2], q[4i+3], q[16+4i], q[16+4i+1]).
// Against q6_permute_x's activations one vpmaddubsw of each gives int16 lanes (lower, upper) sums of
// a row, which one vpmaddwd against the row's (sc_lo, sc_hi) scales: one int32 sum per row and
// token, where separate lower and upper int16 sums need two (the 16-row tile fits in 16 registers).
inline void q6_pair_codes(__m256i raw, __m256i hb, int i, __m256i rot, __m256i *v1, __m256i *v2) {
    __m256i lo, hi;
    q6_ucodes(raw, hb, i, &lo, &hi);
    *v1 = _mm256_blend_epi16(lo, hi, 0xAA);
    *v2 = _mm256_shuffle_epi8(_mm256_blend_epi16(hi, lo, 0xAA), rot);   // the two int16 halves swapped
}

// Chunk i's codes of a 16-row block at qb as the prompt tiles read them: c[0], c[1] for rows 0-7,
// c[2], c[3] for rows 8-15; Q5_K: the low and high halves' 5-bit codes, Q6_K: q6_pair_codes' v1, v2.
// U: read them from a group's unpacked copy u instead (unpack_group: 128 bytes a chunk, the same values).
template <int i, bool U>
inline void q5_codes(const uint8_t *qb, const uint8_t *u, __m256i *c) {
    if constexpr (U) {
        for (int k = 0; k < 4; k++) c[k] = _mm256_load_si256((const __m256i *)(u + i * 128 + k * 32));
        return;
    }
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i r0 = _mm256_loadu_si256((const __m256i *)(qb + i * 64));
    const __m256i r1 = _mm256_loadu_si256((const __m256i *)(qb + i * 64 + 32));
    const __m256i hb0 = _mm256_loadu_si256((const __m256i *)(qb + 256));
    const __m256i hb1 = _mm256_loadu_si256((const __m256i *)(qb + 288));
    c[0] = _mm256_or_si256(_mm256_and_si256(r0, mask), bit_to4<2 * i>(hb0));
    c[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(r0, 4), mask), bit_to4<2 * i + 1>(hb0));
    c[2] = _mm256_or_si256(_mm256_and_si256(r1, mask), bit_to4<2 * i>(hb1));
    c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(r1, 4), mask), bit_to4<2 * i + 1>(hb1));
}

template <int i, bool U>
inline void q6_codes(const uint8_t *qb, const uint8_t *u, __m256i *c) {
    if constexpr (U) {
        for (int k = 0; k < 4; k++) c[k] = _mm256_load_si256((const __m256i *)(u + i * 128 + k * 32));
        return;
    }
    const __m256i rot = _mm256_setr_epi8(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13,
                                         2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const __m256i hb0 = _mm256_loadu_si256((const __m256i *)(qb + 256 + (i / 2) * 64));
    const __m256i hb1 = _mm256_loadu_si256((const __m256i *)(qb + 256 + (i / 2) * 64 + 32));
    q6_pair_codes(_mm256_loadu_si256((const __m256i *)(qb + i * 64)), hb0, i, rot, &c[0], &c[1]);
    q6_pair_codes(_mm256_loadu_si256((const __m256i *)(qb + i * 64 + 32)), hb1, i, rot, &c[2], &c[3]);
}

// One chunk's u8 codes c[0..3] (the Q5_K / Q6_K 16-row tiles' q5_codes / q6_codes) times one token's
// int8 activations xr, xr + 16 (each 4-value group broadcast): the int16 sums of c[0], c[1] (p0) and
// of c[2], c[3] (p1).
inline void chunk_products(const __m256i c[4], const int8_t *xr, __m256i *p0, __m256i *p1) {
    const __m256i xa = bcast4(xr), xb = bcast4(xr + 16);
    *p0 = _mm256_add_epi16(_mm256_maddubs_epi16(c[0], xa), _mm256_maddubs_epi16(c[1], xb));
    *p1 = _mm256_add_epi16(_mm256_maddubs_epi16(c[2], xa), _mm256_maddubs_epi16(c[3], xb));
}

// Q6_K, chunk i of one block for 16 rows x TT tokens: the codes once (q6_codes), each token's
// products scaled by its rows' (sc_lo, sc_hi) pairs lh0 / lh1 into the int32 sums is0 / is1.
template <int i, int TT, bool U>
inline void q6_chunk16(const uint8_t *qb, const uint8_t *u, const int8_t *xp, int K, __m256i lh0, __m256i lh1,
                       __m256i *is0, __m256i *is1) {
    __m256i c[4];
    q6_codes<i, U>(qb, u, c);
    for (int t = 0; t < TT; t++) {
        __m256i p0, p1;
        chunk_products(c, xp + (size_t)t * K + 4 * i, &p0, &p1);
        is0[t] = _mm256_add_epi32(is0[t], _mm256_madd_epi16(p0, lh0));
        is1[t] = _mm256_add_epi32(is1[t], _mm256_madd_epi16(p1, lh1));
        keep_in_register(is0[t]);
        keep_in_register(is1[t]);
    }
}

// Group g's codes of a Q5_K (Q6 false) or Q6_K weight as q5_codes / q6_codes give them, into u (512
// bytes a block, 32-byte aligned): a prompt's token tiles then load them instead of each unpacking
// them again (Q5_K: 17 vector operations a chunk, Q6_K: 24, against ~45 of products for 4 tokens).
template <bool Q6>
void unpack_group(const kvs_weight *w, int g, uint8_t *u) {
    constexpr int BB = Q6 ? KVS_Q6_BLOCK_BYTES : KVS_Q5_BLOCK_BYTES;
    const int nb = w->cols / KVS_QK;
    const uint8_t *qb = w->qs + (size_t)g * nb * BB;
    for (int b = 0; b < nb; b++, qb += BB, u += 512) {
        __m256i c[16];
        if constexpr (Q6) {
            q6_codes<0, false>(qb, nullptr, c), q6_codes<1, false>(qb, nullptr, c + 4);
            q6_codes<2, false>(qb, nullptr, c + 8), q6_codes<3, false>(qb, nullptr, c + 12);
        } else {
            q5_codes<0, false>(qb, nullptr, c), q5_codes<1, false>(qb, nullptr, c + 4);
            q5_codes<2, false>(qb, nullptr, c + 8), q5_codes<3, false>(qb, nullptr, c + 12);
        }
        for (int k = 0; k < 16; k++) _mm256_store_si256((__m256i *)(u + k * 32), c[k]);
    }
}

// Q6_K, 16 rows x TT tokens t0..t0+TT-1 (TT 2-4): per output q6_tile16x1's exact integer (the
// written-out sum of sc * (q - 32) * x, formed here as -32 (sc_lo X_lo + sc_hi X_hi) plus each chunk's
// sc_lo * sum_lo + sc_hi * sum_hi; int16 lanes hold one chunk's 4 products, 4 x 63 x 128 < 2^15) and
// its float chain. xp: token t0's q6_permute_x activations (row stride K); xh: x_half_sums [t][b].
template <int TT, bool U>
void q6_tile16xn(const kvs_weight *w, int g, const uint8_t *u, const int8_t *xp, const float *xd, const int32_t *xh,
                 int t0, float *y, int ldy, bool add) {
    const int K = w->cols, nb = K / KVS_QK, ns = nb / 8;
    const uint8_t *qb = w->qs + (size_t)g * nb * KVS_Q6_BLOCK_BYTES;
    const uint8_t *ks = (const uint8_t *)w->d + (size_t)g * ns * KVS_Q6_SUPER_BYTES;
    const float *xdt = xd + (size_t)t0 * nb;
    const int32_t *xht = xh + (size_t)t0 * nb;
    __m256 acc0[TT], acc1[TT];
    for (int t = 0; t < TT; t++) acc0[t] = acc1[t] = _mm256_setzero_ps();
    for (int s = 0; s < ns; s++, ks += KVS_Q6_SUPER_BYTES) {
        const __m256 d0 = cvt_ph8(ks), d1 = cvt_ph8(ks + 16);
        for (int j = 0; j < 8; j++, qb += KVS_Q6_BLOCK_BYTES, u += U ? 512 : 0, xp += KVS_QK) {
            const int b = s * 8 + j;
            // (sc_lo, sc_hi) int16 pairs of rows 0-7 and 8-15 (sub-blocks 2j, 2j + 1)
            const __m128i vl = _mm_loadu_si128((const __m128i *)(ks + 32 + (2 * j) * 16));
            const __m128i vh = _mm_loadu_si128((const __m128i *)(ks + 32 + (2 * j + 1) * 16));
            const __m256i lh0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(vl, vh));
            const __m256i lh1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(vl, vh));
            const __m256i n0 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(lh0, 5));
            const __m256i n1 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(lh1, 5));
            __m256i is0[TT], is1[TT];
            for (int t = 0; t < TT; t++) {   // each sum starts at -32 (sc_lo X_lo + sc_hi X_hi)
                const __m256i xx = _mm256_set1_epi32(xht[(size_t)t * nb + b]);
                is0[t] = _mm256_madd_epi16(n0, xx);
                is1[t] = _mm256_madd_epi16(n1, xx);
            }
            q6_chunk16<0, TT, U>(qb, u, xp, K, lh0, lh1, is0, is1);
            q6_chunk16<1, TT, U>(qb, u, xp, K, lh0, lh1, is0, is1);
            q6_chunk16<2, TT, U>(qb, u, xp, K, lh0, lh1, is0, is1);
            q6_chunk16<3, TT, U>(qb, u, xp, K, lh0, lh1, is0, is1);
            for (int t = 0; t < TT; t++) {
                const __m256 xdb = _mm256_set1_ps(xdt[(size_t)t * nb + b]);
                acc0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is0[t]), _mm256_mul_ps(d0, xdb), acc0[t]);
                acc1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is1[t]), _mm256_mul_ps(d1, xdb), acc1[t]);
            }
        }
    }
    store_group16(w, g, acc0, acc1, TT, t0, y, ldy, add);
}

// Q4_0 / Q4_1 (SM 0, 1, 5), 16 rows x token t0: q4_tile8's arithmetic per output lane (the same
// exact integer sums, the same float chain), with the K-quant decode tiles' access pattern: both
// halves of the group share each activation broadcast and consume whole 64-byte lines of codes in
// address order. The 8-row tile's first half fetched every line of the group from memory while
// using half of it, and its second half ran from cache with the memory idle; streaming whole lines
// keeps the prefetchers busy for the whole group (a decode step of a Q4_0 file is ~90% this loop).
template <int SM>
void q4_tile16x1(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const float *xs, int t0, float *y,
                 int ldy, bool add) {
    const int K = w->cols, nb = K / KVS_QK;
    const uint8_t *qb = w->qs + (size_t)g * nb * 256;
    const int8_t *x = xq + (size_t)t0 * K;
    const float *xdt = xd + (size_t)t0 * nb, *xst = xs + (size_t)t0 * nb;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, qb += 256, x += KVS_QK) {
        __m256i is0 = _mm256_setzero_si256(), is1 = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i r0 = _mm256_loadu_si256((const __m256i *)(qb + i * 64));
            const __m256i r1 = _mm256_loadu_si256((const __m256i *)(qb + i * 64 + 32));
            const __m256i xa = bcast4(x + 4 * i), xb = bcast4(x + 16 + 4 * i);
            kq_dot(is0, _mm256_and_si256(r0, mask), _mm256_and_si256(_mm256_srli_epi16(r0, 4), mask), xa, xb);
            kq_dot(is1, _mm256_and_si256(r1, mask), _mm256_and_si256(_mm256_srli_epi16(r1, 4), mask), xa, xb);
        }
#if !defined(__AVXVNNI__)
        is0 = _mm256_madd_epi16(is0, _mm256_set1_epi16(1));
        is1 = _mm256_madd_epi16(is1, _mm256_set1_epi16(1));
#endif
        __m256 d0, m0, d1, m1;
        q4_scales8<SM>(w, g, 0, b, nb, &d0, &m0);
        q4_scales8<SM>(w, g, 1, b, nb, &d1, &m1);
        const __m256 xdb = _mm256_set1_ps(xdt[b]), xsb = _mm256_set1_ps(xst[b]);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is0), _mm256_mul_ps(d0, xdb), acc0);
        acc0 = _mm256_fmadd_ps(m0, xsb, acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is1), _mm256_mul_ps(d1, xdb), acc1);
        acc1 = _mm256_fmadd_ps(m1, xsb, acc1);
    }
    store_group16(w, g, &acc0, &acc1, 1, t0, y, ldy, add);
}

// Q4_0 / Q4_1 (SM 0, 1, 5) and Q4_K (SM 2, its scales formed per block by q4_scales8), 16 rows x TT
// tokens t0..t0+TT-1 (TT 2-4): q4_tile16x1 per token (Q4_K: q4k_tile16x1), the
// same exact integer sums and float chain per output lane. Each 64-byte line of codes is unpacked
// once for TT tokens and each activation broadcast serves both halves of the group. At TT 4 the
// 8 int16 sums, 4 unpacked code vectors, the mask and 2 broadcasts fill the 16 ymm registers (the
// accumulators live in L1 between blocks); TT 5-6 spill the sums and ran 5-15% slower. One thread
// on Zen 3 (AVX2, no VNNI), the default model's shapes at 32 tokens: 1.13-1.19x the 8 rows x 4
// tokens of q4_tile8 (whose 8 broadcasts per chunk fed 8 rows only), T = 2: 1.25-1.34x (BENCHMARKS.md).
template <int TT, int SM>
void q4_tile16xn(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const float *xs, int t0, float *y,
                 int ldy, bool add) {
    const int K = w->cols, nb = K / KVS_QK;
    const uint8_t *qb = w->qs + (size_t)g * nb * 256;
    const int8_t *x = xq + (size_t)t0 * K;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc0[TT], acc1[TT];
    for (int j = 0; j < TT; j++) acc0[j] = acc1[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++, qb += 256, x += KVS_QK) {
        __m256i is0[TT], is1[TT];
        for (int j = 0; j < TT; j++) is0[j] = is1[j] = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256i r0 = _mm256_loadu_si256((const __m256i *)(qb + i * 64));
            const __m256i r1 = _mm256_loadu_si256((const __m256i *)(qb + i * 64 + 32));
            const __m256i lo0 = _mm256_and_si256(r0, mask), hi0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), mask);
            const __m256i lo1 = _mm256_and_si256(r1, mask), hi1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), mask);
            for (int j = 0; j < TT; j++) {
                const int8_t *xr = x + (size_t)j * K + 4 * i;
                const __m256i xa = bcast4(xr), xb = bcast4(xr + 16);
                kq_dot(is0[j], lo0, hi0, xa, xb);
                kq_dot(is1[j], lo1, hi1, xa, xb);
            }
        }
        __m256 d0, m0, d1, m1;
        q4_scales8<SM>(w, g, 0, b, nb, &d0, &m0);
        q4_scales8<SM>(w, g, 1, b, nb, &d1, &m1);
        for (int j = 0; j < TT; j++) {
#if defined(__AVXVNNI__)
            const __m256i s0 = is0[j], s1 = is1[j];
#else
            const __m256i s0 = _mm256_madd_epi16(is0[j], _mm256_set1_epi16(1));
            const __m256i s1 = _mm256_madd_epi16(is1[j], _mm256_set1_epi16(1));
#endif
            const size_t sb = (size_t)(t0 + j) * nb + b;
            const __m256 xdb = _mm256_set1_ps(xd[sb]), xsb = _mm256_set1_ps(xs[sb]);
            acc0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, xdb), acc0[j]);
            acc0[j] = _mm256_fmadd_ps(m0, xsb, acc0[j]);
            acc1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, xdb), acc1[j]);
            acc1[j] = _mm256_fmadd_ps(m1, xsb, acc1[j]);
        }
    }
    store_group16(w, g, acc0, acc1, TT, t0, y, ldy, add);
}

// Q5_K, chunk i of one block for 16 rows x TT tokens: the codes (q5_codes: nibbles plus bits 2i,
// 2i + 1 of the fifth-bit plane at bit 4) once, their u8 x s8 products added to the int16 sums t0/t1
// (rows 0-7, 8-15); u = 0 starts a chunk pair's sums. x: token t0's activations of the block (row stride K).
template <int i, int TT, bool U>
inline void q5_chunk16(const uint8_t *qb, const uint8_t *u, const int8_t *x, int K, __m256i *t0, __m256i *t1) {
    __m256i c[4];
    q5_codes<i, U>(qb, u, c);
    for (int j = 0; j < TT; j++) {
        __m256i p0, p1;
        chunk_products(c, x + (size_t)j * K + 4 * i, &p0, &p1);
        if constexpr (i % 2 == 0) {
            t0[j] = p0, t1[j] = p1;
        } else {
            t0[j] = _mm256_add_epi16(t0[j], p0), t1[j] = _mm256_add_epi16(t1[j], p1);
        }
        keep_in_register(t0[j]);
        keep_in_register(t1[j]);
    }
}

// Q5_K, 16 rows x TT tokens t0..t0+TT-1 (TT 2-4): q4k_tile16x1's arithmetic per output lane (the
// same exact integer block sums, the same float chain), q4_tile16xn's access pattern. The codes run
// to 31, so an int16 lane holds two chunks' products (4 x 2 x 31 x 127 < 2^15): each chunk pair's
// sums are widened to int32 once (q5_dot's pairs, here for TT tokens).
template <int TT, bool U>
void q5k_tile16xn(const kvs_weight *w, int g, const uint8_t *u, const int8_t *xq, const float *xd, const float *xs,
                  int t0, float *y, int ldy, bool add) {
    const int K = w->cols, nb = K / KVS_QK, ns = nb / 8;
    const uint8_t *qb = w->qs + (size_t)g * nb * KVS_Q5_BLOCK_BYTES;
    const uint8_t *p = (const uint8_t *)w->d + (size_t)g * ns * KVS_KSUPER_BYTES;
    const int8_t *x = xq + (size_t)t0 * K;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0[TT], acc1[TT];
    for (int j = 0; j < TT; j++) acc0[j] = acc1[j] = _mm256_setzero_ps();
    for (int s = 0; s < ns; s++, p += KVS_KSUPER_BYTES) {
        for (int jb = 0; jb < 8; jb++, qb += KVS_Q5_BLOCK_BYTES, u += U ? 512 : 0, x += KVS_QK) {
            __m256i is0[TT], is1[TT], u0[TT], u1[TT];
            q5_chunk16<0, TT, U>(qb, u, x, K, u0, u1);
            q5_chunk16<1, TT, U>(qb, u, x, K, u0, u1);
            for (int j = 0; j < TT; j++) is0[j] = _mm256_madd_epi16(u0[j], ones), is1[j] = _mm256_madd_epi16(u1[j], ones);
            q5_chunk16<2, TT, U>(qb, u, x, K, u0, u1);
            q5_chunk16<3, TT, U>(qb, u, x, K, u0, u1);
            const __m256 ds0 = cvt_ph8(p), ds1 = cvt_ph8(p + 16), dm0 = cvt_ph8(p + 32), dm1 = cvt_ph8(p + 48);
            const __m256 d0 = _mm256_mul_ps(ds0, u8x8_ps(p + 64 + jb * 16)), d1 = _mm256_mul_ps(ds1, u8x8_ps(p + 72 + jb * 16));
            const __m256 mn0 = _mm256_mul_ps(dm0, u8x8_ps(p + 192 + jb * 16)), mn1 = _mm256_mul_ps(dm1, u8x8_ps(p + 200 + jb * 16));
            const int b = s * 8 + jb;
            for (int j = 0; j < TT; j++) {
                const __m256i s0 = _mm256_add_epi32(is0[j], _mm256_madd_epi16(u0[j], ones));
                const __m256i s1 = _mm256_add_epi32(is1[j], _mm256_madd_epi16(u1[j], ones));
                const size_t sb = (size_t)(t0 + j) * nb + b;
                const __m256 xdb = _mm256_set1_ps(xd[sb]), xsb = _mm256_set1_ps(xs[sb]);
                // acc + m xs with m = -(dm mn): one fnmadd, the same rounding (the negation is exact)
                acc0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, xdb), acc0[j]);
                acc0[j] = _mm256_fnmadd_ps(mn0, xsb, acc0[j]);
                acc1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, xdb), acc1[j]);
                acc1[j] = _mm256_fnmadd_ps(mn1, xsb, acc1[j]);
            }
        }
    }
    store_group16(w, g, acc0, acc1, TT, t0, y, ldy, add);
}

// Q6_K (Q6) or Q5_K, tokens [tb, te) of group g in whole 16-row tiles, tokens in fours
// (q6_tile16xn / q5k_tile16xn; U: the codes from the group's unpack_group copy u); a last lone token
// runs the decode tile. Q6_K: xp holds the call's tokens permuted by q6_permute_x.
template <bool Q6, bool U>
inline void kq_group_tiles(const kvs_weight *w, int g, const uint8_t *u, const int8_t *xq, const int8_t *xp,
                           const float *xd, const float *xs, const int32_t *xh, int tb, int te, float *y, int ldy,
                           bool add) {
    const size_t K = w->cols;
    int t = tb;
    if constexpr (Q6) {
        for (; t + 4 <= te; t += 4) q6_tile16xn<4, U>(w, g, u, xp + t * K, xd, xh, t, y, ldy, add);
        switch (te - t) {
            case 3: q6_tile16xn<3, U>(w, g, u, xp + t * K, xd, xh, t, y, ldy, add); break;
            case 2: q6_tile16xn<2, U>(w, g, u, xp + t * K, xd, xh, t, y, ldy, add); break;
            case 1: q6_tile16x1(w, g, xq, xd, xh + (size_t)t * (K / KVS_QK), t, y, ldy, add); break;
            default: break;
        }
    } else {
        for (; t + 4 <= te; t += 4) q5k_tile16xn<4, U>(w, g, u, xq, xd, xs, t, y, ldy, add);
        switch (te - t) {
            case 3: q5k_tile16xn<3, U>(w, g, u, xq, xd, xs, t, y, ldy, add); break;
            case 2: q5k_tile16xn<2, U>(w, g, u, xq, xd, xs, t, y, ldy, add); break;
            case 1: q4k_tile16x1<true>(w, g, xq, xd, xs, t, y, ldy, add); break;
            default: break;
        }
    }
}

#ifndef KVS_KQ_UNPACK_MIN
#define KVS_KQ_UNPACK_MIN 8
#endif

// Q6_K (Q6) or Q5_K, tokens [tb, te) over groups [gbeg, gend). With KVS_KQ_UNPACK_MIN tokens or more
// each group's codes are unpacked once (into u: 512 bytes a block) for all its token tiles.
template <bool Q6>
void kq_prompt_tiles(const kvs_weight *w, uint8_t *u, const int8_t *xq, const int8_t *xp, const float *xd,
                     const float *xs, const int32_t *xh, int tb, int te, float *y, int ldy, bool add, int gbeg,
                     int gend) {
    for (int g = gbeg; g < gend; g++) {
        if (u && te - tb >= KVS_KQ_UNPACK_MIN) {
            unpack_group<Q6>(w, g, u);
            kq_group_tiles<Q6, true>(w, g, u, xq, xp, xd, xs, xh, tb, te, y, ldy, add);
        } else {
            kq_group_tiles<Q6, false>(w, g, nullptr, xq, xp, xd, xs, xh, tb, te, y, ldy, add);
        }
    }
}

// 16 rows x TT tokens of Q4 / Q4_K (q4_tile16xn) or Q5_K (q5k_tile16xn).
template <int TT, int SM>
inline void tile16n(const kvs_weight *w, int g, const int8_t *xq, const float *xd, const float *xs, int t0, float *y,
                    int ldy, bool add) {
    if constexpr (SM == 4) q5k_tile16xn<TT, false>(w, g, nullptr, xq, xd, xs, t0, y, ldy, add);
    else q4_tile16xn<TT, SM>(w, g, xq, xd, xs, t0, y, ldy, add);
}

template <bool Q4, int SM, int TT>
inline void tile8(const kvs_weight *w, int g, int h, const int8_t *xq, const float *xd, const float *xs, int t0,
                  float *y, int ldy, bool add) {
    if constexpr (Q4) q4_tile8<TT, SM>(w, g, h, xq, xd, xs, t0, y, ldy, add);
    else q8_tile8<TT, SM == 1>(w, g, h, xq, xd, xs, t0, y, ldy, add);
}

#ifndef KVS_KQ_XBLOCK
#define KVS_KQ_XBLOCK 196608
#endif

// Tokens [tb, te) over groups [gbeg, gend), each 8-row half-group in turn, tokens in fours.
template <bool Q4, int SM>
inline void half_group_tiles(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int tb,
                             int te, float *y, int ldy, bool add, int gbeg, int gend) {
    for (int g = gbeg; g < gend; g++)
        for (int h = 0; h < 2; h++) {
            if (g * 16 + h * 8 >= w->rows) break;
            int t = tb;
            for (; t + 4 <= te; t += 4) tile8<Q4, SM, 4>(w, g, h, xq, xd, xs, t, y, ldy, add);
            switch (te - t) {
                case 3: tile8<Q4, SM, 3>(w, g, h, xq, xd, xs, t, y, ldy, add); break;
                case 2: tile8<Q4, SM, 2>(w, g, h, xq, xd, xs, t, y, ldy, add); break;
                case 1: tile8<Q4, SM, 1>(w, g, h, xq, xd, xs, t, y, ldy, add); break;
                default: break;
            }
        }
}

// Tokens [tb, te) over groups [gbeg, gend) in whole 16-row groups, tokens in fours (q4_tile16xn;
// SM 4: q5k_tile16xn): Q4_0, Q4_1, Q4_K and Q5_K. A last lone token of a K-quant runs the decode tile.
template <int SM>
inline void group_tiles16(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int tb, int te,
                          float *y, int ldy, bool add, int gbeg, int gend) {
    for (int g = gbeg; g < gend; g++) {
        int t = tb;
        for (; t + 4 <= te; t += 4) tile16n<4, SM>(w, g, xq, xd, xs, t, y, ldy, add);
        switch (te - t) {
            case 3: tile16n<3, SM>(w, g, xq, xd, xs, t, y, ldy, add); break;
            case 2: tile16n<2, SM>(w, g, xq, xd, xs, t, y, ldy, add); break;
            case 1:
                if constexpr (kquant_sm(SM)) q4k_tile16x1<SM == 4>(w, g, xq, xd, xs, t, y, ldy, add);
                else q4_tile16x1<SM>(w, g, xq, xd, xs, t, y, ldy, add);
                break;
            default: break;
        }
    }
}

// Q5_K and Q6_K prompts unpack each group's codes once for its token tiles (kq_prompt_tiles).
constexpr bool kquant_unpacks(int sm) { return sm == 3 || sm == 4; }

// This thread's buffer for one group's unpacked codes (bytes, 32-byte aligned), kept between calls.
uint8_t *unpack_scratch(size_t bytes) {
    struct Scratch {
        uint8_t *p = nullptr;
        size_t n = 0;
        ~Scratch() { free(p); }
    };
    thread_local Scratch s;
    if (s.n < bytes) {
        free(s.p);
        s.p = (uint8_t *)aligned_alloc(32, bytes);
        s.n = bytes;
    }
    return s.p;
}

// The Q6_K prompt tiles' inputs from T tokens of K int8 activations: x_half_sums [t][b] and the
// q6_permute_x copy, made once per thread while the activations stay the same (g_xq_epoch): a
// prompt's projection is handed out one row group per call (the forward's row chunks), and main's
// half-sums made per call left its Q6_K prompts 1.2-1.6x slower than in one call (BENCHMARKS.md).
void q6_prepared(const int8_t *xq, const float *xd, int T, int K, const int32_t **xh, const int8_t **xp) {
    struct Prepared {
        const int8_t *xq = nullptr;
        const float *xd = nullptr;
        int T = 0, K = 0;
        uint64_t epoch = 0;
        std::vector<int32_t> xh;
        std::vector<int8_t> xp;
    };
    thread_local Prepared c;
    const uint64_t epoch = g_xq_epoch.load(std::memory_order_relaxed);
    if (c.xq != xq || c.xd != xd || c.T != T || c.K != K || c.epoch != epoch || c.xh.empty()) {
        const size_t n = (size_t)T * K;
        c.xh.resize(n / KVS_QK);
        c.xp.resize(n);
        for (size_t b = 0; b < n / KVS_QK; b++) c.xh[b] = x_half_sums(xq + b * KVS_QK);
        q6_permute_x(xq, n, c.xp.data());
        c.xq = xq, c.xd = xd, c.T = T, c.K = K, c.epoch = epoch;
    }
    *xh = c.xh.data();
    *xp = c.xp.data();
}

// Groups [gbeg, gend) of 16 rows for all T tokens: each group's (or half-group's) weights stay in
// L1 while the token tiles stream past them.
template <bool Q4, int SM>
void run_groups_avx2(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y,
                     int ldy, bool add, int gbeg, int gend) {
    if constexpr (kquant_sm(SM)) {   // K-quants: one token reads each group once, whole lines (see above)
        if (T == 1) {
            if constexpr (SM == 3) {   // the activations' half-block sums, once per call (q6_tile16x1)
                const int nb = w->cols / KVS_QK;
                int32_t stack[512];
                int32_t *xh = nb <= 512 ? stack : (int32_t *)malloc(sizeof(int32_t) * nb);
                for (int b = 0; b < nb; b++) xh[b] = x_half_sums(xq + b * KVS_QK);
                for (int g = gbeg; g < gend; g++) q6_tile16x1(w, g, xq, xd, xh, 0, y, ldy, add);
                if (xh != stack) free(xh);
            } else {
                for (int g = gbeg; g < gend; g++) q4k_tile16x1<SM == 4>(w, g, xq, xd, xs, 0, y, ldy, add);
            }
            return;
        }
        // Prompts: the tokens in blocks whose int8 activations stay in L2 (KVS_KQ_XBLOCK bytes) while
        // every group of this thread streams past; one block of T = 512 x 3072 (1.5 MB) re-read from L3
        // per 8-row half-group ran ~15% slower per MAC than T = 64. Only the order of the outputs
        // changes: each is the same tile arithmetic.
        // A call of one group (the forward's row chunks of a prompt) takes all its tokens at once: its
        // codes are unpacked once (kq_prompt_tiles) and no other group would reuse the block.
        int tb_size = (KVS_KQ_XBLOCK / w->cols) & ~3;
        if (tb_size < 16 || T <= tb_size || (kquant_unpacks(SM) && gend - gbeg == 1)) tb_size = T;
        const int32_t *xh = nullptr;   // Q6_K: the tokens' half-block sums and permuted activations
        const int8_t *xp = nullptr;
        if constexpr (SM == 3) q6_prepared(xq, xd, T, w->cols, &xh, &xp);
        // Q5_K / Q6_K: one group's unpacked codes (kq_prompt_tiles), when the token blocks are long enough
        uint8_t *u = nullptr;
        if constexpr (kquant_unpacks(SM))
            if (tb_size >= KVS_KQ_UNPACK_MIN) u = unpack_scratch((size_t)w->cols / KVS_QK * 512);
        for (int tb = 0; tb < T; tb += tb_size) {
            const int te = tb + tb_size < T ? tb + tb_size : T;
            if constexpr (SM == 3) {
                kq_prompt_tiles<true>(w, u, xq, xp, xd, xs, xh, tb, te, y, ldy, add, gbeg, gend);
            } else if constexpr (SM == 4) {
                kq_prompt_tiles<false>(w, u, xq, nullptr, xd, xs, nullptr, tb, te, y, ldy, add, gbeg, gend);
            } else {
                group_tiles16<SM>(w, xq, xd, xs, tb, te, y, ldy, add, gbeg, gend);
            }
        }
        return;
    } else if constexpr (Q4) {   // Q4_0 / Q4_1: whole 16-row groups, tokens in fours
        group_tiles16<SM>(w, xq, xd, xs, 0, T, y, ldy, add, gbeg, gend);
        return;
    }
    half_group_tiles<Q4, SM>(w, xq, xd, xs, 0, T, y, ldy, add, gbeg, gend);
}

}  // namespace

namespace kvs {

void linear_rows(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y,
                 int ldy, bool add, int ith, int nth) {
    if (w->qtype == KVS_QTYPE_SEGMENTS) {   // each segment's rows split over the threads, its own tiles
        for (int s = 0, off = 0; s < w->nseg; off += w->seg[s].rows, s++)
            linear_rows(&w->seg[s], xq, xd, xs, T, y + off, ldy, add, ith, nth);
        return;
    }
    const int ng = (w->rows + 15) / 16;
    const int per = (ng + nth - 1) / nth;
    const int gbeg = ith * per < ng ? ith * per : ng;
    const int gend = gbeg + per < ng ? gbeg + per : ng;
    if (gbeg >= gend) return;
    if (w->isa == 2) {
        groups_amx(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
        return;
    }
    if (w->isa == 1) {
        groups_avx512(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
        return;
    }
    const bool f16 = w->sdtype == 1;
    if (w->qtype == KVS_QTYPE_Q4K) run_groups_avx2<true, 2>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (w->qtype == KVS_QTYPE_Q6K) run_groups_avx2<false, 3>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (w->qtype == KVS_QTYPE_Q5K) run_groups_avx2<true, 4>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (w->qtype == 0 && f16 && !w->m) run_groups_avx2<true, 5>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (w->qtype == 0 && f16) run_groups_avx2<true, 1>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (w->qtype == 0) run_groups_avx2<true, 0>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else if (f16) run_groups_avx2<false, 1>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
    else run_groups_avx2<false, 0>(w, xq, xd, xs, T, y, ldy, add, gbeg, gend);
}

}  // namespace kvs

namespace {

struct LinearJob {
    const kvs_weight *w;
    const float *x;
    int T;
    float *y;
    int8_t *xq;
    float *xd;
    float *xs;
};

// True if the tiles of w (or of one of its segments) read xs: layouts with a minimum per block.
bool needs_sums(const kvs_weight *w) {
    if (w->qtype == KVS_QTYPE_SEGMENTS) {
        for (int s = 0; s < w->nseg; s++)
            if (needs_sums(&w->seg[s])) return true;
        return false;
    }
    return w->qtype == 0 || w->qtype == KVS_QTYPE_Q4K || w->qtype == KVS_QTYPE_Q5K;
}

void linear_task(const LinearJob *job, int ith, int nth) {
    const kvs_weight *w = job->w;
    const int K = w->cols, nb = K / KVS_QK;
    const bool q4 = needs_sums(w);   // minima need xs
    // phase 1: quantize this thread's share of tokens
    for (int t = ith; t < job->T; t += nth)
        quantize_row_q8(job->x + (size_t)t * K, K, job->xq + (size_t)t * K, job->xd + (size_t)t * nb,
                        q4 ? job->xs + (size_t)t * nb : nullptr);
#pragma omp barrier
    // phase 2: this thread's rows, in multiples of 4
    kvs::linear_rows(w, job->xq, job->xd, job->xs, job->T, job->y, w->rows, false, ith, nth);
}

// Offsets into the repacked layout (see the top of this file).
inline size_t q4_byte(int r, int k, int nb) {   // byte holding q[r][k]; the high nibble if (k % 32) >= 16
    const int g = r / 16, b = k / KVS_QK, kk = k % KVS_QK, i = (kk % 16) / 4;
    return (((size_t)g * nb + b) * 4 + i) * 64 + (r % 16) * 4 + kk % 4;
}
inline size_t q8_byte(int r, int k, int nb) {
    const int g = r / 16, b = k / KVS_QK, kk = k % KVS_QK;
    return (((size_t)g * nb + b) * 8 + kk / 4) * 64 + (r % 16) * 4 + kk % 4;
}
inline size_t scale_at(int r, int b, int nb) { return ((size_t)(r / 16) * nb + b) * 16 + r % 16; }

inline float scale_value(const void *p, size_t at, int sdtype) {
    return sdtype ? _cvtsh_ss(((const uint16_t *)p)[at]) : ((const float *)p)[at];
}

// Block scale and minimum of row r, block b, as the kernels form them (any layout).
inline void block_scales(const kvs_weight *w, int r, int b, int nb, float *d, float *m) {
    if (w->qtype == KVS_QTYPE_Q4K || w->qtype == KVS_QTYPE_Q5K) {
        const uint8_t *p = (const uint8_t *)w->d + ((size_t)(r / 16) * (nb / 8) + b / 8) * KVS_KSUPER_BYTES;
        uint16_t hd, hm;
        memcpy(&hd, p + 2 * (r % 16), 2);
        memcpy(&hm, p + 32 + 2 * (r % 16), 2);
        *d = _cvtsh_ss(hd) * (float)p[64 + (b % 8) * 16 + r % 16];
        *m = -(_cvtsh_ss(hm) * (float)p[192 + (b % 8) * 16 + r % 16]);
        return;
    }
    const size_t at = scale_at(r, b, nb);
    *d = scale_value(w->d, at, w->sdtype);
    *m = w->qtype != 0 ? 0.0f : w->m ? scale_value(w->m, at, w->sdtype) : -8.0f * *d;   // no m: Q4_0's -8 d
}

inline void put_q4(uint8_t *qs, int r, int k, int nb, uint8_t q) {
    qs[q4_byte(r, k, nb)] |= (k % KVS_QK) >= 16 ? (uint8_t)(q << 4) : q;
}

// scratch for quantized activations, grown as needed (calls are serialized)
void *g_scratch = nullptr;
size_t g_scratch_size = 0;

}  // namespace

extern "C" {

// Threads per call (the caller's OpenMP team). Small calls use fewer: one thread per 64 rows.
void kvs_set_num_threads(int nth) { g_nth = nth < 1 ? 1 : nth; }

int kvs_get_num_threads(void) { return g_nth; }

// Bytes of the repacked arrays for a weight of rows x cols: qs, and d (and m, for Q4) in floats.
size_t kvs_packed_qs_bytes(int qtype, int rows, int cols) {
    return (size_t)((rows + 15) / 16) * (cols / KVS_QK) *
           (qtype == 1 ? 512 : qtype == KVS_QTYPE_Q6K ? KVS_Q6_BLOCK_BYTES : qtype == KVS_QTYPE_Q5K ? KVS_Q5_BLOCK_BYTES : 256);
}
// Bytes of the super-block scales of qtype 2 (Q4_K), 3 (Q6_K) or 4 (Q5_K) for rows x cols (cols a multiple of 256).
size_t kvs_packed_kscale_bytes(int qtype, int rows, int cols) {
    return (size_t)((rows + 15) / 16) * (cols / 256) * (qtype == KVS_QTYPE_Q6K ? KVS_Q6_SUPER_BYTES : KVS_KSUPER_BYTES);
}
size_t kvs_packed_scales(int rows, int cols) { return (size_t)((rows + 15) / 16) * 16 * (cols / KVS_QK); }

// Repack GGUF blocks of `rows` rows of `cols` elements. ggml_type: 2 = Q4_0, 3 = Q4_1, 8 = Q8_0.
// qs, d (and m for Q4) are sized by kvs_packed_qs_bytes / kvs_packed_scales; padding rows are 0.
// sdtype 1 keeps the scales float16 (d, m are uint16 arrays), 0 widens them to float32.
// Returns 0 on success, -1 on an unsupported type, 1 if a Q4_0 minimum (-8 d) is not a float16
// (call again with sdtype 0).
int kvs_repack(int ggml_type, const uint8_t *raw, int rows, int cols, uint8_t *qs, void *d, void *m, int sdtype) {
    const int nb = cols / KVS_QK;
    const int qtype = ggml_type == 8 ? 1 : 0;
    const size_t esize = sdtype ? 2 : 4;
    if (ggml_type != 2 && ggml_type != 3 && ggml_type != 8) return -1;
    memset(qs, 0, kvs_packed_qs_bytes(qtype, rows, cols));
    memset(d, 0, kvs_packed_scales(rows, cols) * esize);
    if (m) memset(m, 0, kvs_packed_scales(rows, cols) * esize);
    const auto put = [&](void *dst, size_t at, uint16_t h, float f) {
        if (sdtype) ((uint16_t *)dst)[at] = h;
        else ((float *)dst)[at] = f;
    };
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) {
            const size_t blk = (size_t)r * nb + b, at = scale_at(r, b, nb);
            if (ggml_type == 2 || ggml_type == 3) {  // Q4_0: fp16 d, 16 bytes; Q4_1: fp16 d, fp16 m, 16 bytes
                const uint8_t *p = raw + blk * (ggml_type == 2 ? 18 : 20);
                uint16_t hd, hm;
                memcpy(&hd, p, 2);
                if (ggml_type == 3) {
                    memcpy(&hm, p + 2, 2);
                } else {
                    const float mf = -8.0f * _cvtsh_ss(hd);
                    hm = _cvtss_sh(mf, _MM_FROUND_TO_NEAREST_INT);
                    if (sdtype && _cvtsh_ss(hm) != mf) return 1;
                }
                put(d, at, hd, _cvtsh_ss(hd));
                put(m, at, hm, ggml_type == 2 ? -8.0f * _cvtsh_ss(hd) : _cvtsh_ss(hm));
                const uint8_t *q = p + (ggml_type == 2 ? 2 : 4);   // element j low nibble, j + 16 high
                for (int j = 0; j < 16; j++) {
                    put_q4(qs, r, b * KVS_QK + j, nb, q[j] & 0x0F);
                    put_q4(qs, r, b * KVS_QK + j + 16, nb, q[j] >> 4);
                }
            } else {  // Q8_0: fp16 d, 32 int8
                const uint8_t *p = raw + blk * 34;
                uint16_t hd;
                memcpy(&hd, p, 2);
                put(d, at, hd, _cvtsh_ss(hd));
                for (int j = 0; j < KVS_QK; j++) qs[q8_byte(r, b * KVS_QK + j, nb)] = p[2 + j];
            }
        }
    return 0;
}

// Pack plain Q4 values q [rows][cols] (0..15) with block scales and minima sd, sm [rows][cols/32]
// (w = d * q + m; from Q4_K super-blocks, split into 32-value blocks) into the kernels' layout.
void kvs_pack_q4(int rows, int cols, const uint8_t *q, const float *sd, const float *sm, uint8_t *qs, float *d,
                 float *m) {
    const int nb = cols / KVS_QK;
    memset(qs, 0, kvs_packed_qs_bytes(0, rows, cols));
    memset(d, 0, kvs_packed_scales(rows, cols) * sizeof(float));
    memset(m, 0, kvs_packed_scales(rows, cols) * sizeof(float));
    for (int r = 0; r < rows; r++) {
        for (int k = 0; k < cols; k++) put_q4(qs, r, k, nb, q[(size_t)r * cols + k] & 0x0F);
        for (int b = 0; b < nb; b++) {
            d[scale_at(r, b, nb)] = sd[(size_t)r * nb + b];
            m[scale_at(r, b, nb)] = sm[(size_t)r * nb + b];
        }
    }
}

}  // extern "C"

namespace {

void dequantize_row(const kvs_weight *w, int r, float *o) {
    if (w->qtype == KVS_QTYPE_SEGMENTS) {   // the segment holding row r
        int s = 0;
        for (; s + 1 < w->nseg && r >= w->seg[s].rows; s++) r -= w->seg[s].rows;
        dequantize_row(&w->seg[s], r, o);
        return;
    }
    const int K = w->cols, nb = K / KVS_QK;
    if (w->qtype == KVS_QTYPE_Q6K) {   // (d * sc) * (q - 32), llama.cpp's order
        const int rr = r % 16;
        for (int b = 0; b < nb; b++) {
            const uint8_t *qb = w->qs + ((size_t)(r / 16) * nb + b) * KVS_Q6_BLOCK_BYTES;
            const uint8_t *ks = (const uint8_t *)w->d + ((size_t)(r / 16) * (nb / 8) + b / 8) * KVS_Q6_SUPER_BYTES;
            uint16_t hd;
            memcpy(&hd, ks + 2 * rr, 2);
            for (int kk = 0; kk < KVS_QK; kk++) {
                const int i = (kk % 16) / 4, j = kk % 4, upper = kk >= 16;
                const uint8_t lo4 = (qb[i * 64 + rr * 4 + j] >> (4 * upper)) & 0x0F;
                const uint8_t hi2 = (qb[256 + (i / 2) * 64 + rr * 4 + j] >> ((i % 2) * 4 + upper * 2)) & 3;
                const float dsc = _cvtsh_ss(hd) * (float)(int8_t)ks[32 + (2 * (b % 8) + upper) * 16 + rr];
                o[b * KVS_QK + kk] = dsc * (float)((int)(lo4 | (hi2 << 4)) - 32);
            }
        }
        return;
    }
    for (int b = 0; b < nb; b++) {
        float d, m;
        block_scales(w, r, b, nb, &d, &m);
        if (w->qtype == KVS_QTYPE_Q5K) {
            const uint8_t *qb = w->qs + ((size_t)(r / 16) * nb + b) * KVS_Q5_BLOCK_BYTES + (r % 16) * 4;
            for (int i = 0; i < KVS_QK; i++) {
                const int c = (i % 16) / 4, j = i % 4, upper = i >= 16;
                const int q = ((qb[c * 64 + j] >> (4 * upper)) & 0x0F) | (((qb[256 + j] >> (2 * c + upper)) & 1) << 4);
                o[b * KVS_QK + i] = d * (float)q + m;
            }
        } else if (w->qtype != 1) {
            for (int i = 0; i < KVS_QK; i++) {
                const int k = b * KVS_QK + i;
                const uint8_t byte = w->qs[q4_byte(r, k, nb)];
                o[k] = d * (float)(i >= 16 ? byte >> 4 : byte & 0x0F) + m;
            }
        } else {
            for (int i = 0; i < KVS_QK; i++) o[b * KVS_QK + i] = d * (float)(int8_t)w->qs[q8_byte(r, b * KVS_QK + i, nb)];
        }
    }
}

}  // namespace

extern "C" {

// W as float32 [rows, cols] into out (for large calls on CPUs without fast bf16: dequantize into a
// scratch buffer once per call, then an fp32 GEMM). Split over the caller's OpenMP team.
void kvs_dequantize(const kvs_weight *w, float *out) {
    const int nth = g_nth < w->rows / 64 ? g_nth : (w->rows / 64 > 0 ? w->rows / 64 : 1);
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int r = 0; r < w->rows; r++) dequantize_row(w, r, out + (size_t)r * w->cols);
}

// Rows ids[0..n) of W as float32 [n, cols] (an embedding lookup from packed weights). Returns -1 if
// an id is out of range (nothing written past it), else 0.
int kvs_dequantize_rows(const kvs_weight *w, const int64_t *ids, int n, float *out) {
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= w->rows) return -1;
        dequantize_row(w, (int)ids[i], out + (size_t)i * w->cols);
    }
    return 0;
}

// y[T, rows] = x[T, cols] @ W^T (+ bias). x and y are contiguous float32.
void kvs_linear(const kvs_weight *w, const float *x, int T, float *y) {
    if (T <= 0) return;
    pthread_mutex_lock(&g_call_mu);
    const int K = w->cols, nb = K / KVS_QK;
    const size_t need = (size_t)T * K + 2 * (size_t)T * nb * sizeof(float) + 64;
    if (need > g_scratch_size) {
        free(g_scratch);
        g_scratch_size = need * 2;
        g_scratch = aligned_alloc(64, (g_scratch_size + 63) & ~(size_t)63);
    }
    LinearJob job;
    job.w = w;
    job.x = x;
    job.T = T;
    job.y = y;
    job.xd = (float *)g_scratch;
    job.xs = job.xd + (size_t)T * nb;
    job.xq = (int8_t *)(job.xs + (size_t)T * nb);
    const int team = kvs::team_for(g_nth);
    int nth = team < w->rows / 64 ? team : w->rows / 64;   // at least 4 groups of 16 rows each
    if (nth <= 1) {
        linear_task(&job, 0, 1);
    } else {
#pragma omp parallel num_threads(nth)
        linear_task(&job, omp_get_thread_num(), omp_get_num_threads());
    }
    pthread_mutex_unlock(&g_call_mu);
}

}  // extern "C"
