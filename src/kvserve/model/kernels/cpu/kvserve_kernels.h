// Shared declarations of the kvserve CPU kernels (one shared library, several translation units).
//
//   kvserve_kernels.cpp   packed GGUF weights: repack, activation quantization, int8 matmul tiles
//   kvserve_gemm_avx512.cpp  the same tiles with AVX-512 VNNI (16 rows per register), same results
//   kvserve_attention.cpp paged attention (fp32, bf16, fp16 or int8 KV cache), RMSNorm
//   kvserve_forward.cpp   a whole forward pass of the Llama layer stack in one call (small batches)

#pragma once

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {

// Kernel layouts (kvs_weight.qtype); drawn at the top of kvserve_kernels.cpp.
#define KVS_QTYPE_Q4K 2          // Q4_K: Q4 codes, scales per 256-value super-block (d points at them)
#define KVS_KSUPER_BYTES 320     // one 16-row group's scales of one super-block in that layout
#define KVS_QTYPE_Q6K 3          // Q6_K: 6-bit codes (4 + 2 bits), fp16 d and int8 scales per 16 values
#define KVS_Q6_BLOCK_BYTES 384   // one 16-row group's codes of one 32-value block in that layout
#define KVS_Q6_SUPER_BYTES 288   // one 16-row group's scales of one super-block in that layout
#define KVS_QTYPE_Q5K 4          // Q5_K: Q4's nibbles plus a plane of fifth bits, Q4_K's scale layout
#define KVS_Q5_BLOCK_BYTES 320   // one 16-row group's codes of one 32-value block in that layout
#define KVS_QTYPE_SEGMENTS 5     // a fused projection of row segments, each in its own layout (seg)

struct kvs_weight {
    int32_t qtype;  // 0 = Q4 (Q4_0/Q4_1), 1 = Q8_0, 2 = Q4_K, 3 = Q6_K, 4 = Q5_K (sdtype 2, m NULL),
                    // 5 = segments (qs, d, m NULL; nseg, seg)
    int32_t rows;   // out_features
    int32_t cols;   // in_features (multiple of 32)
    int32_t isa;    // tiles to run: 0 = AVX2 (or AVX-VNNI builds), 1 = AVX-512 VNNI; identical results
    int32_t sdtype; // d and m stored as 0 = float32, 1 = float16 (GGUF's own, widened exactly on load),
                    // 2 = the bytes of the super-block scales (qtypes 2 and 3)
    const uint8_t *qs;
    const void *d;
    const void *m;      // Q4 only
    const float *bias;  // may be NULL
    // qtype 5: a fused projection (q/k/v, gate/up) whose members keep their own types, e.g. a
    // Q4_K_M file's Q4_K q and k beside its Q6_K v: output rows [off_i, off_i + seg[i].rows) are
    // seg[i]'s (off_i: the rows of the segments before it), each run by its own tiles, so no member
    // is requantized for the fusion. Segments are plain weights (nseg 0) of the same cols.
    int32_t nseg;
    const kvs_weight *seg;
};

// Rows `ids` of W as float32 [n, cols] (an embedding lookup from packed rows); -1 on an id out of range.
int kvs_dequantize_rows(const kvs_weight *w, const int64_t *ids, int n, float *out);

}  // extern "C"

namespace kvs {

constexpr int QK = 32;

// 16-bit KV-cache element types (distinct, so templates can tell them apart).
struct bf16 { uint16_t bits; };
struct f16 { uint16_t bits; };

// Bytes of scratch the quantized activations of T rows of K floats need (see quantize_rows_q8).
inline size_t q8_scratch_bytes(int T, int K) { return (size_t)T * K + 2 * (size_t)T * (K / QK) * sizeof(float); }

// x [K] -> int8 blocks of 32 (xq [K]), their scales xd [K/32] and, if xs != NULL, xd * sum(block).
void quantize_row_q8(const float *x, int K, int8_t *xq, float *xd, float *xs);

// This thread's share (rows split in multiples of 4 over nth threads) of y[t, r] (+)= W[r] . x[t]
// for T quantized activation rows; y has row stride ldy. add: accumulate into y (residual add).
void linear_rows(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y,
                 int ldy, bool add, int ith, int nth);

// The G query heads of one KV head (q and out: G rows of D floats) against a sequence's first L
// cached tokens, read through the block table; head_off = kv head * D within a token's K/V row.
// kv_dtype 0 = float32, 1 = bfloat16, 2 = float16, 3 = int8 rows (D values, then the row's fp16
// scale: kv_row(D, 3) = D + 2 bytes; strides and head_off count row elements). scores: G * L floats.
void attend_group(const float *q, const void *K, const void *V, int kv_dtype, size_t block_stride,
                  size_t tok_stride, int head_off, const int64_t *table, int block_size, int L, int D, int G,
                  float scale, float *scores, float *out, float softcap = 0.0f);

// A tile of at most this many queries with no widened keys to reuse runs query by query (attend_tile).
// Measured on the default model (2 threads, Zen 5): at 400 and 2,000 cached tokens a tile of 2 to 12
// queries took 13-55% less time query by query than widened; at 16 the two were even.
constexpr int kSmallTile = 8;

// attend_group for the nh KV heads head_off, head_off + row, ... of one query (q and out: nh * G rows
// of D floats), one after another; the first head's sweep prefetches all nh heads' rows of each token
// (contiguous in the cache), so the cache is read in runs of nh rows. Same results as nh calls.
// softcap > 0: scores -> softcap * tanh(score / softcap) before the softmax (Gemma 2; attn_isa must
// then be 0). start > 0: only keys start..L-1 (a sliding window; table entries before start's block
// are not read).
void attend_heads(const float *q, const void *K, const void *V, int kv_dtype, size_t block_stride,
                  size_t tok_stride, int head_off, int row, int nh, const int64_t *table, int block_size, int L,
                  int D, int G, float scale, float *scores, float *out, int attn_isa = 0, float softcap = 0.0f,
                  int start = 0);

// The AVX-512 build of one head's lone-query attention (attend_rows; same bits) for head sizes 32,
// 64 and 128 (false: another size or dtype, nothing done). K, V: the head's rows at K + off[t]
// (elements of the dtype), ksc/vsc their scales (int8), inv: G floats of scratch.
bool attend_rows_avx512(int D, const float *q, const void *K, const void *V, int kv_dtype, const size_t *off, int L,
                        int G, float scale, float *s, float *out, const float *ksc, const float *vsc, int pf_bytes,
                        float *inv);

// The AVX-512 VNNI tiles (kvserve_gemm_avx512.cpp) for groups [gbeg, gend) of 16 rows: the same
// arithmetic as the AVX2 tiles in kvserve_kernels.cpp. Only for weights whose isa is 1.
void groups_avx512(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y,
                   int ldy, bool add, int gbeg, int gend);

// The AMX-INT8 tiles (kvserve_gemm_amx.cpp): tokens in full tiles of 16 on AMX, the rest through
// groups_avx512; the same arithmetic again. Only for weights whose isa is 2.
void groups_amx(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y, int ldy,
                bool add, int gbeg, int gend);

// NQ consecutive query tokens of one sequence (at positions L0-1 .. L0+NQ-2, query i's G heads at
// q + i * q_stride, its output at out + i * out_stride) against the same KV head: the keys are
// widened to float32 once for the tile, then each query runs exactly the arithmetic of
// attend_group (same bits as a lone query: the tile only saves the conversion and the gathers).
// attn_isa: 1 = the AVX-512 build of the tile (kvserve_attention_avx512.cpp, same bits), 0 = AVX2.
// reuse: a tag for one call's attention (0: none); a thread's next tile with the same tag, cache,
// sequence and KV head reuses the keys and values it widened to float32 for the last one.
void attend_tile(const float *q, size_t q_stride, const void *K, const void *V, int kv_dtype, size_t block_stride,
                 size_t tok_stride, int head_off, const int64_t *table, int block_size, int L0, int NQ, int D, int G,
                 float scale, float *out, size_t out_stride, int attn_isa, uint64_t reuse, float softcap = 0.0f);

// Buffers of one tile's attention, sized by the caller (R = NQ x G rows): S [R x (L0 + NQ - 1)]
// scores, A [R x D] running V sums, inv [R].
struct tile_scratch {
    float *S, *A, *inv;
};

// The AVX-512 tile's copy of the keys: kf's rows [L, D] in groups of 8 with keys j and j+4 side by
// side per 8-lane chunk (the last L % 8 rows are left out; D a multiple of 8).
void pack_keys_avx512(const float *kf, int L, int D, float *kp);

// The AVX-512 tile for head sizes 32, 64 and 128 (false: another size, nothing done).
bool tile_rows_avx512(int D, const float *q, size_t q_stride, const float *kf, const float *kp, const float *vf, int L0,
                      int NQ, int G, float scale, const tile_scratch &w, float *out, size_t out_stride,
                      const float *ksc, const float *vsc);

// Threads a parallel call asked to run with nth should use now: fewer while a core is taken by
// another process (kvserve_forward.cpp learns it from the forward's barrier waits).
int team_for(int nth);

// y = x / sqrt(mean(x^2) + eps) * w over n floats.
void rms_norm_row(const float *x, const float *w, int n, float eps, float *y);

}  // namespace kvs

// Inline helpers below are left out of translation units built for another target (the AVX-512
// one): the linker keeps one copy of an inline function, and it must be the AVX2 build.
#ifndef KVS_NO_INLINE_HELPERS
namespace kvs {

// KV-cache rows: an int8 cache (kv_dtype 3) stores D values and the row's fp16 scale (model/kv_quant.py).
constexpr int KV_INT8 = 3;
inline int kv_row(int D, int kv_dtype) { return kv_dtype == KV_INT8 ? D + 2 : D; }
inline size_t kv_esize(int kv_dtype) { return kv_dtype == KV_INT8 ? 1 : kv_dtype ? 2 : 4; }

// float -> bfloat16, round to nearest even (what torch's .to(torch.bfloat16) does).
inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// e^x, 8 lanes, x clamped to [-87, 88]: 2^(x log2 e) split into 2^n * 2^f with |f| <= 1/2, and 2^f
// by its degree-6 Taylor polynomial (relative error ~1e-7, at fp32 rounding).
inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.5403530e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// out[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u over n floats.
inline void silu_mul_row(const float *g, const float *u, int n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + __builtin_expf(-g[i])) * u[i];
}

// out[i] = gelu_tanh(g[i]) * u[i] over n floats (Gemma's GeGLU). gelu_tanh(g) = g / 2 (1 + tanh(z)),
// z = sqrt(2/pi) (g + 0.044715 g^3), which is g / (1 + e^(-2z)).
inline void gelu_mul_row(const float *g, const float *u, int n, float *out) {
    const __m256 one = _mm256_set1_ps(1.0f), k2 = _mm256_set1_ps(-2.0f * 0.7978845608028654f),
                 c = _mm256_set1_ps(0.044715f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 z = _mm256_mul_ps(k2, _mm256_fmadd_ps(_mm256_mul_ps(c, gv), _mm256_mul_ps(gv, gv), gv));
        const __m256 den = _mm256_add_ps(one, exp8(z));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) {
        const float x = g[i], z = -2.0f * 0.7978845608028654f * (x + 0.044715f * x * x * x);
        out[i] = x / (1.0f + __builtin_expf(z < 88.0f ? z : 88.0f)) * u[i];
    }
}

}  // namespace kvs
#endif  // KVS_NO_INLINE_HELPERS
