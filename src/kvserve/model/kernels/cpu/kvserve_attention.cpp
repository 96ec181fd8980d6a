// Longer than 420 lines on purpose: the paged attention's decode, tile and group kernels share
// inline helpers and the exact reduction order that batch invariance depends on; one unit keeps it.
// Small fused ops: paged attention over the KV cache, read in place through the block tables (no
// gather copy, GQA without repeating K/V), for an fp32, bf16, fp16 or int8 cache; and RMSNorm.
//
//   q        [T, Hq, D]                          (already rotated)
//   kv_cache [2, num_blocks, block_size, Hkv, D] (K then V), this layer's; float32, bf16 or f16,
//            or int8 [.., Hkv, D + 2]: each row's D values then its fp16 scale (x = q * scale)
//   tables   [B, max_blocks] int64, one row per sequence
//   out      [T, Hq, D]
//
// Query token t of the batch sits at absolute position positions[t] of sequence seq_of[t], so it
// attends to that sequence's tokens 0..positions[t] (causal; decode and prefill chunks alike).
// Work items are (token, kv head) pairs split over the caller's OpenMP team (torch's, as in
// kvserve_kernels.cpp); an item computes the whole GQA group of query heads that share the KV head,
// so each K/V row leaves memory once per item. Batched decode at long contexts is bound by reading
// the cache (32 sequences x 600 tokens is 0.9 GB per step in fp32): a bf16 cache halves that, and
// with enough queries an item takes all KV heads of its token (attend_heads), so the cache is read
// in contiguous runs of a token's heads rather than one head's row at a time.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "kvserve_kernels.h"

namespace {

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    lo = _mm_add_ps(lo, _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const kvs::bf16 *p) {  // bf16 -> fp32 is a 16-bit shift
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
inline __m256 load8(const kvs::f16 *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
inline __m256 load8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
inline float load1(const int8_t *p) { return (float)*p; }
inline float load1(const float *p) { return *p; }
inline float load1(const kvs::f16 *p) { return _cvtsh_ss(p->bits); }
inline float load1(const kvs::bf16 *p) {
    uint32_t u = (uint32_t)p->bits << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

// int8 rows carry a scale per row, folded out of the inner loops: a score is
// (dot(q, float(k)) * scale) * k_scale, and a V row enters the sum with weight p * v_scale times
// float(v). attend_tile widens int8 rows without their scales and applies them the same way, so a
// tile and a lone query still compute the same bits.
template <typename KV>
constexpr bool kScaled = std::is_same<KV, int8_t>::value;

template <typename KV>
inline float dot(const float *a, const KV *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * load1(b + i);
    return s;
}

template <typename KV>
inline void axpy(float *y, float a, const KV *x, int n) {
    const __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load8(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * load1(x + i);
}

// Sum of each of 8 vectors -> one vector of 8 sums (a hadd tree, instead of 8 horizontal sums).
inline __m256 hsum8(const __m256 *a) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    // lanes: [0..3 low halves | 0..3 high halves] and the same for 4..7
    const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}

// Most query heads per KV head whose scores attend_rows forms from one widening of each key row.
constexpr int kMaxSharedGroup = 8;

// sg[0..L) <- exp(sg - max), returning their sum (vectorised by 8, the tail in scalar code).
// Lanes of 8 outputs per V pass: a divisor of ND (the passes cover the head exactly), at most 4
// (with up to 3 heads per pass, 12 accumulators and the loads fit the 16 ymm registers).
constexpr int pass_lanes(int nd) { return nd % 4 == 0 ? 4 : nd % 3 == 0 ? 3 : nd % 2 == 0 ? 2 : 1; }

inline float softmax_row(float *sg, int L) {
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= L; i += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(sg + i));
    float mx = -INFINITY;
    alignas(32) float m8[8];
    _mm256_store_ps(m8, vmx);
    for (int j = 0; j < 8; j++) mx = m8[j] > mx ? m8[j] : mx;
    for (int j = i; j < L; j++) mx = sg[j] > mx ? sg[j] : mx;
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (i = 0; i + 8 <= L; i += 8) {
        const __m256 e = kvs::exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vm));
        _mm256_storeu_ps(sg + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum(vsum);
    for (; i < L; i++) sum += (sg[i] = expf(sg[i] - mx));
    return sum;
}

// Attention logit soft-capping (Gemma 2): s -> cap * tanh(s / cap) over L scores, tanh(y) as
// 1 - 2 / (e^(2y) + 1). Every score goes through the same 8-lane code (the tail through a padded
// vector), so a score's bits do not depend on where it sits in the row: a lone query, a tile's
// query and a windowed query all cap alike.
inline void softcap_row(float *s, int L, float cap) {
    const __m256 inv2 = _mm256_set1_ps(2.0f / cap), vcap = _mm256_set1_ps(cap), one = _mm256_set1_ps(1.0f),
                 two = _mm256_set1_ps(2.0f);
    const auto cap8 = [&](__m256 v) {
        const __m256 e = kvs::exp8(_mm256_mul_ps(v, inv2));
        return _mm256_mul_ps(vcap, _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one))));
    };
    int i = 0;
    for (; i + 8 <= L; i += 8) _mm256_storeu_ps(s + i, cap8(_mm256_loadu_ps(s + i)));
    if (i < L) {
        alignas(32) float t[8] = {0.f};
        for (int j = i; j < L; j++) t[j - i] = s[j];
        _mm256_store_ps(t, cap8(_mm256_load_ps(t)));
        for (int j = i; j < L; j++) s[j] = t[j - i];
    }
}

// out[r] = inv[r] * sum over the L rows of p[r][t] * v[t] (times the row's scale for int8), lanes
// c0..c0+NC of NR heads (out rows D apart): NR x NC independent FMA chains share each V load, and
// each output's chain is key by key in order from zero, as tile_rows computes it (pv_block).
template <typename KV, int NR, int NC, typename Prefetch>
inline void pv_rows(const float *const *sg, const KV *V, const size_t *off, int L, int D, int c0, const float *vsc,
                    const float *inv, float *out, Prefetch prefetch_row) {
    __m256 acc[NR][NC];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
    for (int tt = 0; tt < L; tt++) {
        if (c0 == 0 && tt + 16 < L) prefetch_row(V + off[tt + 16]);
        const KV *v = V + off[tt] + 8 * c0;
        __m256 p[NR];
        for (int r = 0; r < NR; r++)
            p[r] = kScaled<KV> ? _mm256_set1_ps(sg[r][tt] * vsc[tt]) : _mm256_broadcast_ss(sg[r] + tt);
        for (int c = 0; c < NC; c++) {
            const __m256 vv = load8(v + 8 * c);
            for (int r = 0; r < NR; r++) acc[r][c] = _mm256_fmadd_ps(p[r], vv, acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++) {
        const __m256 vinv = _mm256_set1_ps(inv[r]);
        for (int c = 0; c < NC; c++)
            _mm256_storeu_ps(out + (size_t)r * D + 8 * (c0 + c), _mm256_mul_ps(acc[r][c], vinv));
    }
}

// The G query heads of one KV head (GQA group, contiguous in q and out) against L K/V rows (float32,
// or bf16 widened as loaded)
// at K + off[t], V + off[t]. Each K row serves the whole group; scores for 8 tokens at a time are
// reduced by one hadd tree; exp is vectorised; each head's output stays in ND registers while V
// streams past. ND = D / 8 is a compile-time constant for head_dim 32, 64, 80, 96 and 128 (0: other
// head sizes, plain loops).
template <typename KV, int ND>
void attend_rows(const float *q, const KV *K, const KV *V, const size_t *off, int L, int D, int G,
                 float scale, float *s, float *out, const float *ksc = nullptr, const float *vsc = nullptr,
                 int pf_bytes = 0, float softcap = 0.0f) {
    // ksc/vsc: the rows' scales (int8 rows only; unused for float types). pf_bytes: how much of each
    // token to prefetch from its row on (0: the row; more: the following heads' rows too, see attend_heads)
    const auto ks = [&](int t) { return kScaled<KV> ? ksc[t] : 1.0f; };
    const auto vs = [&](int t) { return kScaled<KV> ? vsc[t] : 1.0f; };
    if (ND == 0) {
        for (int g = 0; g < G; g++) {
            float *sg = s + (size_t)g * L, mx = -INFINITY, sum = 0.0f;
            for (int t = 0; t < L; t++) {
                sg[t] = dot(q + (size_t)g * D, K + off[t], D) * scale * ks(t);
            }
            if (softcap > 0.0f) softcap_row(sg, L, softcap);
            for (int t = 0; t < L; t++) mx = sg[t] > mx ? sg[t] : mx;
            for (int t = 0; t < L; t++) sum += (sg[t] = expf(sg[t] - mx));
            float *o = out + (size_t)g * D;
            for (int i = 0; i < D; i++) o[i] = 0.0f;
            for (int t = 0; t < L; t++) axpy(o, sg[t] / sum * vs(t), V + off[t], D);
        }
        return;
    }
    constexpr int nd = ND > 0 ? ND : 1;
    const __m256 vscale = _mm256_set1_ps(scale);
    int t = 0;
    constexpr int row_bytes = ND * 8 * (int)sizeof(KV);
    // K/V rows of a head are scattered (a stride of Hkv * D within a block, blocks anywhere in the
    // pool), which the hardware prefetchers follow poorly: fetch the next group of rows ahead.
    const int pf = pf_bytes > row_bytes ? pf_bytes : row_bytes;
    const auto prefetch_row = [pf](const KV *r) {
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch((const char *)r + b, _MM_HINT_T0);
        for (int b = row_bytes; b < pf; b += 64) _mm_prefetch((const char *)r + b, _MM_HINT_T1);
    };
    for (int j = 0; j < 16 && j < L; j++) prefetch_row(K + off[j]);
    for (; t + 8 <= L; t += 8) {
        for (int j = t + 16; j < t + 24 && j < L; j++) {
            prefetch_row(K + off[j]);
            // the V rows into L2 too, ready for the V sweep (the first of several heads: every head's)
            for (int b = 0; b < pf; b += 64) _mm_prefetch((const char *)(V + off[j]) + b, _MM_HINT_T1);
        }
        if (sizeof(KV) == 2 && G > 1 && G <= kMaxSharedGroup) {   // float16, bf16 rows
            // The group's heads share each key row, widened once (float16/bf16 -> float32, exact)
            // instead of once per head; each head's products and sums are the same as below.
            __m256 acc[kMaxSharedGroup][8];
            for (int j = 0; j < 8; j++) {
                const KV *k = K + off[t + j];
                __m256 kv[nd];
                for (int c = 0; c < nd; c++) kv[c] = load8(k + 8 * c);
                for (int g = 0; g < G; g++) {
                    const float *qg = q + (size_t)g * D;
                    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), kv[0]);
                    for (int c = 1; c < nd; c++) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), kv[c], a);
                    acc[g][j] = a;
                }
            }
            for (int g = 0; g < G; g++)
                _mm256_storeu_ps(s + (size_t)g * L + t, _mm256_mul_ps(hsum8(acc[g]), vscale));
            continue;
        }
        for (int g = 0; g < G; g++) {
            const float *qg = q + (size_t)g * D;
            __m256 qv[nd], acc[8];
            for (int c = 0; c < nd; c++) qv[c] = _mm256_loadu_ps(qg + 8 * c);
            for (int j = 0; j < 8; j++) {
                const KV *k = K + off[t + j];
                __m256 a = _mm256_mul_ps(qv[0], load8(k));
                for (int c = 1; c < nd; c++) a = _mm256_fmadd_ps(qv[c], load8(k + 8 * c), a);
                acc[j] = a;
            }
            __m256 sv = _mm256_mul_ps(hsum8(acc), vscale);
            if constexpr (kScaled<KV>) sv = _mm256_mul_ps(sv, _mm256_loadu_ps(ksc + t));
            _mm256_storeu_ps(s + (size_t)g * L + t, sv);
        }
    }
    for (int j = 0; j < 16 && j < L; j++) prefetch_row(V + off[j]);
    for (; t < L; t++)
        for (int g = 0; g < G; g++) s[(size_t)g * L + t] = dot(q + (size_t)g * D, K + off[t], D) * scale * ks(t);
    thread_local std::vector<float> inv;
    inv.resize(G);
    for (int g = 0; g < G; g++) {
        if (softcap > 0.0f) softcap_row(s + (size_t)g * L, L, softcap);
        inv[g] = 1.0f / softmax_row(s + (size_t)g * L, L);
    }
    // V: up to 3 heads x 4 lanes of 8 per pass share each V load (see pv_block): the same chains.
    constexpr int NC = pass_lanes(nd);
    for (int g0 = 0; g0 < G; g0 += 3) {
        const int nr = G - g0 < 3 ? G - g0 : 3;
        const float *sg[3];
        for (int k = 0; k < nr; k++) sg[k] = s + (size_t)(g0 + k) * L;
        for (int c0 = 0; c0 < nd; c0 += NC) {
            float *o = out + (size_t)g0 * D;
            if (nr == 3) pv_rows<KV, 3, NC>(sg, V, off, L, D, c0, vsc, inv.data() + g0, o, prefetch_row);
            else if (nr == 2) pv_rows<KV, 2, NC>(sg, V, off, L, D, c0, vsc, inv.data() + g0, o, prefetch_row);
            else pv_rows<KV, 1, NC>(sg, V, off, L, D, c0, vsc, inv.data() + g0, o, prefetch_row);
        }
    }
}

// acc[r] (+)= sum over keys b0..b1-1 of p[r][t] * v[t], lanes c0..c0+NC of NR rows (their running
// sums in ar[r]), one FMA chain per output lane in key order: what attend_rows computes per row.
template <int NR, int NC>
inline void pv_block(const float *const *sg, float *const *ar, const float *vf, int D, int b0, int b1, int c0,
                     const float *vsc) {
    __m256 acc[NR][NC];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_loadu_ps(ar[r] + 8 * (c0 + c));
    for (int tt = b0; tt < b1; tt++) {
        const float *v = vf + (size_t)tt * D + 8 * c0;
        __m256 p[NR];
        for (int r = 0; r < NR; r++)
            p[r] = vsc ? _mm256_set1_ps(sg[r][tt] * vsc[tt]) : _mm256_broadcast_ss(sg[r] + tt);
        for (int c = 0; c < NC; c++) {
            const __m256 vv = _mm256_loadu_ps(v + 8 * c);
            for (int r = 0; r < NR; r++) acc[r][c] = _mm256_fmadd_ps(p[r], vv, acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) _mm256_storeu_ps(ar[r] + 8 * (c0 + c), acc[r][c]);
}

// The scores' dot products of two query rows q0, q1 against the 8 keys at kf (rows of ND * 8
// floats): acc0[j], acc1[j] as attend_rows forms acc[j] for one row (mul by lane chunk 0, then one
// FMA per chunk, in order), four keys at a time so that each key load serves both rows: 8 chains
// and 6 loads per 8 FMAs instead of 8 chains and 16 loads (a wide head, D = 256, keeps no query
// in registers). Same products, same chains: the same bits.
template <int ND>
inline void qk_pair8(const float *q0, const float *q1, const float *kf, __m256 *acc0, __m256 *acc1) {
    constexpr int D = ND * 8;
    for (int kh = 0; kh < 2; kh++) {
        const float *k = kf + (size_t)(4 * kh) * D;
        const __m256 x0 = _mm256_loadu_ps(q0), x1 = _mm256_loadu_ps(q1);
        __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + D), k2 = _mm256_loadu_ps(k + 2 * D),
               k3 = _mm256_loadu_ps(k + 3 * D);
        __m256 a0 = _mm256_mul_ps(x0, k0), a1 = _mm256_mul_ps(x0, k1), a2 = _mm256_mul_ps(x0, k2),
               a3 = _mm256_mul_ps(x0, k3);
        __m256 b0 = _mm256_mul_ps(x1, k0), b1 = _mm256_mul_ps(x1, k1), b2 = _mm256_mul_ps(x1, k2),
               b3 = _mm256_mul_ps(x1, k3);
        for (int c = 1; c < ND; c++) {
            const __m256 y0 = _mm256_loadu_ps(q0 + 8 * c), y1 = _mm256_loadu_ps(q1 + 8 * c);
            k0 = _mm256_loadu_ps(k + 8 * c);
            k1 = _mm256_loadu_ps(k + D + 8 * c);
            k2 = _mm256_loadu_ps(k + 2 * D + 8 * c);
            k3 = _mm256_loadu_ps(k + 3 * D + 8 * c);
            a0 = _mm256_fmadd_ps(y0, k0, a0);
            a1 = _mm256_fmadd_ps(y0, k1, a1);
            a2 = _mm256_fmadd_ps(y0, k2, a2);
            a3 = _mm256_fmadd_ps(y0, k3, a3);
            b0 = _mm256_fmadd_ps(y1, k0, b0);
            b1 = _mm256_fmadd_ps(y1, k1, b1);
            b2 = _mm256_fmadd_ps(y1, k2, b2);
            b3 = _mm256_fmadd_ps(y1, k3, b3);
        }
        acc0[4 * kh] = a0, acc0[4 * kh + 1] = a1, acc0[4 * kh + 2] = a2, acc0[4 * kh + 3] = a3;
        acc1[4 * kh] = b0, acc1[4 * kh + 1] = b1, acc1[4 * kh + 2] = b2, acc1[4 * kh + 3] = b3;
    }
}

// NQ consecutive queries of one sequence (query i attends to keys 0..L0+i-1) x the G heads of one
// KV head, against contiguous float32 K/V rows [L0+NQ-1, ND*8]. Bit for bit what attend_rows<float,
// ND> gives each query alone (the same products, chains, reduction trees and softmax, in the same
// order); only the loop nest differs: scores for 8 keys at a time for every query, then per-query
// softmax, then V in blocks of 32 rows (16 for D = 256) that every query's accumulators (kept in memory between
// blocks) read while the block is in L1. A long prompt's tile thus reads its K/V from memory once
// instead of once per query.
template <int ND>
void tile_rows(const float *q, size_t q_stride, const float *kf, const float *vf, int L0, int NQ, int G,
               float scale, std::vector<float> &S, float *out, size_t out_stride, const float *ksc,
               const float *vsc, float softcap) {
    // ksc/vsc: per-row scales of int8 rows widened unscaled (nullptr for float caches), applied
    // exactly as attend_rows<int8_t> applies them
    constexpr int D = ND * 8;
    const int Lmax = L0 + NQ - 1, R = NQ * G;
    S.resize((size_t)R * Lmax);
    thread_local std::vector<float> A;
    A.assign((size_t)R * D, 0.0f);
    const __m256 vscale = _mm256_set1_ps(scale);
    // Wide heads (D = 256): the rows (query, head) whose keys t..t+7 are all in range, two at a time
    // (qk_pair8); the scores are those of the row-by-row loop below.
    constexpr bool kPairs = ND >= 32;
    for (int t = 0; kPairs && t + 8 <= Lmax; t += 8) {
        const int i0 = t + 8 - L0 > 0 ? t + 8 - L0 : 0;       // queries before i0: this block is their tail
        const int r0 = i0 * G, R = NQ * G;
        const float *kt = kf + (size_t)t * D;
        for (int r = r0; r < R; r += 2) {
            const int r1 = r + 1 < R ? r + 1 : r;              // an odd last row pairs with itself
            const float *qa = q + (size_t)(r / G) * q_stride + (size_t)(r % G) * D;
            const float *qb = q + (size_t)(r1 / G) * q_stride + (size_t)(r1 % G) * D;
            __m256 acc0[8], acc1[8];
            qk_pair8<ND>(qa, qb, kt, acc0, acc1);
            __m256 s0 = _mm256_mul_ps(hsum8(acc0), vscale), s1 = _mm256_mul_ps(hsum8(acc1), vscale);
            if (ksc) {
                s0 = _mm256_mul_ps(s0, _mm256_loadu_ps(ksc + t));
                s1 = _mm256_mul_ps(s1, _mm256_loadu_ps(ksc + t));
            }
            _mm256_storeu_ps(S.data() + (size_t)r * Lmax + t, s0);
            _mm256_storeu_ps(S.data() + (size_t)r1 * Lmax + t, s1);
        }
    }
    for (int t = 0; !kPairs && t + 8 <= Lmax; t += 8) {
        for (int i = 0; i < NQ; i++) {
            if (t + 8 > L0 + i) continue;                      // this query's tail: below
            for (int g = 0; g < G; g++) {
                const float *qg = q + (size_t)i * q_stride + (size_t)g * D;
                __m256 qv[ND], acc[8];
                for (int c = 0; c < ND; c++) qv[c] = _mm256_loadu_ps(qg + 8 * c);
                for (int j = 0; j < 8; j++) {
                    const float *k = kf + (size_t)(t + j) * D;
                    __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
                    for (int c = 1; c < ND; c++) a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k + 8 * c), a);
                    acc[j] = a;
                }
                __m256 sv = _mm256_mul_ps(hsum8(acc), vscale);
                if (ksc) sv = _mm256_mul_ps(sv, _mm256_loadu_ps(ksc + t));
                _mm256_storeu_ps(S.data() + (size_t)(i * G + g) * Lmax + t, sv);
            }
        }
    }
    thread_local std::vector<float> inv;
    inv.resize(R);
    for (int i = 0; i < NQ; i++) {
        const int L = L0 + i;
        for (int g = 0; g < G; g++) {
            float *sg = S.data() + (size_t)(i * G + g) * Lmax;
            const float *qg = q + (size_t)i * q_stride + (size_t)g * D;
            for (int t = L & ~7; t < L; t++)
                sg[t] = ksc ? dot(qg, kf + (size_t)t * D, D) * scale * ksc[t] : dot(qg, kf + (size_t)t * D, D) * scale;
            if (softcap > 0.0f) softcap_row(sg, L, softcap);
            inv[i * G + g] = 1.0f / softmax_row(sg, L);
        }
    }
    // V: rows of one query (its G heads, up to 3 at a time) x 4 lanes of 8 share each V load, so
    // 12 independent FMA chains run side by side; each output's chain is still key by key in order.
    // A block of V rows stays in L1 for all the queries: 32 rows, 16 for D = 256 (16 KB of the 32);
    // each output's chain is the same whichever the block size (pv_block carries it through A).
    constexpr int NC = pass_lanes(ND), KB = ND >= 32 ? 16 : 32;
    for (int b0 = 0; b0 < Lmax; b0 += KB) {
        for (int i = 0; i < NQ; i++) {
            const int L = L0 + i, b1 = b0 + KB < L ? b0 + KB : L;
            if (b0 >= L) continue;
            for (int g0 = 0; g0 < G; g0 += 3) {
                const float *sg[3];
                float *ar[3];
                const int nr = G - g0 < 3 ? G - g0 : 3;
                for (int k = 0; k < nr; k++) {
                    sg[k] = S.data() + (size_t)(i * G + g0 + k) * Lmax;
                    ar[k] = A.data() + (size_t)(i * G + g0 + k) * D;
                }
                for (int c0 = 0; c0 < ND; c0 += NC) {
                    if (nr == 3) pv_block<3, NC>(sg, ar, vf, D, b0, b1, c0, vsc);
                    else if (nr == 2) pv_block<2, NC>(sg, ar, vf, D, b0, b1, c0, vsc);
                    else pv_block<1, NC>(sg, ar, vf, D, b0, b1, c0, vsc);
                }
            }
        }
    }
    for (int i = 0; i < NQ; i++)
        for (int g = 0; g < G; g++) {
            const float *ar = A.data() + (size_t)(i * G + g) * D;
            const __m256 vinv = _mm256_set1_ps(inv[i * G + g]);
            float *o = out + (size_t)i * out_stride + (size_t)g * D;
            for (int c = 0; c < ND; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(ar + 8 * c), vinv));
        }
}

}  // namespace

namespace kvs {

// nh consecutive KV heads (from head_off, row elements apart) of one sequence for one query, one
// head after another, each exactly as attend_group computes it. With nh > 1 the first head's sweep
// prefetches every head's rows of a token (contiguous in the cache: tok_stride) and the later
// heads find them in cache: the cache is then read in contiguous runs instead of one row per
// token and head (batched decode reads the KV cache at about 3x the speed).
void attend_heads(const float *q, const void *K, const void *V, int kv_dtype, size_t block_stride, size_t tok_stride,
                  int head_off, int row, int nh, const int64_t *table, int block_size, int L, int D, int G,
                  float scale, float *scores, float *out, int attn_isa, float softcap, int start) {
    // Row offsets of tokens start..L-1, block by block (no division per row), for the first head;
    // from here on L counts those tokens only (offs[t] is token start + t).
    thread_local std::vector<size_t> offs;
    thread_local std::vector<float> ksc, vsc;
    if (start < 0) start = 0;
    offs.resize(L - start);
    for (int b = start / block_size, t0 = b * block_size; t0 < L; b++, t0 += block_size) {
        const size_t base = (size_t)table[b] * block_stride + head_off;
        for (int i = t0 < start ? start - t0 : 0; i < block_size && t0 + i < L; i++)
            offs[t0 + i - start] = base + (size_t)i * tok_stride;
    }
    L -= start;
    const int pf_bytes = nh > 1 ? (int)(nh * row * kv_esize(kv_dtype)) : 0;
    for (int h = 0; h < nh; h++) {
        const size_t hoff = (size_t)h * row;
        const float *qh = q + (size_t)h * G * D;
        float *oh = out + (size_t)h * G * D;
        const int pf = h == 0 ? pf_bytes : 0;
        if (kv_dtype == KV_INT8) {   // each row's fp16 scale sits right after its D values
            ksc.resize(L);
            vsc.resize(L);
            const int8_t *k8 = (const int8_t *)K + hoff, *v8 = (const int8_t *)V + hoff;
            for (int t = 0; t < L; t++) {
                uint16_t hk, hv;
                memcpy(&hk, k8 + offs[t] + D, 2);
                memcpy(&hv, v8 + offs[t] + D, 2);
                ksc[t] = _cvtsh_ss(hk);
                vsc[t] = _cvtsh_ss(hv);
            }
        }
        if (attn_isa >= 1 && softcap <= 0.0f) {
            thread_local std::vector<float> inv;
            inv.resize(G);
            const size_t es = kv_esize(kv_dtype);
            if (attend_rows_avx512(D, qh, (const char *)K + hoff * es, (const char *)V + hoff * es, kv_dtype, offs.data(),
                                   L, G, scale, scores, oh, ksc.data(), vsc.data(), pf, inv.data()))
                continue;
        }
#define KVS_ROWS(KV, KS, VS)                                                                                   \
    switch (D % 8 ? 0 : D / 8) {                                                                               \
        case 4: attend_rows<KV, 4>(qh, (const KV *)K + hoff, (const KV *)V + hoff, offs.data(), L, D, G, scale, scores, oh, KS, VS, pf, softcap); break; \
        case 8: attend_rows<KV, 8>(qh, (const KV *)K + hoff, (const KV *)V + hoff, offs.data(), L, D, G, scale, scores, oh, KS, VS, pf, softcap); break; \
        case 10: attend_rows<KV, 10>(qh, (const KV *)K + hoff, (const KV *)V + hoff, offs.data(), L, D, G, scale, scores, oh, KS, VS, pf, softcap); break; \
        case 12: attend_rows<KV, 12>(qh, (const KV *)K + hoff, (const KV *)V + hoff, offs.data(), L, D, G, scale, scores, oh, KS, VS, pf, softcap); break; \
        case 16: attend_rows<KV, 16>(qh, (const KV *)K + hoff, (const KV *)V + hoff, offs.data(), L, D, G, scale, scores, oh, KS, VS, pf, softcap); break; \
        case 32: attend_rows<KV, 32>(qh, (const KV *)K + hoff, (const KV *)V + hoff, offs.data(), L, D, G, scale, scores, oh, KS, VS, pf, softcap); break; \
        default: attend_rows<KV, 0>(qh, (const KV *)K + hoff, (const KV *)V + hoff, offs.data(), L, D, G, scale, scores, oh, KS, VS, pf, softcap); break; \
    }
        if (kv_dtype == 1) {
            KVS_ROWS(bf16, nullptr, nullptr)
        } else if (kv_dtype == 2) {
            KVS_ROWS(f16, nullptr, nullptr)
        } else if (kv_dtype == KV_INT8) {
            KVS_ROWS(int8_t, ksc.data(), vsc.data())
        } else {
            KVS_ROWS(float, nullptr, nullptr)
        }
#undef KVS_ROWS
    }
}

void attend_group(const float *q, const void *K, const void *V, int kv_dtype, size_t block_stride, size_t tok_stride,
                  int head_off, const int64_t *table, int block_size, int L, int D, int G, float scale, float *scores,
                  float *out, float softcap) {
    attend_heads(q, K, V, kv_dtype, block_stride, tok_stride, head_off, 0, 1, table, block_size, L, D, G, scale,
                 scores, out, 0, softcap);
}

void attend_tile(const float *q, size_t q_stride, const void *K, const void *V, int kv_dtype, size_t block_stride,
                 size_t tok_stride, int head_off, const int64_t *table, int block_size, int L0, int NQ, int D, int G,
                 float scale, float *out, size_t out_stride, int attn_isa, uint64_t reuse, float softcap) {
    // The tile's keys 0..L0+NQ-2 as contiguous float32 rows (exact: bf16/f16 -> f32 loses nothing),
    // then every query of the tile through the same arithmetic as a lone query (attend_rows), with
    // the loops turned so that a block of keys serves all the tile's queries while it is in L1.
    const int Lmax = L0 + NQ - 1;
    const bool q8 = kv_dtype == KV_INT8;
    if (q8 && (D % 8 || (D != 32 && D != 64 && D != 80 && D != 96 && D != 128 && D != 256))) {   // no tile code for this D:
        for (int i = 0; i < NQ; i++) {                        // each query alone (the same arithmetic)
            thread_local std::vector<float> sc1;
            sc1.resize((size_t)(L0 + i) * G);
            attend_group(q + (size_t)i * q_stride, K, V, kv_dtype, block_stride, tok_stride, head_off, table,
                         block_size, L0 + i, D, G, scale, sc1.data(), out + (size_t)i * out_stride, softcap);
        }
        return;
    }
    // The widened rows stay with the thread: its next tile of the same call, sequence and KV head
    // (the caller's `reuse` tag names the call) widens only the rows it does not have yet.
    struct Widened {
        const void *K, *V;
        const int64_t *table;
        int head_off, kv_dtype, D, block_size;
        uint64_t reuse;
        int rows, packed;   // rows widened into kf/vf (and ksc/vsc), of them rows packed into kp
    };
    thread_local Widened have{};
    thread_local std::vector<float> kf, vf, scores, ksc, vsc, kp;
    thread_local std::vector<size_t> offs;
    const bool same = reuse != 0 && have.reuse == reuse && have.K == K && have.V == V && have.table == table &&
                      have.head_off == head_off && have.kv_dtype == kv_dtype && have.D == D &&
                      have.block_size == block_size;
    // A few queries with nothing widened to reuse (the verified rows of a speculating request, a
    // short prompt's last tile): widening the whole prefix would cost more than their arithmetic.
    // Each query runs the lone-query code straight from the cache instead (the same bits); the
    // first reads the head's rows into L2 and the others find them there.
    if (NQ <= kSmallTile && (same ? have.rows : 0) < L0) {
        thread_local std::vector<float> sc1;
        sc1.resize((size_t)(L0 + NQ - 1) * G);
        for (int i = 0; i < NQ; i++)
            attend_heads(q + (size_t)i * q_stride, K, V, kv_dtype, block_stride, tok_stride, head_off, 0, 1, table,
                         block_size, L0 + i, D, G, scale, sc1.data(), out + (size_t)i * out_stride, attn_isa,
                         softcap);
        return;
    }
    if (!same) have = Widened{K, V, table, head_off, kv_dtype, D, block_size, reuse, 0, 0};
    const int from = have.rows < Lmax ? have.rows : Lmax;
    if (have.rows < Lmax) have.rows = Lmax;
    const auto grow = [](std::vector<float> &v, size_t n) { if (v.size() < n) v.resize(n); };   // never shrinks:
    grow(kf, (size_t)Lmax * D);                                                               // rows are kept
    grow(vf, (size_t)Lmax * D);
    if (q8) {
        grow(ksc, (size_t)Lmax + 8);
        grow(vsc, (size_t)Lmax + 8);
    }
    for (int t = from; t < Lmax;) {
        const int b = t / block_size;
        const size_t base = (size_t)table[b] * block_stride + head_off;
        for (int i = t - b * block_size; i < block_size && t < Lmax; i++, t++) {
            const size_t src = base + (size_t)i * tok_stride;
            float *kd = kf.data() + (size_t)t * D, *vd = vf.data() + (size_t)t * D;
            if (kv_dtype == 0) {
                memcpy(kd, (const float *)K + src, D * sizeof(float));
                memcpy(vd, (const float *)V + src, D * sizeof(float));
            } else if (kv_dtype == KV_INT8) {   // float(q); the row's scale applied as attend_rows<int8_t> does
                const int8_t *kr = (const int8_t *)K + src, *vr = (const int8_t *)V + src;
                uint16_t hk, hv;
                memcpy(&hk, kr + D, 2);
                memcpy(&hv, vr + D, 2);
                ksc[t] = _cvtsh_ss(hk);
                vsc[t] = _cvtsh_ss(hv);
                int d = 0;
                for (; d + 8 <= D; d += 8) {
                    _mm256_storeu_ps(kd + d, load8(kr + d));
                    _mm256_storeu_ps(vd + d, load8(vr + d));
                }
                for (; d < D; d++) {
                    kd[d] = load1(kr + d);
                    vd[d] = load1(vr + d);
                }
            } else {
                int d = 0;
                for (; d + 8 <= D; d += 8) {
                    _mm256_storeu_ps(kd + d, kv_dtype == 1 ? load8((const bf16 *)K + src + d) : load8((const f16 *)K + src + d));
                    _mm256_storeu_ps(vd + d, kv_dtype == 1 ? load8((const bf16 *)V + src + d) : load8((const f16 *)V + src + d));
                }
                for (; d < D; d++) {
                    kd[d] = kv_dtype == 1 ? load1((const bf16 *)K + src + d) : load1((const f16 *)K + src + d);
                    vd[d] = kv_dtype == 1 ? load1((const bf16 *)V + src + d) : load1((const f16 *)V + src + d);
                }
            }
        }
    }
    const float *ks = q8 ? ksc.data() : nullptr, *vs = q8 ? vsc.data() : nullptr;
    if (attn_isa >= 1 && softcap <= 0.0f && (D == 32 || D == 64 || D == 128)) {
        thread_local std::vector<float> S, A, inv;
        const size_t R = (size_t)NQ * G;
        S.resize(R * Lmax);
        A.resize(R * D);
        inv.resize(R);
        if (have.packed < (Lmax & ~7)) {   // groups of 8 keys not packed yet
            const int p0 = have.packed;
            grow(kp, (size_t)(Lmax & ~7) * D);
            pack_keys_avx512(kf.data() + (size_t)p0 * D, (Lmax & ~7) - p0, D, kp.data() + (size_t)p0 * D);
            have.packed = Lmax & ~7;
        }
        if (tile_rows_avx512(D, q, q_stride, kf.data(), kp.data(), vf.data(), L0, NQ, G, scale,
                             tile_scratch{S.data(), A.data(), inv.data()}, out, out_stride, ks, vs))
            return;
    }
    switch (D % 8 ? 0 : D / 8) {
        case 4: tile_rows<4>(q, q_stride, kf.data(), vf.data(), L0, NQ, G, scale, scores, out, out_stride, ks, vs, softcap); return;
        case 8: tile_rows<8>(q, q_stride, kf.data(), vf.data(), L0, NQ, G, scale, scores, out, out_stride, ks, vs, softcap); return;
        case 10: tile_rows<10>(q, q_stride, kf.data(), vf.data(), L0, NQ, G, scale, scores, out, out_stride, ks, vs, softcap); return;
        case 12: tile_rows<12>(q, q_stride, kf.data(), vf.data(), L0, NQ, G, scale, scores, out, out_stride, ks, vs, softcap); return;
        case 16: tile_rows<16>(q, q_stride, kf.data(), vf.data(), L0, NQ, G, scale, scores, out, out_stride, ks, vs, softcap); return;
        case 32: tile_rows<32>(q, q_stride, kf.data(), vf.data(), L0, NQ, G, scale, scores, out, out_stride, ks, vs, softcap); return;
        default: break;
    }
    offs.resize(Lmax);
    scores.resize((size_t)Lmax * G);
    for (int t = 0; t < Lmax; t++) offs[t] = (size_t)t * D;
    for (int i = 0; i < NQ; i++)
        attend_rows<float, 0>(q + (size_t)i * q_stride, kf.data(), vf.data(), offs.data(), L0 + i, D, G, scale,
                              scores.data(), out + (size_t)i * out_stride, nullptr, nullptr, 0, softcap);
}

void rms_norm_row(const float *x, const float *w, int n, float eps, float *y) {
    const float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    const __m256 iv = _mm256_set1_ps(inv);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), iv), _mm256_loadu_ps(w + i)));
    for (; i < n; i++) y[i] = x[i] * inv * w[i];
}

}  // namespace kvs

extern "C" {

// Paged attention for T query tokens (see the top of this file). kv_dtype: 0 float32, 1 bfloat16,
// 2 float16, 3 int8 rows with scales.
void kvs_paged_attention(const float *q, const void *kv_cache, int kv_dtype, int num_blocks, int block_size,
                         int Hq, int Hkv, int D, const int64_t *tables, int max_blocks, const int64_t *seq_of,
                         const int64_t *positions, int T, float scale, float *out, int nth) {
    const int group = Hq / Hkv;
    const int row = kvs::kv_row(D, kv_dtype);
    const size_t tok_stride = (size_t)Hkv * row;
    const size_t block_stride = (size_t)block_size * tok_stride;
    const size_t esize = kvs::kv_esize(kv_dtype);
    const char *K = (const char *)kv_cache;
    const char *V = K + (size_t)num_blocks * block_stride * esize;
    // Work items: a query with all its KV heads (attend_heads: contiguous cache reads) when there
    // are enough queries for the team, else (query, KV head) pairs. Same arithmetic either way.
    nth = kvs::team_for(nth);
    const int nh = T >= 2 * nth ? Hkv : 1;
    const int items = T * (Hkv / nh);
    if (nth > items) nth = items;
    if (nth < 1) nth = 1;
#pragma omp parallel num_threads(nth)
    {
        std::vector<float> scores;
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int t = it / (Hkv / nh), h = it % (Hkv / nh);
            const int L = (int)positions[t] + 1;
            scores.resize((size_t)group * L);
            kvs::attend_heads(q + ((size_t)t * Hq + (size_t)h * group) * D, K, V, kv_dtype, block_stride, tok_stride,
                              h * row, row, nh, tables + (size_t)seq_of[t] * max_blocks, block_size, L, D, group,
                              scale, scores.data(), out + ((size_t)t * Hq + (size_t)h * group) * D);
        }
    }
}

}  // extern "C"

extern "C" {

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for T rows of n floats (one fused pass per row).
void kvs_rms_norm(const float *x, const float *w, int T, int n, float eps, float *y) {
    for (int t = 0; t < T; t++) kvs::rms_norm_row(x + (size_t)t * n, w, n, eps, y + (size_t)t * n);
}

}  // extern "C"
