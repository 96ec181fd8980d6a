// Shared declarations of the kvserve CPU kernels (one shared library, several translation units).
//
//   kvserve_kernels.cpp   packed GGUF weights: repack, activation quantization, int8 matmul tiles
//   kvserve_attention.cpp paged attention (fp32 or bf16 KV cache), RMSNorm
//   kvserve_forward.cpp   a whole forward pass of the Llama layer stack in one call (small batches)

#pragma once

#include <stddef.h>
#include <stdint.h>

extern "C" {

struct kvs_weight {
    int32_t qtype;  // 0 = Q4 (Q4_0/Q4_1/Q4_K repacked), 1 = Q8_0
    int32_t rows;   // out_features
    int32_t cols;   // in_features (multiple of 32)
    int32_t pad;
    const uint8_t *qs;
    const float *d;
    const float *m;     // Q4 only
    const float *bias;  // may be NULL
};

}  // extern "C"

namespace kvs {

constexpr int QK = 32;

// Bytes of scratch the quantized activations of T rows of K floats need (see quantize_rows_q8).
inline size_t q8_scratch_bytes(int T, int K) { return (size_t)T * K + 2 * (size_t)T * (K / QK) * sizeof(float); }

// x [K] -> int8 blocks of 32 (xq [K]), their scales xd [K/32] and, if xs != NULL, xd * sum(block).
void quantize_row_q8(const float *x, int K, int8_t *xq, float *xd, float *xs);

// This thread's share (rows split in multiples of 4 over nth threads) of y[t, r] (+)= W[r] . x[t]
// for T quantized activation rows; y has row stride ldy. add: accumulate into y (residual add).
void linear_rows(const kvs_weight *w, const int8_t *xq, const float *xd, const float *xs, int T, float *y,
                 int ldy, bool add, int ith, int nth);

// One query head against its sequence's first L cached tokens, read through the block table.
// kv_dtype 0 = float32, 1 = bfloat16 (stored as uint16). scores: scratch of L floats.
void attend_head(const float *q, const void *K, const void *V, int kv_dtype, size_t block_stride,
                 size_t tok_stride, int head_off, const int64_t *table, int block_size, int L, int D,
                 float scale, float *scores, float *out);

// y = x / sqrt(mean(x^2) + eps) * w over n floats.
void rms_norm_row(const float *x, const float *w, int n, float eps, float *y);

// float -> bfloat16, round to nearest even (what torch's .to(torch.bfloat16) does).
inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

}  // namespace kvs
