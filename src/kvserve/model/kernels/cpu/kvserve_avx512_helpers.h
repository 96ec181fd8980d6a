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

}  // namespace
