// Longer than 420 lines on purpose: it mirrors kvserve_attention.cpp's tile kernel operation for
// operation (same bits), and the two are read side by side; splitting it would hide that pairing.
// The prompt-tile attention of kvserve_attention.cpp (tile_rows) with 512-bit registers: the same
// products, FMA chains, reduction trees, exponentials and sums for every output, so the same bits,
// with two of the AVX2 code's 8-lane vectors side by side in each register.
//
//   scores  the tile's keys are copied once more, in groups of 8 with keys j and j+4 side by side
//           per 8-lane chunk (kvs::pack_keys_avx512), so a register holds one query row's AVX2
//           partial sums for two keys, the query's chunk broadcast to both halves; the 8-key hadd
//           tree then runs on 4 registers (vhaddps has no 512-bit form: shuffles pick the same
//           pairs), and three query rows share each key load
//   softmax exponentials 16 at a time (lane by lane the AVX2 polynomial), their sum accumulated
//           8 lanes at a time in the AVX2 order
//   V       16 output lanes per register instead of 8: each lane's chain is still key by key
//
// A lone query (decode; attend_rows in the AVX2 code) gets the same treatment straight from the
// paged cache: keys j and j+4 of a head widened into one register and used by the GQA group's
// query heads together, V rows 16 lanes at a time for up to 3 heads.
//
// That halves the instructions per (query, key). Measured on a Zen 5 (two full-width FMA pipes):
// one tile 3.1 -> 1.7 ns per (query head, key); not yet on a Zen 4 (512-bit FMAs split in two) or
// an Intel AVX-512 CPU. Only entered where the backend found avx512f/bw/vl/dq (the model
// descriptor's attn_isa), and compiled
// for that target alone (the pragma); no C++ library code is instantiated here, so nothing built
// for AVX-512 can be shared with the AVX2 objects at link time.

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")

#define KVS_NO_INLINE_HELPERS
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kvserve_kernels.h"

namespace {

// A load that feeds several FMAs stays one load: GCC otherwise folds it into each FMA as a memory
// operand, and the tile was bound by those loads (V: 12 loads per key for 3 rows instead of 4; the
// tile ran at 2.8 ns per (query head, key) that way and 1.7 with this, Zen 5, one thread).
inline void in_register(__m512 &v) { __asm__("" : "+v"(v)); }

// kvs::exp8 of the AVX2 code, lane for lane.
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// The AVX2 code's hsum.
inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    lo = _mm_add_ps(lo, _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// Two 8-value chunks of cache rows (keys j and j + 4), widened to float32 exactly, side by side.
inline __m512 load_pair(const float *a, const float *b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
inline __m512 load_pair(const kvs::f16 *a, const kvs::f16 *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
inline __m512 load_pair(const kvs::bf16 *a, const kvs::bf16 *b) {
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                              _mm_loadu_si128((const __m128i *)b), 1);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_pair(const int8_t *a, const int8_t *b) {
    const __m128i h = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h));
}
// 16 consecutive values of a cache row, widened.
inline __m512 load16(const float *p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const kvs::f16 *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
inline __m512 load16(const kvs::bf16 *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
inline __m512 load16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
template <typename KV>
constexpr bool kScaled = false;
template <>
constexpr bool kScaled<int8_t> = true;

// The AVX2 dot of a query head with one row (D a multiple of 8): chunks widened 8 at a time (a
// query's last keys, fewer than 8, in the tile and for a lone query).
template <typename KV>
inline float dot_row(const float *a, const KV *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm512_castps512_ps256(load_pair(b + i, b + i)), acc);
    return hsum(acc);
}

// _mm256_hadd_ps in each 256-bit half: [a0+a1, a2+a3, b0+b1, b2+b3] per 128-bit lane.
inline __m512 hadd(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The AVX2 hsum8 tree over keys 0..7 when a[jj] holds [key jj | key jj + 4] (jj = 0..3).
inline __m256 hsum8_pairs(const __m512 *a) {
    const __m512 s = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));   // [s0123 | s4567]
    // AVX2: [s0123 low lane | s4567 low lane] + [s0123 high lane | s4567 high lane]
    const __m512 x = _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(3, 1, 2, 0));
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm512_extractf32x8_ps(x, 1));
}

// Scores of NR (1 to 3) query rows against the 8 keys at kb (paired layout): the AVX2 chains.
template <int ND, int NR>
inline void scores_rows(const float *const *qr, const float *kb, __m256 *out) {
    __m512 acc[NR][4];
    for (int r = 0; r < NR; r++) {
        const __m512 x = _mm512_broadcast_f32x8(_mm256_loadu_ps(qr[r]));
        for (int jj = 0; jj < 4; jj++) acc[r][jj] = _mm512_mul_ps(x, _mm512_loadu_ps(kb + 16 * jj));
    }
    for (int c = 1; c < ND; c++) {
        __m512 x[NR];
        for (int r = 0; r < NR; r++) x[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(qr[r] + 8 * c));
        for (int jj = 0; jj < 4; jj++) {
            __m512 k = _mm512_loadu_ps(kb + 64 * c + 16 * jj);
            in_register(k);
            for (int r = 0; r < NR; r++) acc[r][jj] = _mm512_fmadd_ps(x[r], k, acc[r][jj]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = hsum8_pairs(acc[r]);
}

// sg[0..L) <- exp(sg - max), returning their sum: the AVX2 softmax_row's numbers.
inline float softmax_row(float *sg, int L) {
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= L; i += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(sg + i));
    float mx = _mm512_reduce_max_ps(vmx);                    // a max: the order does not matter
    for (; i < L; i++) mx = sg[i] > mx ? sg[i] : mx;
    const __m512 vm = _mm512_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (i = 0; i + 16 <= L; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i), vm));
        _mm512_storeu_ps(sg + i, e);
        vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));          // 8 lanes at a time, in order
        vsum = _mm256_add_ps(vsum, _mm512_extractf32x8_ps(e, 1));
    }
    if (i + 8 <= L) {
        const __m256 e = _mm512_castps512_ps256(exp16(_mm512_castps256_ps512(_mm256_sub_ps(_mm256_loadu_ps(sg + i), _mm512_castps512_ps256(vm)))));
        _mm256_storeu_ps(sg + i, e);
        vsum = _mm256_add_ps(vsum, e);
        i += 8;
    }
    float sum = hsum(vsum);
    for (; i < L; i++) sum += (sg[i] = expf(sg[i] - mx));
    return sum;
}

// acc[r] (+)= sum over keys b0..b1-1 of p[r][t] * v[t], 16-lane chunks c0..c0+NC of NR rows.
template <int NR, int NC>
inline void pv_block(const float *const *sg, float *const *ar, const float *vf, int D, int b0, int b1, int c0,
                     const float *vsc) {
    __m512 acc[NR][NC];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_loadu_ps(ar[r] + 16 * (c0 + c));
    for (int tt = b0; tt < b1; tt++) {
        const float *v = vf + (size_t)tt * D + 16 * c0;
        __m512 p[NR];
        for (int r = 0; r < NR; r++) p[r] = _mm512_set1_ps(vsc ? sg[r][tt] * vsc[tt] : sg[r][tt]);
        for (int c = 0; c < NC; c++) {
            __m512 vv = _mm512_loadu_ps(v + 16 * c);
            in_register(vv);
            for (int r = 0; r < NR; r++) acc[r][c] = _mm512_fmadd_ps(p[r], vv, acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(ar[r] + 16 * (c0 + c), acc[r][c]);
}

template <int ND>
void tile_rows(const float *q, size_t q_stride, const float *kf, const float *kp, const float *vf, int L0, int NQ, int G,
               float scale, const kvs::tile_scratch &w, float *out, size_t out_stride, const float *ksc,
               const float *vsc) {
    constexpr int D = ND * 8;
    const int Lmax = L0 + NQ - 1, R = NQ * G;
    float *S = w.S, *A = w.A, *inv = w.inv;
    for (int i = 0; i < R * D; i++) A[i] = 0.0f;
    const __m256 vscale = _mm256_set1_ps(scale);
    const auto row_q = [&](int r) { return q + (size_t)(r / G) * q_stride + (size_t)(r % G) * D; };
    const auto store = [&](int r, int t, __m256 sv) {
        sv = _mm256_mul_ps(sv, vscale);
        if (ksc) sv = _mm256_mul_ps(sv, _mm256_loadu_ps(ksc + t));
        _mm256_storeu_ps(S + (size_t)r * Lmax + t, sv);
    };
    for (int t = 0; t + 8 <= Lmax; t += 8) {
        // keys t..t+7 are every query's from query `first` on (query i has keys 0..L0+i-1), so the
        // rows i * G + g that use them are a contiguous run: three at a time, then what is left
        const int first = t + 8 - L0 > 0 ? t + 8 - L0 : 0;
        const float *kb = kp + (size_t)t * D;
        int r = first * G;
        for (; r + 3 <= R; r += 3) {
            const float *qr[3] = {row_q(r), row_q(r + 1), row_q(r + 2)};
            __m256 sv[3];
            scores_rows<ND, 3>(qr, kb, sv);
            store(r, t, sv[0]);
            store(r + 1, t, sv[1]);
            store(r + 2, t, sv[2]);
        }
        for (; r + 2 <= R; r += 2) {
            const float *qr[2] = {row_q(r), row_q(r + 1)};
            __m256 sv[2];
            scores_rows<ND, 2>(qr, kb, sv);
            store(r, t, sv[0]);
            store(r + 1, t, sv[1]);
        }
        if (r < R) {
            const float *qr[1] = {row_q(r)};
            __m256 sv[1];
            scores_rows<ND, 1>(qr, kb, sv);
            store(r, t, sv[0]);
        }
    }
    for (int i = 0; i < NQ; i++) {
        const int L = L0 + i;
        for (int g = 0; g < G; g++) {
            float *sg = S + (size_t)(i * G + g) * Lmax;
            const float *qg = q + (size_t)i * q_stride + (size_t)g * D;
            for (int t = L & ~7; t < L; t++)
                sg[t] = ksc ? dot_row(qg, kf + (size_t)t * D, D) * scale * ksc[t] : dot_row(qg, kf + (size_t)t * D, D) * scale;
            inv[i * G + g] = 1.0f / softmax_row(sg, L);
        }
    }
    constexpr int N16 = ND / 2, NC = N16 < 4 ? N16 : 4;
    for (int b0 = 0; b0 < Lmax; b0 += 32) {
        for (int i = 0; i < NQ; i++) {
            const int L = L0 + i, b1 = b0 + 32 < L ? b0 + 32 : L;
            if (b0 >= L) continue;
            for (int g0 = 0; g0 < G; g0 += 3) {
                const float *sg[3];
                float *ar[3];
                const int nr = G - g0 < 3 ? G - g0 : 3;
                for (int k = 0; k < nr; k++) {
                    sg[k] = S + (size_t)(i * G + g0 + k) * Lmax;
                    ar[k] = A + (size_t)(i * G + g0 + k) * D;
                }
                for (int c0 = 0; c0 < N16; c0 += NC) {
                    if (nr == 3) pv_block<3, NC>(sg, ar, vf, D, b0, b1, c0, vsc);
                    else if (nr == 2) pv_block<2, NC>(sg, ar, vf, D, b0, b1, c0, vsc);
                    else pv_block<1, NC>(sg, ar, vf, D, b0, b1, c0, vsc);
                }
            }
        }
    }
    for (int i = 0; i < NQ; i++)
        for (int g = 0; g < G; g++) {
            const float *a = A + (size_t)(i * G + g) * D;
            const __m512 vinv = _mm512_set1_ps(inv[i * G + g]);
            float *o = out + (size_t)i * out_stride + (size_t)g * D;
            for (int c = 0; c < N16; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * c), vinv));
        }
}


// Scores of the G (<= 3 at a time) query heads of one KV head against the 8 cache rows k[0..7].
template <typename KV, int ND, int NR>
inline void scores_lone(const float *const *qr, const KV *const *k, __m256 *out) {
    __m512 acc[NR][4];
    for (int r = 0; r < NR; r++) {
        const __m512 x = _mm512_broadcast_f32x8(_mm256_loadu_ps(qr[r]));
        for (int jj = 0; jj < 4; jj++) acc[r][jj] = _mm512_mul_ps(x, load_pair(k[jj], k[jj + 4]));
    }
    for (int c = 1; c < ND; c++) {
        __m512 x[NR];
        for (int r = 0; r < NR; r++) x[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(qr[r] + 8 * c));
        for (int jj = 0; jj < 4; jj++) {
            __m512 kk = load_pair(k[jj] + 8 * c, k[jj + 4] + 8 * c);
            in_register(kk);
            for (int r = 0; r < NR; r++) acc[r][jj] = _mm512_fmadd_ps(x[r], kk, acc[r][jj]);
        }
    }
    for (int r = 0; r < NR; r++) out[r] = hsum8_pairs(acc[r]);
}

// out[r] = inv[r] * sum over the L rows of p[r][t] * v[t] (times the row's scale for int8), NR heads,
// 16-lane chunks c0..c0+NC: the AVX2 pv_rows' chains.
template <typename KV, int NR, int NC, typename Prefetch>
inline void pv_lone(const float *const *sg, const KV *V, const size_t *off, int L, int D, int c0, const float *vsc,
                    const float *inv, float *out, Prefetch prefetch_row) {
    __m512 acc[NR][NC];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();
    for (int tt = 0; tt < L; tt++) {
        if (c0 == 0 && tt + 16 < L) prefetch_row(V + off[tt + 16]);
        const KV *v = V + off[tt] + 16 * c0;
        __m512 p[NR];
        for (int r = 0; r < NR; r++) p[r] = _mm512_set1_ps(kScaled<KV> ? sg[r][tt] * vsc[tt] : sg[r][tt]);
        for (int c = 0; c < NC; c++) {
            __m512 vv = load16(v + 16 * c);
            in_register(vv);
            for (int r = 0; r < NR; r++) acc[r][c] = _mm512_fmadd_ps(p[r], vv, acc[r][c]);
        }
    }
    for (int r = 0; r < NR; r++) {
        const __m512 vinv = _mm512_set1_ps(inv[r]);
        for (int c = 0; c < NC; c++)
            _mm512_storeu_ps(out + (size_t)r * D + 16 * (c0 + c), _mm512_mul_ps(acc[r][c], vinv));
    }
}

// The AVX2 attend_rows<KV, ND> (one query, the G query heads of one KV head, L cache rows at
// K + off[t], V + off[t]), same bits.
template <typename KV, int ND>
void attend_rows(const float *q, const KV *K, const KV *V, const size_t *off, int L, int D, int G, float scale,
                 float *s, float *out, const float *ksc, const float *vsc, int pf_bytes, float *inv) {
    constexpr int row_bytes = ND * 8 * (int)sizeof(KV);
    const int pf = pf_bytes > row_bytes ? pf_bytes : row_bytes;
    const auto prefetch_row = [pf](const KV *r) {
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch((const char *)r + b, _MM_HINT_T0);
        for (int b = row_bytes; b < pf; b += 64) _mm_prefetch((const char *)r + b, _MM_HINT_T1);
    };
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int j = 0; j < 16 && j < L; j++) prefetch_row(K + off[j]);
    int t = 0;
    for (; t + 8 <= L; t += 8) {
        for (int j = t + 16; j < t + 24 && j < L; j++) {
            prefetch_row(K + off[j]);
            for (int b = 0; b < pf; b += 64) _mm_prefetch((const char *)(V + off[j]) + b, _MM_HINT_T1);
        }
        const KV *k[8];
        for (int j = 0; j < 8; j++) k[j] = K + off[t + j];
        for (int g0 = 0; g0 < G; g0 += 3) {
            const int nr = G - g0 < 3 ? G - g0 : 3;
            const float *qr[3];
            __m256 sv[3];
            for (int r = 0; r < nr; r++) qr[r] = q + (size_t)(g0 + r) * D;
            if (nr == 3) scores_lone<KV, ND, 3>(qr, k, sv);
            else if (nr == 2) scores_lone<KV, ND, 2>(qr, k, sv);
            else scores_lone<KV, ND, 1>(qr, k, sv);
            for (int r = 0; r < nr; r++) {
                __m256 x = _mm256_mul_ps(sv[r], vscale);
                if (kScaled<KV>) x = _mm256_mul_ps(x, _mm256_loadu_ps(ksc + t));
                _mm256_storeu_ps(s + (size_t)(g0 + r) * L + t, x);
            }
        }
    }
    for (int j = 0; j < 16 && j < L; j++) prefetch_row(V + off[j]);
    for (; t < L; t++)
        for (int g = 0; g < G; g++) {
            const float d = dot_row(q + (size_t)g * D, K + off[t], D);
            s[(size_t)g * L + t] = kScaled<KV> ? d * scale * ksc[t] : d * scale;
        }
    for (int g = 0; g < G; g++) inv[g] = 1.0f / softmax_row(s + (size_t)g * L, L);
    constexpr int N16 = ND / 2, NC = N16 < 4 ? N16 : 4;
    for (int g0 = 0; g0 < G; g0 += 3) {
        const int nr = G - g0 < 3 ? G - g0 : 3;
        const float *sg[3];
        for (int r = 0; r < nr; r++) sg[r] = s + (size_t)(g0 + r) * L;
        for (int c0 = 0; c0 < N16; c0 += NC) {
            float *o = out + (size_t)g0 * D;
            if (nr == 3) pv_lone<KV, 3, NC>(sg, V, off, L, D, c0, vsc, inv + g0, o, prefetch_row);
            else if (nr == 2) pv_lone<KV, 2, NC>(sg, V, off, L, D, c0, vsc, inv + g0, o, prefetch_row);
            else pv_lone<KV, 1, NC>(sg, V, off, L, D, c0, vsc, inv + g0, o, prefetch_row);
        }
    }
}

template <typename KV>
bool rows_for(int D, const float *q, const KV *K, const KV *V, const size_t *off, int L, int G, float scale, float *s,
              float *out, const float *ksc, const float *vsc, int pf_bytes, float *inv) {
    switch (D) {
        case 32: attend_rows<KV, 4>(q, K, V, off, L, D, G, scale, s, out, ksc, vsc, pf_bytes, inv); return true;
        case 64: attend_rows<KV, 8>(q, K, V, off, L, D, G, scale, s, out, ksc, vsc, pf_bytes, inv); return true;
        case 128: attend_rows<KV, 16>(q, K, V, off, L, D, G, scale, s, out, ksc, vsc, pf_bytes, inv); return true;
        default: return false;
    }
}

}  // namespace

namespace kvs {

void pack_keys_avx512(const float *kf, int L, int D, float *kp) {
    // groups of 8 keys t..t+7; per 8-lane chunk c, for jj = 0..3: [k(t+jj) chunk c | k(t+jj+4) chunk c]
    for (int t = 0; t + 8 <= L; t += 8)
        for (int c = 0; c < D / 8; c++)
            for (int jj = 0; jj < 4; jj++) {
                float *dst = kp + (size_t)t * D + 64 * c + 16 * jj;
                _mm256_storeu_ps(dst, _mm256_loadu_ps(kf + (size_t)(t + jj) * D + 8 * c));
                _mm256_storeu_ps(dst + 8, _mm256_loadu_ps(kf + (size_t)(t + jj + 4) * D + 8 * c));
            }
}

bool tile_rows_avx512(int D, const float *q, size_t q_stride, const float *kf, const float *kp, const float *vf, int L0,
                      int NQ, int G, float scale, const tile_scratch &w, float *out, size_t out_stride,
                      const float *ksc, const float *vsc) {
    switch (D) {
        case 32: tile_rows<4>(q, q_stride, kf, kp, vf, L0, NQ, G, scale, w, out, out_stride, ksc, vsc); return true;
        case 64: tile_rows<8>(q, q_stride, kf, kp, vf, L0, NQ, G, scale, w, out, out_stride, ksc, vsc); return true;
        case 128: tile_rows<16>(q, q_stride, kf, kp, vf, L0, NQ, G, scale, w, out, out_stride, ksc, vsc); return true;
        default: return false;
    }
}

bool attend_rows_avx512(int D, const float *q, const void *K, const void *V, int kv_dtype, const size_t *off, int L,
                        int G, float scale, float *s, float *out, const float *ksc, const float *vsc, int pf_bytes,
                        float *inv) {
    switch (kv_dtype) {
        case 0: return rows_for(D, q, (const float *)K, (const float *)V, off, L, G, scale, s, out, ksc, vsc, pf_bytes, inv);
        case 1: return rows_for(D, q, (const bf16 *)K, (const bf16 *)V, off, L, G, scale, s, out, ksc, vsc, pf_bytes, inv);
        case 2: return rows_for(D, q, (const f16 *)K, (const f16 *)V, off, L, G, scale, s, out, ksc, vsc, pf_bytes, inv);
        case 3:   // int8 rows, their scales in ksc/vsc
            return rows_for(D, q, (const int8_t *)K, (const int8_t *)V, off, L, G, scale, s, out, ksc, vsc, pf_bytes, inv);
        default: return false;
    }
}

}  // namespace kvs
