// Small fused ops for the decode step. Paged decode attention: one new query token per sequence against its cached K/V, read in place
// through the block table (no gather copy), GQA without repeating K/V. fp32 cache.
//
//   q        [B, Hq, D]                          (already rotated)
//   kv_cache [2, num_blocks, block_size, Hkv, D] (K then V), this layer's
//   tables   [B, max_blocks] int64, seq_lens [B] int64
//   out      [B, Hq, D]
//
// Work items are (sequence, kv head) pairs split over the caller's OpenMP team (torch's, as in
// kvserve_kernels.cpp). Each item: scores of its Hq/Hkv query heads for every cached token (K row
// loaded once for the group), softmax, then the weighted sum of V rows.

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include <vector>

namespace {

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    lo = _mm_add_ps(lo, _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

inline float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

inline void axpy(float *y, float a, const float *x, int n) {
    const __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

}  // namespace

extern "C" {

void kvs_paged_decode_attention(const float *q, const float *kv_cache, int num_blocks, int block_size, int Hq,
                                int Hkv, int D, const int64_t *tables, int max_blocks, const int64_t *seq_lens,
                                int B, float scale, float *out, int nth) {
    const int group = Hq / Hkv;
    const size_t tok_stride = (size_t)Hkv * D;
    const size_t block_stride = (size_t)block_size * tok_stride;
    const float *K = kv_cache;
    const float *V = kv_cache + (size_t)num_blocks * block_stride;
    const int items = B * Hkv;
    if (nth > items) nth = items;
    if (nth < 1) nth = 1;
#pragma omp parallel num_threads(nth)
    {
        std::vector<float> scores;
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int b = it / Hkv, h = it % Hkv;
            const int L = (int)seq_lens[b];
            const int64_t *table = tables + (size_t)b * max_blocks;
            scores.resize((size_t)group * L);
            const float *qh = q + ((size_t)b * Hq + (size_t)h * group) * D;
            for (int t = 0; t < L; t++) {
                const float *k = K + table[t / block_size] * block_stride + (t % block_size) * tok_stride + h * D;
                for (int g = 0; g < group; g++) scores[(size_t)g * L + t] = dot(qh + g * D, k, D) * scale;
            }
            for (int g = 0; g < group; g++) {
                float *s = scores.data() + (size_t)g * L;
                float mx = -INFINITY;
                for (int t = 0; t < L; t++) mx = s[t] > mx ? s[t] : mx;
                float sum = 0.0f;
                for (int t = 0; t < L; t++) {
                    s[t] = expf(s[t] - mx);
                    sum += s[t];
                }
                const float inv = 1.0f / sum;
                for (int t = 0; t < L; t++) s[t] *= inv;
            }
            float *o = out + ((size_t)b * Hq + (size_t)h * group) * D;
            for (int i = 0; i < group * D; i++) o[i] = 0.0f;
            for (int t = 0; t < L; t++) {
                const float *v = V + table[t / block_size] * block_stride + (t % block_size) * tok_stride + h * D;
                for (int g = 0; g < group; g++) axpy(o + g * D, scores[(size_t)g * L + t], v, D);
            }
        }
    }
}

}  // extern "C"

extern "C" {

// y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for T rows of n floats (one fused pass per row;
// torch 2.13's CPU rms_norm runs ~6 separate ops, a decode step calls it 61 times).
void kvs_rms_norm(const float *x, const float *w, int T, int n, float eps, float *y) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * n;
        float *yr = y + (size_t)t * n;
        const float inv = 1.0f / sqrtf(dot(xr, xr, n) / (float)n + eps);
        const __m256 iv = _mm256_set1_ps(inv);
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), iv), _mm256_loadu_ps(w + i)));
        for (; i < n; i++) yr[i] = xr[i] * inv * w[i];
    }
}

}  // extern "C"
