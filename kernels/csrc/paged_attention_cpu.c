/*
 * Paged attention for CPU, fp32, one query row at a time (PagedAttention, Kwon et al. 2023).
 *
 * Row r is query row token_ids[r] of request req_ids[r]; it attends to that request's first
 * context_lens[r] keys, read block by block through block_table (a decode row has
 * context_len = seq_len; the j-th of q_len chunked-prefill rows has seq_len - q_len + j + 1).
 * With sliding_window W > 0 it attends only to the last W of them (Mistral, Gemma local
 * layers); blocks before the window are never read (they may be freed: the null block).
 * With soft_cap c > 0 each scaled score s becomes c * tanh(s / c) (Gemma 2).
 *
 * kernels/cpu_native.py compiles this file at first use with HEAD_DIM, NUM_KV_HEADS and
 * GROUP_SIZE defined, so every inner loop has a constant trip count and vectorizes fully.
 * Per row (rows are spread over OpenMP threads):
 *   1. scores[hq][t] = <scale * q[hq], k[t][hq / GROUP_SIZE]>, every head of a token at once,
 *      so each token's K row is read from memory once;
 *   2. exact softmax per head (max subtracted, two passes over the row's scores);
 *   3. out[hq] = sum_t p[hq][t] * v[t][hq / GROUP_SIZE], one kv head at a time so the group's
 *      accumulators stay in registers.
 * A decode row (the only row of its request) prefetches its next block into L2 while the
 * current one is processed, and its first V block at the end of its K pass.
 *
 * Built with -DKV_BF16 the cache, the query and the output are bf16 (the upper 16 bits of an
 * fp32, widened exactly); the scores, the softmax and the sums stay fp32 and each output is
 * rounded to bf16 once (nearest even). With AVX512-BF16 the scores are VDPBF16PS dot
 * products of the bf16 query and keys (exact products, fp32 sums), scaled after. Entry
 * point: paged_attention_rows_bf16 (else paged_attention_rows_f32).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define NUM_HEADS (NUM_KV_HEADS * GROUP_SIZE)
#define TOKEN_STRIDE (NUM_KV_HEADS * HEAD_DIM) /* elements per cache row (one token) */
#define FLOATS_PER_LINE 16

#ifdef KV_BF16
typedef uint16_t kv_t;
#define ENTRY paged_attention_rows_bf16
static inline float kv_to_f(uint16_t v) {
    union { uint32_t u; float f; } x = { (uint32_t)v << 16 };
    return x.f;
}
static inline uint16_t f_to_out(float f) { /* round to nearest even, as torch's .bfloat16() */
    union { float f; uint32_t u; } x = { f };
    if (f != f) return 0x7FC0;
    return (uint16_t)((x.u + 0x7FFFu + ((x.u >> 16) & 1u)) >> 16);
}
#else
typedef float kv_t;
#define ENTRY paged_attention_rows_f32
#define kv_to_f(v) (v)
#define f_to_out(v) (v)
#endif
typedef kv_t q_t; /* the query and the output are in the cache's dtype */
#define KV_PER_LINE (64 / (int)sizeof(kv_t))

/* Into L2 (prefetcht1): into L1 it was slower than none (batch 64 x 400 keys, 30 layers:
 * 54 ms with T0, 56 none, 35 with T1 and the first V block fetched at the end of the K pass). */
static void prefetch_block(const kv_t* block, int num_tokens) {
    for (int i = 0; i < num_tokens * TOKEN_STRIDE; i += KV_PER_LINE) {
        __builtin_prefetch(block + i, 0, 2);
    }
}

#if defined(KV_BF16) && defined(__AVX512F__) && HEAD_DIM % 16 == 0
/* bf16 KV on AVX-512: the same three steps with explicit vectors. A K row is widened once per
 * kv head and dotted with its group's queries into 16-lane partial sums; the partial sums of
 * 16 tokens are then reduced together by a transpose-add (45 vector ops for 16 scores, where
 * one horizontal sum per score takes about 8). A V row is widened once per kv head and
 * added into the group's accumulators, held in registers. */
#include <immintrin.h>
#define DV (HEAD_DIM / 16)

static inline __m512 load_kv16(const kv_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* Lane i of the result = the sum of the 16 lanes of v[i]. */
static inline __m512 transpose_sum16(const __m512* v) {
    __m512 s[8], t[4];
    for (int j = 0; j < 8; ++j)
        s[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; ++j) {
        const __m512d a = _mm512_castps_pd(s[2 * j]), b = _mm512_castps_pd(s[2 * j + 1]);
        t[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(t[2], t[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
}

#if defined(__AVX512BF16__) && HEAD_DIM % 32 == 0
/* VDPBF16PS: a K row (32 bf16 per vector, no widening) against the group's bf16 queries. */
#define DQ (HEAD_DIM / 32)
static void score_block(const kv_t* restrict k_block, const float* restrict q_scaled,
                        const q_t* restrict q_raw, float scale, float* restrict scores,
                        int64_t stride, int t0, int n) {
    (void)q_scaled;
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int c = 0; c < n; c += 16) {
        const int m = n - c < 16 ? n - c : 16;
        for (int h = 0; h < NUM_KV_HEADS; ++h) {
            __m512i qv[GROUP_SIZE][DQ];
            for (int g = 0; g < GROUP_SIZE; ++g)
                for (int i = 0; i < DQ; ++i)
                    qv[g][i] = _mm512_loadu_si512(q_raw + (h * GROUP_SIZE + g) * HEAD_DIM + 32 * i);
            __m512 part[GROUP_SIZE][16];
            for (int t = 0; t < 16; ++t) {
                if (t >= m) {
                    for (int g = 0; g < GROUP_SIZE; ++g) part[g][t] = _mm512_setzero_ps();
                    continue;
                }
                const kv_t* k_head = k_block + (int64_t)(c + t) * TOKEN_STRIDE + h * HEAD_DIM;
                __m512i kv[DQ];
                for (int i = 0; i < DQ; ++i) kv[i] = _mm512_loadu_si512(k_head + 32 * i);
                for (int g = 0; g < GROUP_SIZE; ++g) {
                    __m512 acc = _mm512_setzero_ps();
                    for (int i = 0; i < DQ; ++i)
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)qv[g][i], (__m512bh)kv[i]);
                    part[g][t] = acc;
                }
            }
            const __mmask16 mask = (__mmask16)((1u << m) - 1);
            for (int g = 0; g < GROUP_SIZE; ++g)
                _mm512_mask_storeu_ps(scores + (h * GROUP_SIZE + g) * stride + t0 + c, mask,
                                      _mm512_mul_ps(transpose_sum16(part[g]), scale_v));
        }
    }
}
#else
static void score_block(const kv_t* restrict k_block, const float* restrict q_scaled,
                        const q_t* restrict q_raw, float scale, float* restrict scores,
                        int64_t stride, int t0, int n) {
    (void)q_raw;
    (void)scale;
    for (int c = 0; c < n; c += 16) {
        const int m = n - c < 16 ? n - c : 16;
        for (int h = 0; h < NUM_KV_HEADS; ++h) {
            __m512 qv[GROUP_SIZE][DV];
            for (int g = 0; g < GROUP_SIZE; ++g)
                for (int i = 0; i < DV; ++i)
                    qv[g][i] = _mm512_loadu_ps(q_scaled + (h * GROUP_SIZE + g) * HEAD_DIM + 16 * i);
            __m512 part[GROUP_SIZE][16];
            for (int t = 0; t < 16; ++t) {
                if (t >= m) {
                    for (int g = 0; g < GROUP_SIZE; ++g) part[g][t] = _mm512_setzero_ps();
                    continue;
                }
                const kv_t* k_head = k_block + (int64_t)(c + t) * TOKEN_STRIDE + h * HEAD_DIM;
                __m512 kv[DV];
                for (int i = 0; i < DV; ++i) kv[i] = load_kv16(k_head + 16 * i);
                for (int g = 0; g < GROUP_SIZE; ++g) {
                    __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
                    for (int i = 1; i < DV; ++i) acc = _mm512_fmadd_ps(qv[g][i], kv[i], acc);
                    part[g][t] = acc;
                }
            }
            const __mmask16 mask = (__mmask16)((1u << m) - 1);
            for (int g = 0; g < GROUP_SIZE; ++g)
                _mm512_mask_storeu_ps(scores + (h * GROUP_SIZE + g) * stride + t0 + c, mask,
                                      transpose_sum16(part[g]));
        }
    }
}

#endif

static void accumulate_block(const kv_t* restrict v_block, const float* restrict probs,
                             float* restrict acc, int64_t stride, int t0, int n) {
    for (int h = 0; h < NUM_KV_HEADS; ++h) {
        __m512 group_acc[GROUP_SIZE][DV];
        for (int g = 0; g < GROUP_SIZE; ++g)
            for (int i = 0; i < DV; ++i)
                group_acc[g][i] = _mm512_loadu_ps(acc + (h * GROUP_SIZE + g) * HEAD_DIM + 16 * i);
        for (int t = 0; t < n; ++t) {
            const kv_t* v_head = v_block + (int64_t)t * TOKEN_STRIDE + h * HEAD_DIM;
            __m512 vv[DV];
            for (int i = 0; i < DV; ++i) vv[i] = load_kv16(v_head + 16 * i);
            for (int g = 0; g < GROUP_SIZE; ++g) {
                const __m512 p = _mm512_set1_ps(probs[(h * GROUP_SIZE + g) * stride + t0 + t]);
                for (int i = 0; i < DV; ++i)
                    group_acc[g][i] = _mm512_fmadd_ps(p, vv[i], group_acc[g][i]);
            }
        }
        for (int g = 0; g < GROUP_SIZE; ++g)
            for (int i = 0; i < DV; ++i)
                _mm512_storeu_ps(acc + (h * GROUP_SIZE + g) * HEAD_DIM + 16 * i, group_acc[g][i]);
    }
}
#else
/* scores[hq * stride + t] for the n tokens of one block starting at t0. */
static void score_block(const kv_t* restrict k_block, const float* restrict q_scaled,
                        const q_t* restrict q_raw, float scale, float* restrict scores,
                        int64_t stride, int t0, int n) {
    (void)q_raw;
    (void)scale;
    for (int t = 0; t < n; ++t) {
        const kv_t* restrict k_row = k_block + (int64_t)t * TOKEN_STRIDE;
        for (int hq = 0; hq < NUM_HEADS; ++hq) {
            const float* restrict q_head = q_scaled + hq * HEAD_DIM;
            const kv_t* restrict k_head = k_row + (hq / GROUP_SIZE) * HEAD_DIM;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < HEAD_DIM; ++d) dot += q_head[d] * kv_to_f(k_head[d]);
            scores[hq * stride + t0 + t] = dot;
        }
    }
}

/* acc[hq] += sum over the block's n tokens of probs[hq][t0 + t] * v[t][kv head of hq]. */
static void accumulate_block(const kv_t* restrict v_block, const float* restrict probs,
                             float* restrict acc, int64_t stride, int t0, int n) {
    for (int h = 0; h < NUM_KV_HEADS; ++h) {
        float group_acc[GROUP_SIZE][HEAD_DIM];
        for (int g = 0; g < GROUP_SIZE; ++g)
            for (int d = 0; d < HEAD_DIM; ++d) group_acc[g][d] = acc[(h * GROUP_SIZE + g) * HEAD_DIM + d];
        for (int t = 0; t < n; ++t) {
            const kv_t* restrict v_head = v_block + (int64_t)t * TOKEN_STRIDE + h * HEAD_DIM;
            for (int g = 0; g < GROUP_SIZE; ++g) {
                const float p = probs[(h * GROUP_SIZE + g) * stride + t0 + t];
#pragma omp simd
                for (int d = 0; d < HEAD_DIM; ++d) group_acc[g][d] += p * kv_to_f(v_head[d]);
            }
        }
        for (int g = 0; g < GROUP_SIZE; ++g)
            for (int d = 0; d < HEAD_DIM; ++d) acc[(h * GROUP_SIZE + g) * HEAD_DIM + d] = group_acc[g][d];
    }
}

#endif

/* Softmax of each head's first n scores, in place; writes 1 / sum to inv_sum. */
static void softmax_rows(float* restrict scores, int64_t stride, int n, float* restrict inv_sum) {
    for (int hq = 0; hq < NUM_HEADS; ++hq) {
        float* restrict row = scores + hq * stride;
        float max_score = -FLT_MAX;
        for (int t = 0; t < n; ++t) max_score = row[t] > max_score ? row[t] : max_score;
        float sum = 0.0f;
        for (int t = 0; t < n; ++t) {
            row[t] = expf(row[t] - max_score);
            sum += row[t];
        }
        inv_sum[hq] = 1.0f / sum;
    }
}

static void attend_row(const q_t* restrict q_row, float scale, const kv_t* restrict k_cache,
                       const kv_t* restrict v_cache, const int32_t* restrict blocks,
                       int64_t block_size, int context_len, int sliding_window, float soft_cap,
                       float* restrict scores, int64_t stride, q_t* restrict out_row, int prefetch) {
    float q_scaled[NUM_HEADS * HEAD_DIM];
    float acc[NUM_HEADS * HEAD_DIM];
    float inv_sum[NUM_HEADS];
    const int64_t block_stride = block_size * TOKEN_STRIDE;
    const int num_blocks = (int)((context_len + block_size - 1) / block_size);
    /* Keys start .. context_len - 1 are visible; scores[hq * stride + (t - start)]. */
    const int start = sliding_window > 0 && context_len > sliding_window ? context_len - sliding_window : 0;
    const int first_block = (int)(start / block_size);
    const int len = context_len - start;
    for (int i = 0; i < NUM_HEADS * HEAD_DIM; ++i) q_scaled[i] = kv_to_f(q_row[i]) * scale;
    for (int b = first_block; b < num_blocks; ++b) {
        const int t0 = (int)(b * block_size);
        const int lo = t0 > start ? t0 : start;
        const int hi = context_len - t0 < block_size ? context_len : t0 + (int)block_size;
        if (prefetch) {
            if (b + 1 < num_blocks) prefetch_block(k_cache + blocks[b + 1] * block_stride, (int)block_size);
            else prefetch_block(v_cache + blocks[first_block] * block_stride, (int)block_size);
        }
        score_block(k_cache + blocks[b] * block_stride + (int64_t)(lo - t0) * TOKEN_STRIDE, q_scaled,
                    q_row, scale, scores, stride, lo - start, hi - lo);
    }
    if (soft_cap > 0.0f) {
        const float inv_cap = 1.0f / soft_cap;
        for (int hq = 0; hq < NUM_HEADS; ++hq)
            for (int t = 0; t < len; ++t) scores[hq * stride + t] = soft_cap * tanhf(scores[hq * stride + t] * inv_cap);
    }
    softmax_rows(scores, stride, len, inv_sum);
    for (int i = 0; i < NUM_HEADS * HEAD_DIM; ++i) acc[i] = 0.0f;
    for (int b = first_block; b < num_blocks; ++b) {
        const int t0 = (int)(b * block_size);
        const int lo = t0 > start ? t0 : start;
        const int hi = context_len - t0 < block_size ? context_len : t0 + (int)block_size;
        if (prefetch && b + 1 < num_blocks) prefetch_block(v_cache + blocks[b + 1] * block_stride, (int)block_size);
        accumulate_block(v_cache + blocks[b] * block_stride + (int64_t)(lo - t0) * TOKEN_STRIDE, scores,
                         acc, stride, lo - start, hi - lo);
    }
    for (int hq = 0; hq < NUM_HEADS; ++hq)
        for (int d = 0; d < HEAD_DIM; ++d)
            out_row[hq * HEAD_DIM + d] = f_to_out(acc[hq * HEAD_DIM + d] * inv_sum[hq]);
}

/* Returns 1 when every index the rows use is in bounds, so the kernel cannot read or write
 * outside the tensors it was handed (cheap: one pass over the rows' block-table entries). */
static int rows_are_valid(int64_t num_tokens, int64_t num_blocks, int64_t block_size,
                          const int32_t* block_table, int64_t num_reqs,
                          int64_t block_table_width, int64_t block_table_stride,
                          const int64_t* token_ids, const int64_t* req_ids,
                          const int32_t* context_lens, int64_t num_rows,
                          int64_t max_context_len) {
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t context_len = context_lens[r];
        if (token_ids[r] < 0 || token_ids[r] >= num_tokens) return 0;
        if (req_ids[r] < 0 || req_ids[r] >= num_reqs) return 0;
        if (context_len < 1 || context_len > max_context_len) return 0;
        const int64_t blocks_used = (context_len + block_size - 1) / block_size;
        if (blocks_used > block_table_width) return 0;
        const int32_t* blocks = block_table + req_ids[r] * block_table_stride;
        for (int64_t b = 0; b < blocks_used; ++b)
            if (blocks[b] < 0 || blocks[b] >= num_blocks) return 0;
    }
    return 1;
}

/*
 * query, out: [num_tokens, NUM_HEADS, HEAD_DIM] in the cache's dtype, row strides
 * query_stride / out_stride.
 * k_cache, v_cache: contiguous [num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM].
 * block_table: [num_reqs, block_table_width] int32, row stride block_table_stride.
 * token_ids, req_ids: [num_rows] int64; context_lens: [num_rows] int32, 1 <= len <=
 * max_context_len. sliding_window: 0, or attend to each row's last sliding_window keys only;
 * soft_cap: 0, or cap the scaled scores at +-soft_cap with tanh.
 * Returns 0; -1 when a thread could not allocate its scores buffer (out is then incomplete);
 * -2 when an index is out of bounds (nothing is written).
 */
int ENTRY(const q_t* query, int64_t query_stride, int64_t num_tokens,
                             const kv_t* k_cache, const kv_t* v_cache, int64_t num_blocks,
                             int64_t block_size, const int32_t* block_table, int64_t num_reqs,
                             int64_t block_table_width, int64_t block_table_stride,
                             const int64_t* token_ids, const int64_t* req_ids,
                             const int32_t* context_lens, int64_t num_rows,
                             int64_t max_context_len, float scale, int sliding_window,
                             float soft_cap, q_t* out, int64_t out_stride, int num_threads) {
    if (!rows_are_valid(num_tokens, num_blocks, block_size, block_table, num_reqs,
                        block_table_width, block_table_stride, token_ids, req_ids,
                        context_lens, num_rows, max_context_len))
        return -2;
    int status = 0;
    const int64_t stride = (max_context_len + FLOATS_PER_LINE - 1) / FLOATS_PER_LINE * FLOATS_PER_LINE;
#pragma omp parallel num_threads(num_threads) reduction(min : status)
    {
        float* scores = (float*)malloc(sizeof(float) * (size_t)(stride * NUM_HEADS));
        if (scores == NULL) status = -1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_rows; ++r) {
            if (scores == NULL) continue;
            /* A row alone in its request streams its keys from memory: prefetch them. Rows
             * of one request (a prompt's) share its keys, in cache after the first rows:
             * prefetching them only costs instructions (a 600-token prompt: 0.88x the time
             * without). */
            const int alone = (r == 0 || req_ids[r - 1] != req_ids[r]) &&
                              (r + 1 == num_rows || req_ids[r + 1] != req_ids[r]);
            attend_row(query + token_ids[r] * query_stride, scale, k_cache, v_cache,
                       block_table + req_ids[r] * block_table_stride, block_size, context_lens[r],
                       sliding_window, soft_cap, scores, stride, out + token_ids[r] * out_stride,
                       alone);
        }
        free(scores);
    }
    return status;
}
