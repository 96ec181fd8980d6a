// kvserve CPU kernels: GGUF block-quantized matmul (Q4_0, Q4_1, Q8_0) with AVX2 integer dot products.
//
// Built by kvserve.model.kernels.build with: g++ -O3 -mavx2 -mfma -mf16c -fPIC -shared -pthread
// (plus -mavxvnni where the CPU has AVX-VNNI) and called through ctypes. Explicit AVX2 flags (not -march=native) so the same binary is valid on
// every AVX2 host the team runs on.
//
// Weight layout after repacking (done once at load by kvs_repack):
//
//   Q4 (Q4_0 and Q4_1 share it; Q4_0 becomes Q4_1 with m = -8 d):
//     qs [rows][ceil(nb/2)][32] uint8   blocks in pairs: byte i of pair p holds element i of block 2p
//                               (low nibble) and element i of block 2p+1 (high nibble), so one 32-byte
//                               load, an AND and a shift+AND give two blocks in element order
//                               (GGUF's own order, j and j+16 in one byte, needs a lane insert per block)
//     d  [rows][nb] float32     block scale
//     m  [rows][nb] float32     block minimum:  w = d * q + m,  q in 0..15
//   Q8_0:
//     qs [rows][K] int8, d [rows][nb] float32:  w = d * q
//
// Activations are quantized per 32-element block to int8 (like llama.cpp's q8_1):
//     xq [T][K] int8, xd [T][nb] float32 scale, xs [T][nb] float32 = xd * sum(xq of block)
// so that for one block   sum_i w_i x_i  ~=  d * xd * sum_i q_i xq_i  +  m * xs.
// The integer sum uses vpmaddubsw (u8 x s8 -> s16 pairs) + vpmaddwd (-> s32), which is what makes
// llama.cpp fast on AVX2.
//
// Threads: OpenMP, and the library is loaded after torch, so `libgomp.so.1` resolves to the copy
// torch already loaded: the kernels run on torch's own thread team. A private pool measured
// badly: its spinning workers and torch's fought for the same 2 cores (decode 20x slower).
// Calls are serialized by a mutex (one scratch buffer): one forward at a time per process.

#include <immintrin.h>
#include <omp.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVS_QK 32

#include "kvserve_kernels.h"

extern "C" {

int kvs_version(void) { return 6; }

}  // extern "C"

namespace {

int g_nth = 1;  // threads per call, set from torch.get_num_threads()
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
}

}  // namespace kvs

namespace {

using kvs::quantize_row_q8;

// ---------------------------------------------------------------------------------------------
// micro-kernels: R weight rows x TT tokens, full K. y[t * ldy + r] = dot(w_r, x_t) (+ bias)

template <int R, int TT>
inline void q4_tile(const kvs_weight *w, int r0, const int8_t *xq, const float *xd, const float *xs,
                    int t0, float *y, int ldy, bool add) {
    const int K = w->cols, nb = K / KVS_QK, np = (nb + 1) / 2;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[R][TT];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int p = 0; p < np; p++) {
        const int b = 2 * p;
        const bool pair = b + 1 < nb;
        __m256i x0[TT], x1[TT];
        __m256 xd0[TT], xd1[TT];
        for (int j = 0; j < TT; j++) {
            const int8_t *xr = xq + (size_t)(t0 + j) * K + b * KVS_QK;
            const float *dr = xd + (size_t)(t0 + j) * nb + b;
            x0[j] = _mm256_loadu_si256((const __m256i *)xr);
            xd0[j] = _mm256_broadcast_ss(dr);
            if (pair) {
                x1[j] = _mm256_loadu_si256((const __m256i *)(xr + KVS_QK));
                xd1[j] = _mm256_broadcast_ss(dr + 1);
            }
        }
        for (int i = 0; i < R; i++) {
            const size_t row = (size_t)(r0 + i);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w->qs + (row * np + p) * 32));
            const float *dw = w->d + row * nb + b;
            const __m256i w0 = _mm256_and_si256(v, mask);
            const __m256 dw0 = _mm256_broadcast_ss(dw);
            for (int j = 0; j < TT; j++)
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(w0, x0[j])), _mm256_mul_ps(dw0, xd0[j]),
                                            acc[i][j]);
            if (pair) {
                const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                const __m256 dw1 = _mm256_broadcast_ss(dw + 1);
                for (int j = 0; j < TT; j++)
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(w1, x1[j])),
                                                _mm256_mul_ps(dw1, xd1[j]), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        const float *mrow = w->m + (size_t)(r0 + i) * nb;
        for (int j = 0; j < TT; j++) {
            const float *srow = xs + (size_t)(t0 + j) * nb;
            __m256 macc = _mm256_setzero_ps();
            int b = 0;
            for (; b + 8 <= nb; b += 8)
                macc = _mm256_fmadd_ps(_mm256_loadu_ps(mrow + b), _mm256_loadu_ps(srow + b), macc);
            float v = hsum_ps(_mm256_add_ps(acc[i][j], macc));
            for (; b < nb; b++) v += mrow[b] * srow[b];
            if (w->bias) v += w->bias[r0 + i];
            float *dst = y + (size_t)(t0 + j) * ldy + r0 + i;
            *dst = add ? *dst + v : v;
        }
    }
}

template <int R, int TT>
inline void q8_tile(const kvs_weight *w, int r0, const int8_t *xq, const float *xd, const float *,
                    int t0, float *y, int ldy, bool add) {
    const int K = w->cols, nb = K / KVS_QK;
    __m256 acc[R][TT];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < TT; j++) acc[i][j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i xv[TT];
        for (int j = 0; j < TT; j++)
            xv[j] = _mm256_loadu_si256((const __m256i *)(xq + (size_t)(t0 + j) * K + b * KVS_QK));
        for (int i = 0; i < R; i++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w->qs + (size_t)(r0 + i) * K + b * KVS_QK));
            const __m256i wa = _mm256_sign_epi8(wv, wv);
            const float dw = w->d[(size_t)(r0 + i) * nb + b];
            for (int j = 0; j < TT; j++) {
                const __m256i p32 = dot_u8s8(wa, _mm256_sign_epi8(xv[j], wv));
                const __m256 s = _mm256_set1_ps(dw * xd[(size_t)(t0 + j) * nb + b]);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), s, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < TT; j++) {
            float v = hsum_ps(acc[i][j]);
            if (w->bias) v += w->bias[r0 + i];
            float *dst = y + (size_t)(t0 + j) * ldy + r0 + i;
            *dst = add ? *dst + v : v;
        }
}

// ---------------------------------------------------------------------------------------------
// one linear call: quantize x (split over threads by token), then multiply (split over rows)

#define KVS_DISPATCH_TT(KERNEL, R, ...)                               \
    switch (tt) {                                                     \
        case 4: KERNEL<R, 4>(__VA_ARGS__); break;                     \
        case 3: KERNEL<R, 3>(__VA_ARGS__); break;                     \
        case 2: KERNEL<R, 2>(__VA_ARGS__); break;                     \
        default: KERNEL<R, 1>(__VA_ARGS__); break;                    \
    }

template <bool Q4>
void run_rows(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y, int ldy,
              bool add, int rbeg, int rend) {
    // Rows in tiles of 4 (decode: 4 independent accumulator chains), tokens in tiles of 4: a
    // weight block is unpacked once and reused for 4 tokens, and each 4-row strip of weights
    // (~1.4 KB for K=576) stays in L1 while all T tokens stream past it.
    int r = rbeg;
    for (; r + 4 <= rend; r += 4)
        for (int t = 0; t < T; t += 4) {
            const int tt = T - t < 4 ? T - t : 4;
            if (Q4) {
                KVS_DISPATCH_TT(q4_tile, 4, w, r, xq, xd, xs, t, y, ldy, add)
            } else {
                KVS_DISPATCH_TT(q8_tile, 4, w, r, xq, xd, xs, t, y, ldy, add)
            }
        }
    for (; r < rend; r++)
        for (int t = 0; t < T; t += 4) {
            const int tt = T - t < 4 ? T - t : 4;
            if (Q4) {
                KVS_DISPATCH_TT(q4_tile, 1, w, r, xq, xd, xs, t, y, ldy, add)
            } else {
                KVS_DISPATCH_TT(q8_tile, 1, w, r, xq, xd, xs, t, y, ldy, add)
            }
        }
}

}  // namespace

namespace kvs {

void linear_rows(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y,
                 int ldy, bool add, int ith, int nth) {
    const int rows = w->rows;
    const int per = ((rows + nth - 1) / nth + 3) & ~3;
    const int rbeg = ith * per < rows ? ith * per : rows;
    const int rend = rbeg + per < rows ? rbeg + per : rows;
    if (w->qtype == 0)
        run_rows<true>(w, xq, xd, xs, T, y, ldy, add, rbeg, rend);
    else
        run_rows<false>(w, xq, xd, xs, T, y, ldy, add, rbeg, rend);
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

void linear_task(const LinearJob *job, int ith, int nth) {
    const kvs_weight *w = job->w;
    const int K = w->cols, nb = K / KVS_QK;
    const bool q4 = w->qtype == 0;
    // phase 1: quantize this thread's share of tokens
    for (int t = ith; t < job->T; t += nth)
        quantize_row_q8(job->x + (size_t)t * K, K, job->xq + (size_t)t * K, job->xd + (size_t)t * nb,
                        q4 ? job->xs + (size_t)t * nb : nullptr);
#pragma omp barrier
    // phase 2: this thread's rows, in multiples of 4
    kvs::linear_rows(w, job->xq, job->xd, job->xs, job->T, job->y, w->rows, false, ith, nth);
}

// GGUF's 16 bytes (element j low nibble, j+16 high nibble) -> element i at byte i of the pair,
// in the low nibble (first block of the pair) or the high nibble (second).
void put_q4_block(uint8_t *pair, int second, const uint8_t *src) {
    for (int i = 0; i < KVS_QK; i++) {
        const uint8_t q = i < 16 ? (src[i] & 0x0F) : (src[i - 16] >> 4);
        pair[i] |= second ? (uint8_t)(q << 4) : q;
    }
}

// scratch for quantized activations, grown as needed (calls are serialized)
void *g_scratch = nullptr;
size_t g_scratch_size = 0;

}  // namespace

extern "C" {

// Threads per call (the caller's OpenMP team). Small calls use fewer: one thread per 64 rows.
void kvs_set_num_threads(int nth) { g_nth = nth < 1 ? 1 : nth; }

int kvs_get_num_threads(void) { return g_nth; }

// Repack GGUF blocks of `rows` rows of `cols` elements. ggml_type: 2 = Q4_0, 3 = Q4_1, 8 = Q8_0.
// Returns 0 on success, -1 on an unsupported type.
int kvs_repack(int ggml_type, const uint8_t *raw, int rows, int cols, uint8_t *qs, float *d, float *m) {
    const int nb = cols / KVS_QK, np = (nb + 1) / 2;
    if (ggml_type == 2 || ggml_type == 3) memset(qs, 0, (size_t)rows * np * 32);
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) {
            const size_t blk = (size_t)r * nb + b;
            if (ggml_type == 2) {  // Q4_0: fp16 d, 16 bytes
                const uint8_t *p = raw + blk * 18;
                uint16_t h;
                memcpy(&h, p, 2);
                d[blk] = _cvtsh_ss(h);
                m[blk] = -8.0f * d[blk];
                put_q4_block(qs + ((size_t)r * np + b / 2) * 32, b % 2, p + 2);
            } else if (ggml_type == 3) {  // Q4_1: fp16 d, fp16 m, 16 bytes
                const uint8_t *p = raw + blk * 20;
                uint16_t h0, h1;
                memcpy(&h0, p, 2);
                memcpy(&h1, p + 2, 2);
                d[blk] = _cvtsh_ss(h0);
                m[blk] = _cvtsh_ss(h1);
                put_q4_block(qs + ((size_t)r * np + b / 2) * 32, b % 2, p + 4);
            } else if (ggml_type == 8) {  // Q8_0: fp16 d, 32 int8
                const uint8_t *p = raw + blk * 34;
                uint16_t h;
                memcpy(&h, p, 2);
                d[blk] = _cvtsh_ss(h);
                memcpy(qs + (size_t)r * cols + b * KVS_QK, p + 2, KVS_QK);
            } else {
                return -1;
            }
        }
    return 0;
}

}  // extern "C"

namespace {

void dequantize_row(const kvs_weight *w, int r, float *o) {
    const int K = w->cols, nb = K / KVS_QK, np = (nb + 1) / 2;
    for (int b = 0; b < nb; b++) {
        const float d = w->d[(size_t)r * nb + b];
        if (w->qtype == 0) {
            const float m = w->m[(size_t)r * nb + b];
            const uint8_t *pair = w->qs + ((size_t)r * np + b / 2) * 32;
            const int shift = (b % 2) * 4;
            for (int i = 0; i < KVS_QK; i++) o[b * KVS_QK + i] = d * (float)((pair[i] >> shift) & 0x0F) + m;
        } else {
            const int8_t *q = (const int8_t *)w->qs + (size_t)r * K + b * KVS_QK;
            for (int i = 0; i < KVS_QK; i++) o[b * KVS_QK + i] = d * (float)q[i];
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
    int nth = g_nth < w->rows / 64 ? g_nth : w->rows / 64;
    if (nth <= 1) {
        linear_task(&job, 0, 1);
    } else {
#pragma omp parallel num_threads(nth)
        linear_task(&job, omp_get_thread_num(), omp_get_num_threads());
    }
    pthread_mutex_unlock(&g_call_mu);
}

}  // extern "C"
