// K-quant repacking at load, in C (issue 61: the first load of a new file was the numpy repack,
// ~25 ns a value). Same results as the numpy code it replaces (gguf_linear.unpack_q4_k,
// kquants.dequantize_* and kquants.quantize_q8_0), bit for bit: the same float32 operations in
// the same order, no fused multiply-adds (fp-contract off below), round-half-even as np.rint.
//
//   kvs_repack_q4_k   Q4_K super-blocks -> the Q4 layout (kvserve_kernels.cpp), scales d*sc and
//                     minima -(dmin*m) as float32 per 32 values
//   kvs_repack_q4_k_super  Q4_K super-blocks -> the Q4 codes and the file's own scales per
//                     super-block (layout qtype 2): fp16 d and dmin, the 6-bit scales and
//                     minima widened to bytes; nothing computed, so nothing rounded
//   kvs_repack_q6_k   Q6_K super-blocks -> layout qtype 3: the 6-bit codes (nibbles + 2-bit plane),
//                     fp16 d and the int8 scales per 16 values, as the file has them
//   kvs_repack_q8_0   Q8_0 rows into the Q8 layout: kvs_repack's bytes, 4-byte runs at a time
//   kvs_q8_0_rows     Q4_K / Q5_K / Q6_K rows decoded exactly (llama.cpp's dequantize_row_*) and
//                     requantized per 32 values into Q8_0 blocks (fp16 scale amax/127 rounded up)
//
// Rows are independent, so both split rows over OpenMP threads; the bytes do not depend on it.

#pragma GCC optimize("fp-contract=off")

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define KVS_NO_INLINE_HELPERS
#include "kvserve_kernels.h"

namespace {

constexpr int QK_K = 256;

inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// llama.cpp's get_scale_min_k4: 6-bit scale and min of sub-block j from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Sub-block 2c+h of a Q4_K/Q5_K super-block (h = 0: the low nibbles of its 32 bytes at q, 1: the
// high ones) into one row of a 16-row group of the Q4 layout: value pairs (kk, kk+16) as one byte,
// four at a time per 64-byte column; dst is the row's first byte in the group's block.
inline void put_nibbles(const uint8_t *q, int h, uint8_t *dst) {
    for (int kk = 0; kk < 16; kk++) {
        const uint8_t lo = h ? q[kk] >> 4 : q[kk] & 0x0F;
        const uint8_t hi = h ? q[kk + 16] >> 4 : q[kk + 16] & 0x0F;
        dst[(kk / 4) * 64 + kk % 4] = (uint8_t)(lo | (hi << 4));
    }
}

// One Q4_K/Q5_K/Q6_K super-block -> 256 floats.
void decode_block(int ggml_type, const uint8_t *b, float *y) {
    if (ggml_type == 12 || ggml_type == 13) {   // Q4_K (144 bytes) / Q5_K (176 bytes)
        const float d = h2f(b), dmin = h2f(b + 2);
        const uint8_t *scales = b + 4;
        const uint8_t *qh = b + 16;
        const uint8_t *qs = ggml_type == 12 ? b + 16 : b + 48;
        for (int c = 0; c < 4; c++) {
            for (int h = 0; h < 2; h++) {
                const int j = 2 * c + h;
                uint8_t sc, mn;
                scale_min_k4(j, scales, &sc, &mn);
                const float d1 = d * (float)sc, m1 = dmin * (float)mn;
                for (int l = 0; l < 32; l++) {
                    int q = h ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 0x0F;
                    if (ggml_type == 13) q |= ((qh[l] >> j) & 1) << 4;
                    const float p = d1 * (float)q;
                    y[32 * j + l] = p - m1;
                }
            }
        }
        return;
    }
    // Q6_K (210 bytes): ql[128], qh[64], int8 scales[16], fp16 d
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    for (int n = 0; n < 2; n++) {
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = (d * (float)sc[is + 0]) * (float)q1;
            y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
            y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
            y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

inline int block_bytes(int ggml_type) { return ggml_type == 12 ? 144 : ggml_type == 13 ? 176 : 210; }

// 32 floats -> one Q8_0 block (34 bytes), as kquants.quantize_q8_0 (AVX2; max, multiply and
// round-half-even are exact operations, so lanes give numpy's bits).
void quantize_block_q8_0(const float *x, uint8_t *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], a = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        a = _mm256_max_ps(a, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float amax = _mm_cvtss_f32(m4);
    float want = amax / 127.0f;
    if (want > 65504.0f) want = 65504.0f;
    uint16_t h = _cvtss_sh(want, _MM_FROUND_TO_NEAREST_INT);
    if (_cvtsh_ss(h) < want) h++;   // next float16 up (want >= 0, finite)
    const float d = _cvtsh_ss(h);
    const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    memcpy(out, &h, 2);
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
        q[i] = _mm256_cvtps_epi32(r);
    }
    // int32 -> int8 in order: packs work per 128-bit lane, so fix the order with a permute
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)(out + 2), p8);
}

// Q4_K (Q5 false) or Q5_K (Q5 true) super-blocks into layout qtype 2 / 4: the nibbles as
// kvs_repack_q4_k writes them, for Q5_K a plane of fifth bits after each row group's block, and the
// file's own super-block scales (fp16 d and dmin, the 6-bit scales and minima widened to bytes).
template <bool Q5>
void repack_k_super(const uint8_t *raw, int rows, int cols, uint8_t *qs, uint8_t *ks) {
    const int nb = cols / 32, nsb = cols / QK_K;
    const int groups = (rows + 15) / 16, full = rows / 16;
    const size_t qb = Q5 ? KVS_Q5_BLOCK_BYTES : 256, sb = Q5 ? 176 : 144, nibbles = Q5 ? 48 : 16;
    memset(qs + (size_t)full * nb * qb, 0, (size_t)(groups - full) * nb * qb);
    memset(ks + (size_t)full * nsb * KVS_KSUPER_BYTES, 0, (size_t)(groups - full) * nsb * KVS_KSUPER_BYTES);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const int g = r / 16, rr = r % 16;
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = raw + ((size_t)r * nsb + s) * sb;
            const uint8_t *qh = b + 16;    // Q5_K: the fifth bits
            uint8_t *k = ks + ((size_t)g * nsb + s) * KVS_KSUPER_BYTES;
            memcpy(k + 2 * rr, b, 2);
            memcpy(k + 32 + 2 * rr, b + 2, 2);
            for (int c = 0; c < 4; c++) {
                const uint8_t *q = b + nibbles + 32 * c;   // sub-block 2c: low nibbles, 2c+1: high
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * c + h, blk = s * 8 + j;
                    scale_min_k4(j, b + 4, k + 64 + j * 16 + rr, k + 192 + j * 16 + rr);
                    uint8_t *dst = qs + ((size_t)g * nb + blk) * qb + rr * 4;
                    put_nibbles(q, h, dst);
                    if (!Q5)
                        continue;
                    uint8_t plane[4] = {0, 0, 0, 0};
                    for (int kk = 0; kk < 16; kk++) {
                        plane[kk % 4] |= (uint8_t)((((qh[kk] >> j) & 1) << (2 * (kk / 4))) |
                                                   (((qh[kk + 16] >> j) & 1) << (2 * (kk / 4) + 1)));
                    }
                    memcpy(dst + 256, plane, 4);
                }
            }
        }
    }
}

}  // namespace

extern "C" {

// Q4_K rows (rows x cols/256 super-blocks of 144 bytes) into the Q4 layout; d and m float32,
// sized by kvs_packed_qs_bytes(0, ...) / kvs_packed_scales. Padding rows are zero.
void kvs_repack_q4_k(const uint8_t *raw, int rows, int cols, uint8_t *qs, float *d, float *m) {
    const int nb = cols / 32, nsb = cols / QK_K;
    const int groups = (rows + 15) / 16;
    memset(qs + (size_t)(rows / 16) * nb * 256, 0, (size_t)(groups - rows / 16) * nb * 256);
    memset(d + (size_t)(rows / 16) * nb * 16, 0, (size_t)(groups - rows / 16) * nb * 16 * sizeof(float));
    memset(m + (size_t)(rows / 16) * nb * 16, 0, (size_t)(groups - rows / 16) * nb * 16 * sizeof(float));
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const int g = r / 16, rr = r % 16;
        for (int s = 0; s < nsb; s++) {
            const uint8_t *b = raw + ((size_t)r * nsb + s) * 144;
            const float sd = h2f(b), smin = h2f(b + 2);
            for (int c = 0; c < 4; c++) {
                const uint8_t *q = b + 16 + 32 * c;   // sub-block 2c: low nibbles, 2c+1: high
                for (int h = 0; h < 2; h++) {
                    const int j = 2 * c + h, blk = s * 8 + j;
                    uint8_t sc, mn;
                    scale_min_k4(j, b + 4, &sc, &mn);
                    const size_t at = ((size_t)g * nb + blk) * 16 + rr;
                    d[at] = sd * (float)sc;
                    m[at] = -(smin * (float)mn);
                    uint8_t *dst = qs + ((size_t)g * nb + blk) * 256 + rr * 4;
                    put_nibbles(q, h, dst);
                }
            }
        }
    }
}

// Q4_K rows into layout qtype 2 (kvserve_kernels.cpp): qs as kvs_repack_q4_k writes them, ks the
// super-block scales, sized by kvs_packed_qs_bytes(2, ...) / kvs_packed_kscale_bytes. Padding rows
// are zero.
void kvs_repack_q4_k_super(const uint8_t *raw, int rows, int cols, uint8_t *qs, uint8_t *ks) {
    repack_k_super<false>(raw, rows, cols, qs, ks);
}

// Q5_K rows into layout qtype 4 (kvserve_kernels.cpp): nibbles as Q4_K's, a plane of fifth bits,
// the super-block scales as kvs_repack_q4_k_super writes them; sized by kvs_packed_qs_bytes(4, ...)
// / kvs_packed_kscale_bytes(4, ...). Padding rows are zero.
void kvs_repack_q5_k_super(const uint8_t *raw, int rows, int cols, uint8_t *qs, uint8_t *ks) {
    repack_k_super<true>(raw, rows, cols, qs, ks);
}

// Q6_K rows into layout qtype 3 (kvserve_kernels.cpp): the 6-bit codes split into Q4's nibble
// bytes and a plane of 2-bit pairs, the fp16 d and the 16 int8 scales per super-block; sized by
// kvs_packed_qs_bytes(3, ...) / kvs_packed_kscale_bytes(3, ...). Padding rows are zero.
void kvs_repack_q6_k(const uint8_t *raw, int rows, int cols, uint8_t *qs, uint8_t *ks) {
    const int nb = cols / 32, nsb = cols / QK_K;
    const int groups = (rows + 15) / 16, full = rows / 16;
    const size_t qb = KVS_Q6_BLOCK_BYTES, kb = KVS_Q6_SUPER_BYTES;
    memset(qs + (size_t)full * nb * qb, 0, (size_t)(groups - full) * nb * qb);
    memset(ks + (size_t)full * nsb * kb, 0, (size_t)(groups - full) * nsb * kb);
#pragma omp parallel for schedule(static)
    for (int g = 0; g < groups; g++) {   // a group's bytes are OR-ed together: one thread per group
        const int r_end = (g + 1) * 16 < rows ? (g + 1) * 16 : rows;
        if (g < full) memset(qs + (size_t)g * nb * qb, 0, (size_t)nb * qb);
        for (int r = g * 16; r < r_end; r++) {
            const int rr = r % 16;
            for (int s = 0; s < nsb; s++) {
                const uint8_t *b = raw + ((size_t)r * nsb + s) * 210;
                const uint8_t *ql = b, *qh = b + 128, *sc = b + 192;
                uint8_t q[QK_K];   // codes 0..63 in value order (llama.cpp's dequantize_row_q6_K)
                for (int n = 0; n < 2; n++)
                    for (int l = 0; l < 32; l++) {
                        const uint8_t *L = ql + 64 * n, *H = qh + 32 * n;
                        q[128 * n + l] = (uint8_t)((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4));
                        q[128 * n + l + 32] = (uint8_t)((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4));
                        q[128 * n + l + 64] = (uint8_t)((L[l] >> 4) | (((H[l] >> 4) & 3) << 4));
                        q[128 * n + l + 96] = (uint8_t)((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4));
                    }
                uint8_t *k = ks + ((size_t)g * nsb + s) * kb;
                memcpy(k + 2 * rr, b + 208, 2);
                for (int t = 0; t < 16; t++) k[32 + t * 16 + rr] = sc[t];
                for (int j = 0; j < 8; j++) {
                    uint8_t *dst = qs + ((size_t)g * nb + s * 8 + j) * qb;
                    for (int kk = 0; kk < 32; kk++) {
                        const uint8_t v = q[32 * j + kk];
                        const int i = (kk % 16) / 4, jj = kk % 4, upper = kk >= 16;
                        dst[i * 64 + rr * 4 + jj] |= (uint8_t)((v & 0x0F) << (4 * upper));
                        dst[256 + (i / 2) * 64 + rr * 4 + jj] |= (uint8_t)((v >> 4) << ((i % 2) * 4 + upper * 2));
                    }
                }
            }
        }
    }
}

// Rows of ggml_type 12 (Q4_K), 13 (Q5_K) or 14 (Q6_K) -> Q8_0 rows (cols/32 blocks of 34 bytes).
// Returns 0, or -1 on another type.
int kvs_q8_0_rows(int ggml_type, const uint8_t *raw, int rows, int cols, uint8_t *out) {
    if (ggml_type != 12 && ggml_type != 13 && ggml_type != 14) return -1;
    const int nsb = cols / QK_K, bb = block_bytes(ggml_type);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        float y[QK_K];
        for (int s = 0; s < nsb; s++) {
            decode_block(ggml_type, raw + ((size_t)r * nsb + s) * bb, y);
            uint8_t *o = out + ((size_t)r * (cols / 32) + (size_t)s * 8) * 34;
            for (int k = 0; k < 8; k++) quantize_block_q8_0(y + 32 * k, o + 34 * k);
        }
    }
    return 0;
}

// Q8_0 rows (cols/32 blocks of 34 bytes) into the Q8 layout, scales float16 (sdtype 1) or
// float32 (0): the bytes kvs_repack(8, ...) writes. qs, d sized by kvs_packed_qs_bytes(1, ...) /
// kvs_packed_scales; padding rows are zero.
void kvs_repack_q8_0(const uint8_t *raw, int rows, int cols, uint8_t *qs, void *d, int sdtype) {
    const int nb = cols / 32, groups = (rows + 15) / 16, full = rows / 16;
    const size_t esize = sdtype ? 2 : 4;
    memset(qs + (size_t)full * nb * 512, 0, (size_t)(groups - full) * nb * 512);
    memset((uint8_t *)d + (size_t)full * nb * 16 * esize, 0, (size_t)(groups - full) * nb * 16 * esize);
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const int g = r / 16, rr = r % 16;
        for (int b = 0; b < nb; b++) {
            const uint8_t *p = raw + ((size_t)r * nb + b) * 34;
            const size_t at = ((size_t)g * nb + b) * 16 + rr;
            uint16_t h;
            memcpy(&h, p, 2);
            if (sdtype) ((uint16_t *)d)[at] = h;
            else ((float *)d)[at] = _cvtsh_ss(h);
            uint8_t *dst = qs + ((size_t)g * nb + b) * 512 + rr * 4;
            for (int i = 0; i < 8; i++) memcpy(dst + i * 64, p + 2 + 4 * i, 4);
        }
    }
}

}  // extern "C"
