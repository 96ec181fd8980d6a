// Longer than 420 lines on purpose: the whole layer stack runs inside one OpenMP parallel region,
// its phases share the region's thread-local state; splitting it would split the region. The team
// size on a busy machine and the step's barrier (a late thread may leave the team) are kvserve_team.cpp's.
// The Llama layer stack in one call, for steps of a few tokens (single-stream decode, small batches);
// the Gemma 2/3 features ride on the same loop through the descriptors (sandwich norms, q/k norm,
// per-layer RoPE tables and sliding windows with their own KV pool, soft-capping, GeGLU).
//
// Why: a decode step of the 30-layer default model is ~300 small operations when driven from Python
// (norms, RoPE, KV write, attention, four projections, SwiGLU, residual adds per layer), and at
// batch 1 their dispatch cost rivalled the matmuls. Here the whole stack runs inside one OpenMP
// parallel region on the caller's (torch's) thread team, phases separated by barriers:
//
//   per layer:  RMSNorm + quantize x        (tokens over threads)
//               QKV = W_qkv x (+ bias)      (rows over threads, int8 kernels of kvserve_kernels.cpp)
//               RoPE on q, k; write k, v to their KV-cache slots
//               attention per (token, kv head) through the block tables (kvserve_attention.cpp)
//               quantize; x += W_o attn
//               RMSNorm + quantize; [gate|up] = W_gu h; quantize silu(gate) * up; x += W_down act
//   then the final RMSNorm into `out`.
//
// Numerics match the per-layer PyTorch path of the same weights: the same int8 activation
// quantization and tiles, RoPE from the model's own cos/sin tables (every rope scaling), and K/V
// rounded to the cache dtype (int8 rows: quantized with their own scale) before attention reads them back.

#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <x86intrin.h>

#include <atomic>
#include <vector>

#include "kvserve_kernels.h"
#include "kvserve_team.h"

extern "C" {

struct kvs_layer_desc {
    const float *attn_norm;
    const float *ffn_norm;
    const kvs_weight *qkv;      // [Hq*D + 2*Hkv*D, H], optional bias
    const kvs_weight *o;        // [H, Hq*D]
    const kvs_weight *gate_up;  // [2*I, H]: gate rows then up rows
    const kvs_weight *down;     // [H, I]
    void *kv_cache;             // [2, num_blocks, block_size, Hkv, kv_row(D)], dtype per kvs_forward's kv_dtype
    int32_t aux_slot;           // >= 0: the residual stream after this layer goes to aux, normalised (below)
    // The family features (null / 0 for the Llama shape):
    const float *attn_out_norm; // Gemma's sandwich norms: the attention output and the MLP output are
    const float *ffn_out_norm;  //   RMS-normalised with these before their residual add
    const float *q_norm;        // [D]: RMSNorm of every q head and every k head before RoPE (Gemma 3, Qwen3)
    const float *k_norm;
    const float *cos, *sin;     // this layer's RoPE tables (Gemma 3's local base); null: the model's
    int32_t window;             // > 0: a query sees its last `window` positions (sliding layer)
    int32_t local;              // 1: K/V in the step's local pool (kvs_model_desc.local), not kvs_forward's
};

// The sliding layers' own KV pool in this step (engine/kv_hybrid.py): their slots, block tables
// (rows of max_blocks, entries behind the window may be -1 and are never read) and pool size.
struct kvs_pool {
    const int64_t *slots;
    const int64_t *tables;
    int32_t max_blocks;
    int32_t num_blocks;
};

// LoRA in the whole-stack forward: one term per (layer, projection, adapter slot), at index
// (layer * 4 + projection) * n_slots + slot, projections in the order qkv, o, gate_up, down. A term
// with r == 0 is "no adapter here". A [r, in] and B^T [r, out] are fp32 (B already scaled); a token
// whose row_slot is >= 0 gets y += B (A x) on that projection, x its fp32 input row, in a fixed
// order (16 lanes over the input, then B's columns one by one): the row's numbers do not depend
// on what else is in the step.
struct kvs_lora_term {
    const float *A;
    const float *B;
    int32_t r;
};

struct kvs_model_desc {
    int32_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter;
    float eps, scale;
    const float *cos;  // [max_positions, head_dim], rotate-half layout
    const float *sin;
    const float *final_norm;
    const kvs_layer_desc *layers;
    int32_t attn_isa;  // prompt tiles' attention: 1 = AVX-512 build, 0 = AVX2 (the same bits)
    float softcap;     // > 0: attention scores -> softcap * tanh(score / softcap) (Gemma 2; AVX2 code)
    int32_t act;       // the gated MLP: 0 = SwiGLU (silu), 1 = GeGLU (gelu tanh, Gemma)
    const kvs_pool *local;   // the local layers' pool for this step (set per step; null: none)
};

}  // extern "C"

namespace {

// Rotate one head in place: HF's rotate-half layout, x' = x * cos + rotate_half(x) * sin.
inline void rope_head(float *x, const float *cos, const float *sin, int D) {
    const int half = D / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

// Write n floats to the cache in its dtype (0 float32, 1 bfloat16, 2 float16), rounding to nearest
// even as the PyTorch path's .to() does.
inline void store_kv(void *dst, int kv_dtype, const float *src, int n) {
    if (kv_dtype == 1) {
        uint16_t *d = (uint16_t *)dst;
        for (int i = 0; i < n; i++) d[i] = kvs::f32_to_bf16(src[i]);
    } else if (kv_dtype == 2) {
        uint16_t *d = (uint16_t *)dst;
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++) d[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
}

// One head's D floats -> an int8 row and its fp16 scale (model/kv_quant.py's quantize_rows, bit for
// bit: scale = f16(max|x| / 127), q = clamp(round_half_even(x / scale), -127, 127)).
inline void store_row_q8(int8_t *dst, const float *src, int D) {
    float amax = 0.0f;
    for (int i = 0; i < D; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
    const uint16_t h = _cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
    const float scale = _cvtsh_ss(h);
    for (int i = 0; i < D; i++) {
        float q = scale > 0.0f ? nearbyintf(src[i] / scale) : 0.0f;
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        dst[i] = (int8_t)q;
    }
    memcpy(dst + D, &h, 2);
}

// One token's qkv row of layer L: q/k RMSNorm per head (if the layer has it), RoPE on its q and k
// heads in place, then k and v into the cache at `slot`.
void rope_and_store(const kvs_model_desc *m, const kvs_layer_desc &L, float *r, int64_t position, int64_t slot,
                    char *Kc, char *Vc, int kv_dtype, int block_size) {
    const int Hq = m->n_heads, Hkv = m->n_kv_heads, D = m->head_dim, qd = Hq * D, kvd = Hkv * D;
    const float *c = (L.cos ? L.cos : m->cos) + (size_t)position * D, *s = (L.sin ? L.sin : m->sin) + (size_t)position * D;
    if (L.q_norm)   // in place: rms_norm_row reads the row's sum of squares before it writes
        for (int h = 0; h < Hq + Hkv; h++)
            kvs::rms_norm_row(r + (size_t)h * D, h < Hq ? L.q_norm : L.k_norm, D, m->eps, r + (size_t)h * D);
    for (int h = 0; h < Hq + Hkv; h++) rope_head(r + (size_t)h * D, c, s, D);
    const size_t esize = kvs::kv_esize(kv_dtype), tok = (size_t)Hkv * kvs::kv_row(D, kv_dtype);
    const size_t off = ((size_t)slot / block_size) * block_size * tok + ((size_t)slot % block_size) * tok;
    if (kv_dtype == kvs::KV_INT8) {
        for (int h = 0; h < Hkv; h++) {
            store_row_q8((int8_t *)Kc + off + (size_t)h * (D + 2), r + qd + (size_t)h * D, D);
            store_row_q8((int8_t *)Vc + off + (size_t)h * (D + 2), r + qd + kvd + (size_t)h * D, D);
        }
        return;
    }
    store_kv(Kc + off * esize, kv_dtype, r + qd, kvd);
    store_kv(Vc + off * esize, kv_dtype, r + qd + kvd, kvd);
}

// A tag per call of the attention (attend_tile's reuse of widened keys never crosses calls).
uint64_t next_call() {
    static std::atomic<uint64_t> n{0};
    return ++n;
}

// Attention tiles of a step: runs of up to 16 consecutive query tokens of one sequence (a prompt
// chunk) that share one float32 copy of their keys and values per KV head (kvs::attend_tile); a
// decode is a tile of 1. A run of at most kSmallTile tokens (a speculating request's verified rows,
// a short prompt) would go query by query inside its tile anyway, so each of its tokens is a tile
// of its own: its (token, KV head) items then spread over the team instead of one item per head
// doing all the run's queries (the same arithmetic, so the same bits). Tokens with attend[t] == 0
// (if attend is given) are left out. Returns the tile starts followed by T.
std::vector<int> attention_tiles(int T, const uint8_t *attend, const int64_t *seq_of, const int64_t *positions) {
    std::vector<int> start;
    for (int t = 0; t < T;) {
        if (attend && !attend[t]) {
            t++;
            continue;
        }
        int e = t + 1;   // the run [t, e)
        while (e < T && (!attend || attend[e]) && seq_of[e - 1] == seq_of[e] && positions[e - 1] + 1 == positions[e])
            e++;
        const int step = e - t <= kvs::kSmallTile ? 1 : 16;
        for (int s = t; s < e; s += step) start.push_back(s);
        t = e;
    }
    start.push_back(T);
    return start;
}

// This thread's share of the step's attention (call inside a parallel region, after K/V are
// written; the caller puts a barrier after it): work items are (tile, KV head), longest tiles first,
// handed out dynamically from `next` (zero before the phase; shared by the `nth` threads at work).
void attend_tiles(const kvs_model_desc *m, const kvs_layer_desc &Ld, const float *qkv, const std::vector<int> &tiles,
                  const uint8_t *attend, const int64_t *positions, const int64_t *seq_of, const int64_t *tables,
                  int max_blocks, const char *Kc, const char *Vc, int kv_dtype, int block_size, float *out,
                  uint64_t call, int nth, std::atomic<int> *next) {
    // A sliding layer's query whose window starts past key 0 attends alone from the window's start
    // (the tile code reads every key from 0); soft-capping runs the AVX2 code (the same bits).
    const int W = Ld.window;
    const float cap = m->softcap;
    const int isa = cap > 0.0f ? 0 : m->attn_isa;
    const int Hq = m->n_heads, Hkv = m->n_kv_heads, D = m->head_dim;
    const int qd = Hq * D, kvd = Hkv * D, qkv_rows = qd + 2 * kvd, group = Hq / Hkv, row = kvs::kv_row(D, kv_dtype);
    const size_t tok_stride = (size_t)Hkv * row, block_stride = (size_t)block_size * tok_stride;
    const int ntiles = (int)tiles.size() - 1;
    thread_local std::vector<float> scores;   // kept between calls: no allocation per layer
    // With enough tiles for the team, a lone query's item (h = 0) takes all its KV heads at once
    // (attend_heads: contiguous cache reads; the same arithmetic) and its other items are empty;
    // except a lone query with more than a thread's share of all the lone queries' context (a long
    // prompt's token beside short decodes: bound by reading its whole cache), whose heads stay
    // separate items so that they run on several threads.
    const bool all_heads = ntiles >= 2 * nth;
    thread_local std::vector<uint8_t> whole;
    whole.assign(ntiles, all_heads ? 1 : 0);
    if (all_heads) {
        int64_t lone = 0;
        for (int i = 0; i < ntiles; i++)
            if (tiles[i + 1] - tiles[i] == 1) lone += positions[tiles[i]] + 1;
        for (int i = 0; i < ntiles; i++)
            if (tiles[i + 1] - tiles[i] == 1 && (positions[tiles[i]] + 1) * nth > lone) whole[i] = 0;
    }
    // Items head by head, each head's tiles deepest first: a thread that takes several tiles of one
    // prompt chunk and head widens the chunk's keys once (attend_tile's reuse), not once per tile.
    // No barrier at the end: the caller places (and times) it.
    for (int it; (it = next->fetch_add(1, std::memory_order_relaxed)) < ntiles * Hkv;) {
        const int tile = ntiles - 1 - it % ntiles, h = it / ntiles;
        const int t0 = tiles[tile];
        int n = 1;
        while (t0 + n < tiles[tile + 1] && (!attend || attend[t0 + n])) n++;
        const int L0 = (int)positions[t0] + 1;
        const float *q = qkv + (size_t)t0 * qkv_rows + (size_t)h * group * D;
        float *o = out + (size_t)t0 * qd + (size_t)h * group * D;
        const int64_t *table = tables + (size_t)seq_of[t0] * max_blocks;
        if (n == 1) {
            if (whole[tile] && h > 0) continue;
            scores.resize((size_t)L0 * group);
            kvs::attend_heads(q, Kc, Vc, kv_dtype, block_stride, tok_stride, h * row, row, whole[tile] ? Hkv : 1, table,
                              block_size, L0, D, group, m->scale, scores.data(), o, isa, cap, W > 0 ? L0 - W : 0);
        } else if (W > 0 && L0 + n - 1 > W) {
            scores.resize((size_t)(L0 + n) * group);
            for (int i = 0; i < n; i++)
                kvs::attend_heads(q + (size_t)i * qkv_rows, Kc, Vc, kv_dtype, block_stride, tok_stride, h * row, row, 1,
                                  table, block_size, L0 + i, D, group, m->scale, scores.data(), o + (size_t)i * qd, isa,
                                  cap, L0 + i - W);
        } else {
            kvs::attend_tile(q, qkv_rows, Kc, Vc, kv_dtype, block_stride, tok_stride, h * row, table, block_size, L0, n,
                             D, group, m->scale, o, qd, isa, call, cap);
        }
    }
}

}  // namespace


// The forward's barrier (kvs::step_team): its wait goes to `waited` (TSC ticks); then this thread's
// share of the next phase, (ith, nt), or none at all once it has left the step's team (ith past any
// token count, `left` set: the loops over tokens run empty and every other piece of work is skipped).
#define KVS_TIMED_BARRIER()                   \
    do {                                      \
        if (team.wait(me, &waited)) {         \
            ith = team.rank_of(me);           \
            nt = team.size_now();             \
        } else {                              \
            ith = 1 << 30;                    \
            left = true;                      \
        }                                     \
    } while (0)

// The forward's phase profile: thread 0's TSC ticks from the end of one phase (a barrier) to the
// end of the next, summed per kind over every layer and call (kvs_forward_profile reads it). A
// phase's wall time on the step's critical path: its slowest thread plus the barrier.
enum { kPhNorm, kPhQkv, kPhRope, kPhAttn, kPhQuant, kPhO, kPhFfnNorm, kPhGateUp, kPhAct, kPhDown, kPhFinal, kPhases };
uint64_t g_phase[kPhases];
#define KVS_PHASE(k)                                  \
    do {                                              \
        if (ith == 0) {                               \
            const uint64_t n_ = __rdtsc();            \
            g_phase[k] += n_ - ph_last;               \
            ph_last = n_;                             \
        }                                             \
    } while (0)

extern "C" {

// out[kPhases] = the phase profile (TSC ticks, see g_phase); reset: zero it afterwards.
int kvs_forward_profile(double *out, int reset) {
    for (int k = 0; k < kPhases; k++) {
        out[k] = (double)g_phase[k];
        if (reset) g_phase[k] = 0;
    }
    return kPhases;
}

}  // extern "C"

extern "C" {

// x [T, hidden] (the embedded tokens) is updated in place through every layer; out [T, hidden]
// receives the final-normed hidden states. Token t sits at positions[t] of sequence seq_of[t]
// (a row of tables) and its K/V go to flat slot slots[t]. Returns 0, or -1 on bad shapes.
// aux [T, n_aux, hidden] (or null): after a layer whose aux_slot is in [0, n_aux), each token's
// residual stream, RMS-normalised without a weight (eps FLT_EPSILON), goes to its slot (an EAGLE-3
// draft reads inner layers' features; normalising here spares the engine a chain of small torch ops
// a step, ~0.08 ms on a 3 ms step).
int kvs_forward_lora(const kvs_model_desc *m, int kv_dtype, int num_blocks, int block_size, float *x, int T,
                     const int64_t *positions, const int64_t *slots, const int64_t *seq_of, const int64_t *tables,
                     int max_blocks, float *out, int nth, const kvs_lora_term *lora, int n_slots,
                     const int32_t *row_slot, float *aux, int n_aux);

}  // extern "C"

namespace {

// An EAGLE draft step around the layer stack (kvs_draft_step): the stack's input is fc applied to
// [feature ; embedding of the token], and after the final norm the chosen rows go through the
// draft's head to their argmax.
struct draft_io {
    const float *feats;       // [T, F]
    int F;
    const int64_t *tok;       // [T] token ids, rows of `embed`
    const kvs_weight *embed;  // the target's (packed) embedding rows, [vocab, H]
    const kvs_weight *fc;     // [H, F + H]
    const kvs_weight *head;   // [V, H]
    const int64_t *last;      // [n_last] rows of the step whose draft token is wanted
    int n_last;
    float *hidden;            // [n_last, H]: those rows after the final norm
    float *logits;            // [n_last, V] scratch
    int64_t *arg;             // [n_last]: argmax over the head's rows (the first of equal maxima)
};

int forward_impl(const kvs_model_desc *m, int kv_dtype, int num_blocks, int block_size, float *x, int T,
                 const int64_t *positions, const int64_t *slots, const int64_t *seq_of, const int64_t *tables,
                 int max_blocks, float *out, int nth, const kvs_lora_term *lora, int n_slots,
                 const int32_t *row_slot, float *aux, int n_aux, const draft_io *io);

}  // namespace

extern "C" {

int kvs_forward(const kvs_model_desc *m, int kv_dtype, int num_blocks, int block_size, float *x, int T,
                const int64_t *positions, const int64_t *slots, const int64_t *seq_of, const int64_t *tables,
                int max_blocks, float *out, int nth) {
    return kvs_forward_lora(m, kv_dtype, num_blocks, block_size, x, T, positions, slots, seq_of, tables, max_blocks,
                            out, nth, nullptr, 0, nullptr, nullptr, 0);
}

int kvs_forward_lora(const kvs_model_desc *m, int kv_dtype, int num_blocks, int block_size, float *x, int T,
                     const int64_t *positions, const int64_t *slots, const int64_t *seq_of, const int64_t *tables,
                     int max_blocks, float *out, int nth, const kvs_lora_term *lora, int n_slots,
                     const int32_t *row_slot, float *aux, int n_aux) {
    return forward_impl(m, kv_dtype, num_blocks, block_size, x, T, positions, slots, seq_of, tables, max_blocks, out,
                        nth, lora, n_slots, row_slot, aux, n_aux, nullptr);
}

// One step of an EAGLE draft (spec_decode/eagle.py) in one call, with the numbers of its PyTorch
// pieces (the packed fc, the model forward, the packed head, argmax): each row's input is
// fc([feats[t] ; embed row tok[t]]), the layer stack runs as in kvs_forward over x [T, H] (scratch,
// overwritten), and for the rows `last` the final-normed state goes to hidden [n_last, H] and the
// argmax of the head's logits to arg [n_last]. The Python glue it replaces (metadata, the
// embedding lookup, the concatenation, two more calls and the argmax) took ~0.2 ms a draft step,
// as long as the draft's weights take to read. Returns 0, -1 on bad shapes, -2 on a token id
// outside the embedding.
int kvs_draft_step(const kvs_model_desc *m, int kv_dtype, int num_blocks, int block_size, const float *feats, int F,
                   const int64_t *tok, const kvs_weight *embed, const kvs_weight *fc, const kvs_weight *head, int T,
                   const int64_t *positions, const int64_t *slots, const int64_t *seq_of, const int64_t *tables,
                   int max_blocks, const int64_t *last, int n_last, float *x, float *out, float *hidden,
                   float *logits, int64_t *arg, int nth) {
    const int H = m->hidden;
    if (F % kvs::QK || fc->cols != F + H || fc->rows != H || embed->cols != H || head->cols != H || n_last <= 0 ||
        n_last > T)
        return -1;
    for (int t = 0; t < T; t++)
        if (tok[t] < 0 || tok[t] >= embed->rows) return -2;
    for (int j = 0; j < n_last; j++)
        if (last[j] < 0 || last[j] >= T) return -1;
    const draft_io io{feats, F, tok, embed, fc, head, last, n_last, hidden, logits, arg};
    return forward_impl(m, kv_dtype, num_blocks, block_size, x, T, positions, slots, seq_of, tables, max_blocks, out,
                        nth, nullptr, 0, nullptr, nullptr, 0, &io);
}

}  // extern "C"

namespace {

// Steps of at least this many tokens hand out their projections' rows in chunks (forward_impl's
// `linear`); below, each thread takes a static share (decode: contiguous rows for the prefetchers).
constexpr int kDynamicTokens = 32;

// Chunks for W's rows at T tokens: about 4 M multiply-adds each (a fraction of a millisecond on one
// core; a thread that loses its core mid-chunk holds the phase's end that long at most), whole
// groups of 16 rows. 0 = a kvs_set_dynamic_rows(0) build of the static split.
std::atomic<int> g_dynamic_rows{1};
int linear_chunks(const kvs_weight *W, int T) {
    if (!g_dynamic_rows.load(std::memory_order_relaxed)) return 0;
    const int groups = (W->rows + 15) / 16;
    const long per_group = 16L * W->cols * T;
    const long want = (4L << 20) / (per_group > 0 ? per_group : 1);
    const int size = want < 1 ? 1 : (int)want;
    return (groups + size - 1) / size;
}

}  // namespace

extern "C" {

// 1 (default): prompt steps hand out projection rows in chunks; 0: static shares (A/B benches).
void kvs_set_dynamic_rows(int on) { g_dynamic_rows.store(on ? 1 : 0); }

}  // extern "C"

namespace {

int forward_impl(const kvs_model_desc *m, int kv_dtype, int num_blocks, int block_size, float *x, int T,
                 const int64_t *positions, const int64_t *slots, const int64_t *seq_of, const int64_t *tables,
                 int max_blocks, float *out, int nth, const kvs_lora_term *lora, int n_slots,
                 const int32_t *row_slot, float *aux, int n_aux, const draft_io *io) {
    const int H = m->hidden, Hq = m->n_heads, Hkv = m->n_kv_heads, D = m->head_dim, I = m->inter;
    if (T <= 0 || Hkv <= 0 || Hq % Hkv || D % 2 || H % kvs::QK || I % kvs::QK || (Hq * D) % kvs::QK) return -1;
    const int qd = Hq * D, kvd = Hkv * D, qkv_rows = qd + 2 * kvd;
    int kmax = H > I ? (H > qd ? H : qd) : (I > qd ? I : qd);
    if (io && io->F + H > kmax) kmax = io->F + H;

    std::vector<int8_t> xq((size_t)T * kmax);
    const std::vector<float> unit(aux ? H : 0, 1.0f);   // the aux rows' norm weight
    std::vector<float> xd((size_t)T * (kmax / kvs::QK)), xs((size_t)T * (kmax / kvs::QK));
    std::vector<float> qkv((size_t)T * qkv_rows), attn((size_t)T * qd), gu((size_t)T * 2 * I);
    bool sandwich = false;   // Gemma: projections' outputs are normalised before the residual add
    for (int l = 0; l < m->n_layers; l++) {
        const kvs_layer_desc &L = m->layers[l];
        sandwich = sandwich || L.attn_out_norm || L.ffn_out_norm;
        if (L.local && !m->local) return -1;
    }
    std::vector<float> proj(sandwich ? (size_t)T * H : 0);
    // LoRA: each adapted token's fp32 projection input (the int8 path keeps only its quantization)
    std::vector<float> xf(lora ? (size_t)T * kmax : 0);
    const size_t tok_stride = (size_t)Hkv * kvs::kv_row(D, kv_dtype), block_stride = (size_t)block_size * tok_stride;
    const size_t esize = kvs::kv_esize(kv_dtype);
    const std::vector<int> tiles = attention_tiles(T, nullptr, seq_of, positions);
    const uint64_t call = next_call();   // one per forward: each layer's cache is its own tag too
    if (nth < 1) nth = 1;
    bool probe = false;
    const int asked = nth;
    nth = kvs::team_begin(asked, &probe);
    std::vector<uint64_t> waits(nth, 0);
    std::vector<std::atomic<int>> attn_next(m->n_layers);   // each layer's attention items handed out
    for (auto &a : attn_next) a.store(0, std::memory_order_relaxed);
    std::vector<std::atomic<int>> lin_next((size_t)m->n_layers * 4 + 2);   // each projection's row chunks
    for (auto &a : lin_next) a.store(0, std::memory_order_relaxed);
    kvs::step_team team(nth);
    const uint64_t t_start = __rdtsc();

#pragma omp parallel num_threads(nth)
    {
        const int me = omp_get_thread_num();
        int ith = me, nt = omp_get_num_threads();
        bool left = false;      // this thread has left the step's team (kvs::step_team)
        if (nt != nth) {        // OpenMP gave fewer threads than asked for: the team is those
#pragma omp single
            team.limit(nt);
        }
        uint64_t waited = 0, ph_last = __rdtsc();
        std::vector<float> row((size_t)(H > I ? H : I) + (io ? io->F + H : 0));
        // Quantize this thread's tokens of src [T, K] (row stride K) into xq/xd/xs.
        std::vector<float> lr(64);
        auto quantize = [&](const float *src, int K, bool norm, const float *w) {
            for (int t = ith; t < T; t += nt) {
                const float *r = src + (size_t)t * K;
                if (norm) {
                    kvs::rms_norm_row(r, w, K, m->eps, row.data());
                    r = row.data();
                }
                if (lora && row_slot[t] >= 0) memcpy(xf.data() + (size_t)t * kmax, r, K * sizeof(float));
                kvs::quantize_row_q8(r, K, xq.data() + (size_t)t * K, xd.data() + (size_t)t * (K / kvs::QK),
                                     xs.data() + (size_t)t * (K / kvs::QK));
            }
        };
        // y[t] += B (A x[t]) for this thread's adapted tokens (x: xf, or `src` rows of stride K)
        auto add_lora = [&](int l, int p, const float *src, int K, float *y, int ystride) {
            if (!lora) return;
            for (int t = ith; t < T; t += nt) {
                const int s = row_slot[t];
                if (s < 0) continue;
                const kvs_lora_term &term = lora[((size_t)l * 4 + p) * n_slots + s];
                if (term.r <= 0) continue;
                if ((int)lr.size() < term.r) lr.resize(term.r);
                const float *xin = src ? src + (size_t)t * K : xf.data() + (size_t)t * kmax;
                for (int j = 0; j < term.r; j++) {   // 16 fixed lanes over k (K % 32 == 0), then the lanes
                    const float *a = term.A + (size_t)j * K;
                    float acc[16] = {0.f};
                    for (int k = 0; k < K; k += 16)
                        for (int q = 0; q < 16; q++) acc[q] += a[k + q] * xin[k + q];
                    float sum = 0.f;
                    for (int q = 0; q < 16; q++) sum += acc[q];
                    lr[j] = sum;
                }
                float *yt = y + (size_t)t * ystride;
                for (int j = 0; j < term.r; j++) {   // B is passed transposed, [r, out]: vectors over outputs
                    const float *b = term.B + (size_t)j * ystride;
                    const float c = lr[j];
                    for (int o = 0; o < ystride; o++) yt[o] += b[o] * c;
                }
            }
        };
        if (io) {   // x = fc([feature ; embedding]), quantized as kvs_linear quantizes its input rows
            const int K = io->F + H;
            for (int t = ith; t < T; t += nt) {
                float *r = row.data();
                memcpy(r, io->feats + (size_t)t * io->F, io->F * sizeof(float));
                kvs_dequantize_rows(io->embed, io->tok + t, 1, r + io->F);
                kvs::quantize_row_q8(r, K, xq.data() + (size_t)t * K, xd.data() + (size_t)t * (K / kvs::QK),
                                     xs.data() + (size_t)t * (K / kvs::QK));
            }
            KVS_TIMED_BARRIER();
            if (!left) kvs::linear_rows(io->fc, xq.data(), xd.data(), xs.data(), T, x, H, false, ith, nt);
            KVS_TIMED_BARRIER();
        }
        // y (+)= W x for the T tokens, this thread's rows: a static share of them for a few tokens;
        // for a prompt, chunks of row groups handed out from the projection's own counter, so that a
        // thread sharing its core with another process does what its slices allow and the others do
        // the rest (kvs::linear_rows with (chunk, chunks) for (ith, nt): the same split function,
        // so the same arithmetic per row)
        int lin_seq = 0;
        auto linear = [&](const kvs_weight *W, float *y, int ldy, bool add) {
            std::atomic<int> &next = lin_next[lin_seq++ % lin_next.size()];
            if (left) return;
            const int chunks = nt > 1 && T >= kDynamicTokens ? linear_chunks(W, T) : 0;
            if (chunks <= nt) {
                kvs::linear_rows(W, xq.data(), xd.data(), xs.data(), T, y, ldy, add, ith, nt);
                return;
            }
            for (int c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;)
                kvs::linear_rows(W, xq.data(), xd.data(), xs.data(), T, y, ldy, add, c, chunks);
        };
        // y = W x then x += norm(y) (sandwich norm), or x += W x; `p` is the LoRA projection index
        auto project_residual = [&](int l, int p, const kvs_weight *W, const float *out_norm, const float *lsrc,
                                    int K) {
            float *y = out_norm ? proj.data() : x;
            linear(W, y, H, !out_norm);
            KVS_TIMED_BARRIER();
            add_lora(l, p, lsrc, K, y, H);
            if (out_norm) {   // this thread's tokens, as add_lora's
                for (int t = ith; t < T; t += nt) {
                    float *yt = proj.data() + (size_t)t * H, *xt = x + (size_t)t * H;
                    kvs::rms_norm_row(yt, out_norm, H, m->eps, yt);
                    for (int i = 0; i < H; i++) xt[i] += yt[i];
                }
            }
        };
        for (int l = 0; l < m->n_layers; l++) {
            const kvs_layer_desc &L = m->layers[l];
            const int64_t *l_slots = L.local ? m->local->slots : slots;
            const int64_t *l_tables = L.local ? m->local->tables : tables;
            const int l_max_blocks = L.local ? m->local->max_blocks : max_blocks;
            char *Kc = (char *)L.kv_cache;
            char *Vc = Kc + (size_t)(L.local ? m->local->num_blocks : num_blocks) * block_stride * esize;
            quantize(x, H, true, L.attn_norm);
            KVS_TIMED_BARRIER();
            KVS_PHASE(kPhNorm);
            linear(L.qkv, qkv.data(), qkv_rows, false);
            KVS_TIMED_BARRIER();
            KVS_PHASE(kPhQkv);
            add_lora(l, 0, nullptr, H, qkv.data(), qkv_rows);
            for (int t = ith; t < T; t += nt)
                rope_and_store(m, L, qkv.data() + (size_t)t * qkv_rows, positions[t], l_slots[t], Kc, Vc, kv_dtype,
                               block_size);
            KVS_TIMED_BARRIER();
            KVS_PHASE(kPhRope);
            if (!left)
                attend_tiles(m, L, qkv.data(), tiles, nullptr, positions, seq_of, l_tables, l_max_blocks, Kc, Vc,
                             kv_dtype, block_size, attn.data(), call, nt, &attn_next[l]);
            KVS_TIMED_BARRIER();
            KVS_PHASE(kPhAttn);
            quantize(attn.data(), qd, false, nullptr);
            KVS_TIMED_BARRIER();
            KVS_PHASE(kPhQuant);
            project_residual(l, 1, L.o, L.attn_out_norm, attn.data(), qd);
            KVS_PHASE(kPhO);
            quantize(x, H, true, L.ffn_norm);
            KVS_TIMED_BARRIER();
            KVS_PHASE(kPhFfnNorm);
            linear(L.gate_up, gu.data(), 2 * I, false);
            KVS_TIMED_BARRIER();
            KVS_PHASE(kPhGateUp);
            add_lora(l, 2, nullptr, H, gu.data(), 2 * I);
            for (int t = ith; t < T; t += nt) {
                const float *g = gu.data() + (size_t)t * 2 * I;
                if (m->act == 1) kvs::gelu_mul_row(g, g + I, I, row.data());
                else kvs::silu_mul_row(g, g + I, I, row.data());
                if (lora && row_slot[t] >= 0) memcpy(xf.data() + (size_t)t * kmax, row.data(), I * sizeof(float));
                kvs::quantize_row_q8(row.data(), I, xq.data() + (size_t)t * I, xd.data() + (size_t)t * (I / kvs::QK),
                                     xs.data() + (size_t)t * (I / kvs::QK));
            }
            KVS_TIMED_BARRIER();
            KVS_PHASE(kPhAct);
            project_residual(l, 3, L.down, L.ffn_out_norm, nullptr, I);
            if (lora || L.ffn_out_norm) KVS_TIMED_BARRIER();
            KVS_PHASE(kPhDown);
            if (aux && L.aux_slot >= 0 && L.aux_slot < n_aux)   // this thread's rows, as the next quantize
                for (int t = ith; t < T; t += nt)
                    kvs::rms_norm_row(x + (size_t)t * H, unit.data(), H, FLT_EPSILON,
                                      aux + ((size_t)t * n_aux + L.aux_slot) * H);
        }
        for (int t = ith; t < T; t += nt)
            if (m->final_norm)
                kvs::rms_norm_row(x + (size_t)t * H, m->final_norm, H, m->eps, out + (size_t)t * H);
            else
                memcpy(out + (size_t)t * H, x + (size_t)t * H, H * sizeof(float));
        KVS_PHASE(kPhFinal);
        if (io) {   // the head over the chosen rows, as kvs_linear would run it, then each row's argmax
            const int V = io->head->rows;
            KVS_TIMED_BARRIER();
            for (int j = ith; j < io->n_last; j += nt) {
                const float *r = out + (size_t)io->last[j] * H;
                memcpy(io->hidden + (size_t)j * H, r, H * sizeof(float));
                kvs::quantize_row_q8(r, H, xq.data() + (size_t)j * H, xd.data() + (size_t)j * (H / kvs::QK),
                                     xs.data() + (size_t)j * (H / kvs::QK));
            }
            KVS_TIMED_BARRIER();
            if (!left) kvs::linear_rows(io->head, xq.data(), xd.data(), xs.data(), io->n_last, io->logits, V, false, ith, nt);
            KVS_TIMED_BARRIER();
            for (int j = ith; j < io->n_last; j += nt) {
                const float *lg = io->logits + (size_t)j * V;
                int best = 0;
                for (int v = 1; v < V; v++)
                    if (lg[v] > lg[best]) best = v;
                io->arg[j] = best;
            }
        }
        waits[me] = waited;
    }
    const double wall = (double)(__rdtsc() - t_start);
    uint64_t most = 0;
    for (uint64_t w : waits) most = w > most ? w : most;
    kvs::team_end(asked, nth, team.size_now(), probe, wall > 0 ? most / wall : 0.0);
    return 0;
}

// gu [T, 2I] (gate | up) -> out [T, I] = act(gate) * up by Row (kvs::silu_mul_row or
// kvs::gelu_mul_row), tokens split over the team (one thread below 32768 values).
template <void (*Row)(const float *, const float *, int, float *)>
void glu_rows(const float *gu, int T, int I, float *out, int nth) {
    nth = kvs::team_for(nth);
    if ((size_t)T * I < 32768) nth = 1;
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * I;
        Row(g, g + I, I, out + (size_t)t * I);
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Pieces of a layer for the steps too large for kvs_forward (batched decode, prompt chunks), where
// the projections run elsewhere (oneDNN bf16/AMX, MKL fp32) and Python strings them together:
// everything between the QKV and output projections is one call, SwiGLU another.

extern "C" {

// qkv [T, (Hq + 2 Hkv) D] of layer `layer`: q/k norm and RoPE on q and k in place, k and v written
// to their cache slots, then attention for every token with attend[t] != 0 into out [T, Hq D] (rows
// of other tokens are left alone: the caller runs long prompt chunks through a GEMM-based attention
// instead). slots/tables/kv_cache/num_blocks: the layer's pool (a local layer's own, kv_hybrid.py).
void kvs_rope_kv_attention(const kvs_model_desc *m, int layer, float *qkv, int T, const int64_t *positions,
                           const int64_t *slots, const int64_t *seq_of, const int64_t *tables, int max_blocks,
                           void *kv_cache, int kv_dtype, int num_blocks, int block_size, const uint8_t *attend,
                           float *out, int nth) {
    const int Hq = m->n_heads, Hkv = m->n_kv_heads, D = m->head_dim;
    const int qd = Hq * D, kvd = Hkv * D, qkv_rows = qd + 2 * kvd;
    const size_t tok_stride = (size_t)Hkv * kvs::kv_row(D, kv_dtype), block_stride = (size_t)block_size * tok_stride;
    const size_t esize = kvs::kv_esize(kv_dtype);
    char *Kc = (char *)kv_cache;
    char *Vc = Kc + (size_t)num_blocks * block_stride * esize;
    const std::vector<int> tiles = attention_tiles(T, attend, seq_of, positions);
    const uint64_t call = next_call();
    nth = kvs::team_for(nth);
    std::atomic<int> next{0};
#pragma omp parallel num_threads(nth)
    {
        const int ith = omp_get_thread_num(), nt = omp_get_num_threads();
        for (int t = ith; t < T; t += nt)
            rope_and_store(m, m->layers[layer], qkv + (size_t)t * qkv_rows, positions[t], slots[t], Kc, Vc, kv_dtype,
                           block_size);
#pragma omp barrier
        attend_tiles(m, m->layers[layer], qkv, tiles, attend, positions, seq_of, tables, max_blocks, Kc, Vc, kv_dtype,
                     block_size, out, call, nt, &next);
    }
}

// gu [T, 2I] (gate | up) -> out [T, I] = silu(gate) * up
void kvs_silu_mul(const float *gu, int T, int I, float *out, int nth) {
    glu_rows<kvs::silu_mul_row>(gu, T, I, out, nth);
}

// gu [T, 2I] (gate | up) -> out [T, I] = gelu_tanh(gate) * up (Gemma's GeGLU, as kvs_forward's)
void kvs_gelu_mul(const float *gu, int T, int I, float *out, int nth) {
    glu_rows<kvs::gelu_mul_row>(gu, T, I, out, nth);
}

}  // extern "C"
