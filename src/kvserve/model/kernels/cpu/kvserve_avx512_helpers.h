// AVX-512 helpers shared by the tiles built for AVX-512 targets (kvserve_gemm_avx512.cpp and
// kvserve_gemm_amx.cpp). Include after the target pragma and <immintrin.h>. Internal linkage (an
// anonymous namespace), so each of those files keeps its own copy, compiled for its own target.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace {

// Store the 16 row results of one token: the valid lanes only (the last group may be padding).
inline void store_rows16(__m512 v, const float *bias, int row0, int nvalid, float *dst, bool add) {
    const __mmask16 k = nvalid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nvalid) - 1);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + row0));
    if (add) v = _mm512_add_ps(_mm512_maskz_loadu_ps(k, dst), v);
    _mm512_mask_storeu_ps(dst, k, v);
}

// 16 block scales (float16 or float32) at element idx, widened to float32 (exact).
template <bool F16>
inline __m512 scales16(const void *p, size_t idx) {
    if (F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + idx)));
    return _mm512_loadu_ps((const float *)p + idx);
}

// The 16 rows' block scale and minimum of group g, block b: per block (SM 0 float32, 1 float16) or
// formed from the Q4_K super-block scales (SM 2; the AVX2 tiles' q4_scales8, same exact products).
template <int SM>
inline void q4_scales16(const kvs_weight *w, int g, int b, int nb, __m512 *d, __m512 *m) {
    if (SM == 2) {
        const uint8_t *p = (const uint8_t *)w->d + ((size_t)g * (nb / 8) + b / 8) * KVS_KSUPER_BYTES;
        const __m512 ds = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 64 + (b % 8) * 16))));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 192 + (b % 8) * 16))));
        *d = _mm512_mul_ps(ds, sc);
        *m = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dm, mn)),
                                                  _mm512_set1_epi32((int)0x80000000u)));
        return;
    }
    const size_t at = ((size_t)g * nb + b) * 16;
    *d = scales16<SM == 1>(w->d, at);
    *m = scales16<SM == 1>(w->m, at);
}

}  // namespace
