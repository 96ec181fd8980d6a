// Small fused ops: paged attention over the KV cache, read in place through the block tables (no
// gather copy, GQA without repeating K/V), for an fp32 or bf16 cache; and RMSNorm.
//
//   q        [T, Hq, D]                          (already rotated)
//   kv_cache [2, num_blocks, block_size, Hkv, D] (K then V), this layer's; float32 or bfloat16
//   tables   [B, max_blocks] int64, one row per sequence
//   out      [T, Hq, D]
//
// Query token t of the batch sits at absolute position positions[t] of sequence seq_of[t], so it
// attends to that sequence's tokens 0..positions[t] (causal; decode and prefill chunks alike).
// Work items are (token, query head) pairs split over the caller's OpenMP team (torch's, as in
// kvserve_kernels.cpp): 9 items for one decode token of a 9-head model keep 2 threads busier than
// 3 (token, kv head) items would; the K rows a group shares are re-read from L1/L2, not memory.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

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
inline __m256 load8(const uint16_t *p) {  // bf16 -> fp32 is a 16-bit shift
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
inline float load1(const float *p) { return *p; }
inline float load1(const uint16_t *p) {
    uint32_t u = (uint32_t)*p << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

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

template <typename KV>
void attend_head_t(const float *q, const KV *K, const KV *V, size_t block_stride, size_t tok_stride, int head_off,
                   const int64_t *table, int block_size, int L, int D, float scale, float *s, float *out) {
    float mx = -INFINITY;
    for (int t = 0; t < L; t++) {
        const size_t off = table[t / block_size] * block_stride + (t % block_size) * tok_stride + head_off;
        s[t] = dot(q, K + off, D) * scale;
        mx = s[t] > mx ? s[t] : mx;
    }
    float sum = 0.0f;
    for (int t = 0; t < L; t++) {
        s[t] = expf(s[t] - mx);
        sum += s[t];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < D; i++) out[i] = 0.0f;
    for (int t = 0; t < L; t++) {
        const size_t off = table[t / block_size] * block_stride + (t % block_size) * tok_stride + head_off;
        axpy(out, s[t] * inv, V + off, D);
    }
}

}  // namespace

namespace kvs {

void attend_head(const float *q, const void *K, const void *V, int kv_dtype, size_t block_stride, size_t tok_stride,
                 int head_off, const int64_t *table, int block_size, int L, int D, float scale, float *scores,
                 float *out) {
    if (kv_dtype == 1)
        attend_head_t(q, (const uint16_t *)K, (const uint16_t *)V, block_stride, tok_stride, head_off, table,
                      block_size, L, D, scale, scores, out);
    else
        attend_head_t(q, (const float *)K, (const float *)V, block_stride, tok_stride, head_off, table, block_size,
                      L, D, scale, scores, out);
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

// Paged attention for T query tokens (see the top of this file). kv_dtype: 0 float32, 1 bfloat16.
void kvs_paged_attention(const float *q, const void *kv_cache, int kv_dtype, int num_blocks, int block_size,
                         int Hq, int Hkv, int D, const int64_t *tables, int max_blocks, const int64_t *seq_of,
                         const int64_t *positions, int T, float scale, float *out, int nth) {
    const int group = Hq / Hkv;
    const size_t tok_stride = (size_t)Hkv * D;
    const size_t block_stride = (size_t)block_size * tok_stride;
    const size_t esize = kv_dtype == 1 ? 2 : 4;
    const char *K = (const char *)kv_cache;
    const char *V = K + (size_t)num_blocks * block_stride * esize;
    const int items = T * Hq;
    if (nth > items) nth = items;
    if (nth < 1) nth = 1;
#pragma omp parallel num_threads(nth)
    {
        std::vector<float> scores;
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int t = it / Hq, h = it % Hq;
            const int L = (int)positions[t] + 1;
            scores.resize(L);
            kvs::attend_head(q + ((size_t)t * Hq + h) * D, K, V, kv_dtype, block_stride, tok_stride, (h / group) * D,
                             tables + (size_t)seq_of[t] * max_blocks, block_size, L, D, scale, scores.data(),
                             out + ((size_t)t * Hq + h) * D);
        }
    }
}

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for T rows of n floats (one fused pass per row).
void kvs_rms_norm(const float *x, const float *w, int T, int n, float eps, float *y) {
    for (int t = 0; t < T; t++) kvs::rms_norm_row(x + (size_t)t * n, w, n, eps, y + (size_t)t * n);
}

}  // extern "C"
