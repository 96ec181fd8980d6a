// Q4_0 / Q4_1 rows into the kernels' Q4 layout (kvserve_kernels.cpp draws it), fast: the first
// load of a never-seen file repacks every projection before the first token.
//
//   kvs_repack_q4   the bytes kvs_repack writes for ggml types 2 (Q4_0) and 3 (Q4_1), same
//                   return codes, but 4-byte runs and all threads
//
// Why 4-byte runs: GGUF's Q4 block stores value t in the low nibble of byte t and value t + 16 in
// its high nibble (t < 16); the kernels' byte j of chunk i of a row holds q[4i + j] low and
// q[16 + 4i + j] high: the same byte. So chunk i of a row is bytes 4i..4i+3 of the block,
// unchanged. Row groups are independent, so threads split them; the bytes do not depend on it.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define KVS_NO_INLINE_HELPERS
#include "kvserve_kernels.h"

extern "C" {

int kvs_repack_q4(int ggml_type, const uint8_t *raw, int rows, int cols, uint8_t *qs, void *d, void *m, int sdtype) {
    if (ggml_type != 2 && ggml_type != 3) return -1;
    const int nb = cols / 32, groups = (rows + 15) / 16, full = rows / 16;
    const size_t esize = sdtype ? 2 : 4, bsz = ggml_type == 2 ? 18 : 20, qoff = ggml_type == 2 ? 2 : 4;
    if (groups > full) {     // the last group's padding rows are zero
        memset(qs + (size_t)full * nb * 256, 0, (size_t)nb * 256);
        memset((uint8_t *)d + (size_t)full * nb * 16 * esize, 0, (size_t)nb * 16 * esize);
        memset((uint8_t *)m + (size_t)full * nb * 16 * esize, 0, (size_t)nb * 16 * esize);
    }
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 4) reduction(| : bad)
    for (int g = 0; g < groups; g++) {
        const int nr = g < full ? 16 : rows - g * 16;
        for (int b = 0; b < nb; b++) {
            const size_t at = ((size_t)g * nb + b) * 16;
            uint8_t *dst = qs + at * 16;
            for (int rr = 0; rr < nr; rr++) {
                const uint8_t *p = raw + ((size_t)(g * 16 + rr) * nb + b) * bsz;
                uint16_t hd, hm;
                memcpy(&hd, p, 2);
                const float df = _cvtsh_ss(hd);
                float mf;
                if (ggml_type == 3) {
                    memcpy(&hm, p + 2, 2);
                    mf = _cvtsh_ss(hm);
                } else {
                    mf = -8.0f * df;
                    hm = _cvtss_sh(mf, _MM_FROUND_TO_NEAREST_INT);
                    if (sdtype && _cvtsh_ss(hm) != mf) bad = 1;
                }
                if (sdtype) {
                    ((uint16_t *)d)[at + rr] = hd;
                    ((uint16_t *)m)[at + rr] = hm;
                } else {
                    ((float *)d)[at + rr] = df;
                    ((float *)m)[at + rr] = mf;
                }
                for (int i = 0; i < 4; i++) memcpy(dst + i * 64 + rr * 4, p + qoff + 4 * i, 4);
            }
        }
    }
    return bad ? 1 : 0;
}

}  // extern "C"
