/* Batched multi-LoRA for the few tokens of a decode step, in one call per layer (Punica's
 * BGMV, Chen et al. 2023, on the CPU): every token t of adapter slot s = token_slots[t]
 *
 *     scratch[t, j] = A[s, j, :] . x[t, :]                     j < slot_rank[s]   (shrink)
 *     y[t, o]      += sum_j scratch[t, j] * Bt[s, j, o]        over s's parts      (expand)
 *
 * with no gather, no scatter and no per-adapter loop in Python: at 32 decode tokens the
 * torch formulations spend most of their time in op dispatch and OpenMP fork/join.
 *
 * A part (out_start, out_end, rank_start, rank_end) is a block of B that may be non-zero: a
 * fused layer's parts are stacked block-diagonally (`shared/lora/peft_loader.py`), and the
 * expand reads only those blocks. The expand is split among threads by 64-output chunks, the
 * shrink by (token, rank row); one parallel region, a barrier between the two phases. Each
 * output is summed over j in order: the result does not depend on the other tokens.
 */
#include <stdint.h>

#define CHUNK 64
#define LANES 16

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t k = 0;
    for (; k + LANES <= n; k += LANES)
        for (int l = 0; l < LANES; ++l)
            acc[l] += a[k + l] * b[k + l];
    float tail = 0.0f;
    for (; k < n; ++k)
        tail += a[k] * b[k];
    float s = 0.0f;
    for (int l = 0; l < LANES; ++l)
        s += acc[l];
    return s + tail;
}

int lora_cpu_chunk(void) { return CHUNK; }

/* x [T, in] (row stride x_stride), y [T, out] (row stride y_stride), lora_a [S, R, in] and
 * lora_bt [S, R, out] contiguous, token_slots [T] (-1: a base-model token), slot_rank [S]
 * (rank rows in use), parts [S, max_parts, 4], num_parts [S], scratch [T, R]. */
int lora_bgmv_add(const float *x, int64_t x_stride, float *y, int64_t y_stride,
                  int64_t num_tokens, int64_t in_features, int64_t out_features,
                  const float *lora_a, const float *lora_bt, int64_t max_rank,
                  const int64_t *token_slots, const int64_t *slot_rank,
                  const int64_t *parts, const int64_t *num_parts, int64_t max_parts,
                  float *scratch, int num_threads) {
    const int64_t num_chunks = (out_features + CHUNK - 1) / CHUNK;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_tokens * max_rank; ++i) {
            const int64_t t = i / max_rank, j = i % max_rank;
            const int64_t s = token_slots[t];
            if (s < 0 || j >= slot_rank[s])
                continue;
            scratch[i] = dot(lora_a + (s * max_rank + j) * in_features, x + t * x_stride,
                             in_features);
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < num_chunks; ++c) {
            const int64_t o0 = c * CHUNK;
            const int64_t o1 = o0 + CHUNK < out_features ? o0 + CHUNK : out_features;
            for (int64_t t = 0; t < num_tokens; ++t) {
                const int64_t s = token_slots[t];
                if (s < 0)
                    continue;
                float *yt = y + t * y_stride;
                const float *st = scratch + t * max_rank;
                for (int64_t p = 0; p < num_parts[s]; ++p) {
                    const int64_t *part = parts + (s * max_parts + p) * 4;
                    const int64_t lo = part[0] > o0 ? part[0] : o0;
                    const int64_t hi = part[1] < o1 ? part[1] : o1;
                    if (lo >= hi)
                        continue;
                    for (int64_t j = part[2]; j < part[3]; ++j) {
                        const float v = st[j];
                        const float *b = lora_bt + (s * max_rank + j) * out_features;
                        for (int64_t o = lo; o < hi; ++o)
                            yt[o] += v * b[o];
                    }
                }
            }
        }
    }
    return 0;
}
