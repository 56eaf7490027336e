/*
 * Fused elementwise kernels for the fp32 CPU forward pass: SiLU-and-mul, RMSNorm (with the
 * residual add fused in) and rotary embeddings, one pass over memory each, rows spread over
 * OpenMP threads. Modelled on vLLM's CPU ops silu_and_mul, rms_norm, fused_add_rms_norm and
 * rotary_embedding (csrc/cpu/activation.cpp, layernorm.cpp, pos_encoding.cpp).
 *
 * The results are bit-identical to the torch ops the model otherwise runs (and so to
 * transformers), because every float operation is done in torch's order:
 *   - kernels/cpu_fused.py compiles this file with -ffp-contract=off, so `a * b + c` stays two
 *     roundings (torch runs `q * cos + rotate_half(q) * sin` as separate ops) and the only fused
 *     multiply-adds are the explicit fmaf calls of expf_sleef;
 *   - the mean of squares is summed in the order of ATen's cascade_sum (see sum_of_squares);
 *   - exp is Sleef's expf_u10, which ATen's Vectorized<float>::exp calls on AVX2 / AVX-512.
 * SUM_VEC_LANES / SILU_VEC_LANES (floats per vector in ATen's sum / silu kernels on this CPU)
 * and USE_SLEEF_EXP are defined by the build. Nothing here depends on the thread count: each row is computed by one thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ILP 4        /* ATen row_sum: independent accumulators */
#define NUM_LEVELS 4 /* ATen multi_row_sum: cascade levels */
#define SILU_CHUNK 512

static inline float float_from_bits(int32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

/* Sleef_expf_u10 (xexpf in sleef/src/libm/sleefsimdsp.c, FMA build), scalar form so that the
 * caller's simd loop vectorizes it. The clamp only keeps the float->int conversion defined; it
 * never changes a result (|d| > 104 is overridden below, NaN propagates through s). */
static inline float expf_sleef(float d) {
    const float r_ln2 = 1.442695040888963407359924681001892137426645954152985934135449406931f;
    const float l2u = 0.693145751953125f, l2l = 1.428606765330187045e-06f;
    float clamped = d > -120.0f ? d : -120.0f;
    clamped = clamped < 120.0f ? clamped : 120.0f;
    const int32_t q = (int32_t)rintf(clamped * r_ln2);
    float s = __builtin_fmaf((float)q, -l2u, d);
    s = __builtin_fmaf((float)q, -l2l, s);
    float u = 0.000198527617612853646278381f;
    u = __builtin_fmaf(u, s, 0.00139304355252534151077271f);
    u = __builtin_fmaf(u, s, 0.00833336077630519866943359f);
    u = __builtin_fmaf(u, s, 0.0416664853692054748535156f);
    u = __builtin_fmaf(u, s, 0.166666671633720397949219f);
    u = __builtin_fmaf(u, s, 0.5f);
    u = 1.0f + __builtin_fmaf(s * s, u, s);
    u = u * float_from_bits(((q >> 1) + 0x7f) << 23) * float_from_bits(((q - (q >> 1)) + 0x7f) << 23);
    u = d < -104.0f ? 0.0f : u;
    return 100.0f < d ? INFINITY : u;
}

/* out[t][j] = silu(in[t][j]) * in[t][d + j], silu(x) = x / (1 + exp(-x)).
 * NOTE: ATen's vectorized loop handles a row in chunks of 2 vectors and leaves the last
 * d % (2 * SILU_VEC_LANES) columns to its scalar op (std::exp = libm expf); so do we. */
void silu_and_mul_f32(const float* input, int64_t input_stride, int64_t num_tokens, int64_t d,
                      float* out, int64_t out_stride, int num_threads) {
#ifdef USE_SLEEF_EXP
    const int64_t vec_end = d / (2 * SILU_VEC_LANES) * (2 * SILU_VEC_LANES);
#else
    const int64_t vec_end = 0;
#endif
    const int64_t chunks_per_row = (d + SILU_CHUNK - 1) / SILU_CHUNK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < num_tokens * chunks_per_row; ++item) {
        const int64_t t = item / chunks_per_row;
        const int64_t begin = item % chunks_per_row * SILU_CHUNK;
        const int64_t end = begin + SILU_CHUNK < d ? begin + SILU_CHUNK : d;
        const int64_t split = vec_end < begin ? begin : (vec_end < end ? vec_end : end);
        const float* restrict gate = input + t * input_stride;
        const float* restrict up = gate + d;
        float* restrict out_row = out + t * out_stride;
#pragma omp simd
        for (int64_t j = begin; j < split; ++j)
            out_row[j] = gate[j] / (1.0f + expf_sleef(-gate[j])) * up[j];
        for (int64_t j = split; j < end; ++j)
            out_row[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
}

/* Sum of x[i] * x[i] over a row of n floats, in the order of ATen's cascade_sum for a
 * contiguous inner reduction (aten/src/ATen/native/cpu/SumKernel.cpp): the row is read as
 * vectors of `lanes` floats (lanes = 1 when n < SUM_VEC_LANES: ATen's scalar_inner_sum),
 *
 *   vector v = i * ILP + k  ->  acc[level 0][k] += v      (multi_row_sum over i, with carries
 *                                                           into higher levels every
 *                                                           2^level_power rows)
 *   then levels summed, leftover vectors into acc[0][0], acc[0][1..3] into acc[0][0],
 *   then total = 0 + leftover scalars + lanes of acc[0][0], in order.
 */
static inline __attribute__((always_inline)) float cascade_sum_of_squares(
        const float* restrict x, int64_t n, const int lanes) {
    float acc[NUM_LEVELS][ILP][SUM_VEC_LANES];
    memset(acc, 0, sizeof(acc));
    const int64_t num_vectors = n / lanes;
    const int64_t num_rows = num_vectors / ILP;
    int64_t ceil_log2 = 1;
    while (num_rows > 2 && ((int64_t)1 << ceil_log2) < num_rows) ++ceil_log2;
    const int64_t level_power = ceil_log2 / NUM_LEVELS > 4 ? ceil_log2 / NUM_LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power;
    int64_t i = 0;
    while (i + level_step <= num_rows) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < ILP; ++k)
#pragma omp simd
                for (int l = 0; l < lanes; ++l) {
                    const float v = x[(i * ILP + k) * lanes + l];
                    acc[0][k][l] += v * v;
                }
        for (int level = 1; level < NUM_LEVELS; ++level) {
            for (int k = 0; k < ILP; ++k)
                for (int l = 0; l < lanes; ++l) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.0f;
                }
            if ((i & ((level_step - 1) << (level * level_power))) != 0) break;
        }
    }
    for (; i < num_rows; ++i)
        for (int k = 0; k < ILP; ++k)
#pragma omp simd
            for (int l = 0; l < lanes; ++l) {
                const float v = x[(i * ILP + k) * lanes + l];
                acc[0][k][l] += v * v;
            }
    for (int level = 1; level < NUM_LEVELS; ++level)
        for (int k = 0; k < ILP; ++k)
            for (int l = 0; l < lanes; ++l) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = num_rows * ILP; v < num_vectors; ++v)
        for (int l = 0; l < lanes; ++l) acc[0][0][l] += x[v * lanes + l] * x[v * lanes + l];
    for (int k = 1; k < ILP; ++k)
        for (int l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = num_vectors * lanes; e < n; ++e) total += x[e] * x[e];
    for (int l = 0; l < lanes; ++l) total += acc[0][0][l];
    return total;
}

static float sum_of_squares(const float* restrict x, int64_t n) {
    return n >= SUM_VEC_LANES ? cascade_sum_of_squares(x, n, SUM_VEC_LANES)
                                : cascade_sum_of_squares(x, n, 1);
}

/* out_row = weight * (x_row * (1 / sqrt(sum(x_row^2) / n + eps))), torch's RMSNorm order. */
static void normalize_row(const float* restrict x_row, const float* restrict weight, int64_t n,
                          float eps, float* out_row) {
    const float inv_rms = 1.0f / sqrtf(sum_of_squares(x_row, n) / (float)n + eps);
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) out_row[e] = weight[e] * (x_row[e] * inv_rms);
}

/* out[t] = rmsnorm(x[t]) * weight, x and out [num_tokens, hidden] with row strides. */
void rms_norm_f32(const float* x, int64_t x_stride, const float* weight, int64_t num_tokens,
                  int64_t hidden, float eps, float* out, int64_t out_stride, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t)
        normalize_row(x + t * x_stride, weight, hidden, eps, out + t * out_stride);
}

/* In place: residual[t] += x[t]; x[t] = rmsnorm(residual[t]) * weight. */
void fused_add_rms_norm_f32(float* x, int64_t x_stride, float* residual, int64_t residual_stride,
                            const float* weight, int64_t num_tokens, int64_t hidden, float eps,
                            int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        float* restrict x_row = x + t * x_stride;
        float* restrict residual_row = residual + t * residual_stride;
#pragma omp simd
        for (int64_t e = 0; e < hidden; ++e) residual_row[e] = residual_row[e] + x_row[e];
        normalize_row(residual_row, weight, hidden, eps, x_row);
    }
}

/* x = x * cos + rotate_half(x) * sin for each of num_heads head_dim-long heads in a row. */
static void rotate_heads(float* restrict row, int64_t num_heads, int64_t head_dim,
                         const float* restrict cos_row, const float* restrict sin_row) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; ++h) {
        float* restrict x1 = row + h * head_dim;
        float* restrict x2 = x1 + half;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
            const float a = x1[d], b = x2[d];
            x1[d] = a * cos_row[d] + (-b) * sin_row[d];
            x2[d] = b * cos_row[half + d] + a * sin_row[half + d];
        }
    }
}

/*
 * In place, rotate-half (NeoX / HF Llama) layout. q: [num_tokens, num_heads, head_dim], k:
 * [num_tokens, num_kv_heads, head_dim], heads contiguous within a row, row strides q_stride /
 * k_stride. cos, sin: contiguous [max_positions, head_dim]. Returns 0; -2 when a position is
 * outside [0, max_positions) (nothing is written).
 */
int rotary_embedding_f32(const int64_t* positions, int64_t num_tokens, float* q,
                         int64_t q_stride, int64_t num_heads, float* k, int64_t k_stride,
                         int64_t num_kv_heads, const float* cos, const float* sin,
                         int64_t max_positions, int64_t head_dim, int num_threads) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_positions) return -2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const float* cos_row = cos + positions[t] * head_dim;
        const float* sin_row = sin + positions[t] * head_dim;
        rotate_heads(q + t * q_stride, num_heads, head_dim, cos_row, sin_row);
        rotate_heads(k + t * k_stride, num_kv_heads, head_dim, cos_row, sin_row);
    }
    return 0;
}

/* ---- bf16 rows (--dtype bfloat16): the same ops as torch's bf16 ops, bit for bit. ----
 * A bf16 op in torch widens its inputs to fp32 (exactly), computes one fp32 result and
 * rounds it to bf16 (nearest even); a chain of them (q * cos + rotate_half(q) * sin) rounds
 * after each op. These kernels do the same operations and roundings in the same order, so
 * the model's bf16 forward is the same bits with or without them. */
typedef uint16_t bf16_t;

static inline float bf16_to_f(bf16_t h) { return float_from_bits((int32_t)((uint32_t)h << 16)); }

static inline bf16_t f_to_bf16(float f) {  /* c10::BFloat16's round_to_nearest_even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7FC0;
    return (bf16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f(f_to_bf16(f)); }

#define MAX_BF16_ROW 16384

/* out[t][j] = bf16(bf16(silu(gate[j])) * up[j]): F.silu(gate) * up on bf16 tensors. ATen's
 * bf16 silu runs vectors of 2 * SILU_VEC_LANES bf16 in pairs (4 * SILU_VEC_LANES a step). */
void silu_and_mul_bf16(const bf16_t* input, int64_t input_stride, int64_t num_tokens,
                       int64_t d, bf16_t* out, int64_t out_stride, int num_threads) {
#ifdef USE_SLEEF_EXP
    const int64_t vec_end = d / (4 * SILU_VEC_LANES) * (4 * SILU_VEC_LANES);
#else
    const int64_t vec_end = 0;
#endif
    const int64_t chunks_per_row = (d + SILU_CHUNK - 1) / SILU_CHUNK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < num_tokens * chunks_per_row; ++item) {
        const int64_t t = item / chunks_per_row;
        const int64_t begin = item % chunks_per_row * SILU_CHUNK;
        const int64_t end = begin + SILU_CHUNK < d ? begin + SILU_CHUNK : d;
        const int64_t split = vec_end < begin ? begin : (vec_end < end ? vec_end : end);
        const bf16_t* restrict gate = input + t * input_stride;
        const bf16_t* restrict up = gate + d;
        bf16_t* restrict out_row = out + t * out_stride;
#pragma omp simd
        for (int64_t j = begin; j < split; ++j) {
            const float g = bf16_to_f(gate[j]);
            out_row[j] = f_to_bf16(round_bf16(g / (1.0f + expf_sleef(-g))) * bf16_to_f(up[j]));
        }
        for (int64_t j = split; j < end; ++j) {
            const float g = bf16_to_f(gate[j]);
            out_row[j] = f_to_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_f(up[j]));
        }
    }
}

/* out_row = bf16(weight * bf16(x * inv_rms)), the mean of squares over the row widened to
 * fp32 (x.float().pow(2).mean() in the same order as the fp32 kernel). */
static void normalize_row_bf16(const bf16_t* restrict x_row, const bf16_t* restrict weight,
                               int64_t n, float eps, bf16_t* out_row) {
    float x32[MAX_BF16_ROW];
#pragma omp simd
    for (int64_t e = 0; e < n; ++e) x32[e] = bf16_to_f(x_row[e]);
    const float inv_rms = 1.0f / sqrtf(sum_of_squares(x32, n) / (float)n + eps);
#pragma omp simd
    for (int64_t e = 0; e < n; ++e)
        out_row[e] = f_to_bf16(bf16_to_f(weight[e]) * round_bf16(x32[e] * inv_rms));
}

/* As rms_norm_f32 on bf16 rows and a bf16 weight; hidden <= MAX_BF16_ROW. */
void rms_norm_bf16(const bf16_t* x, int64_t x_stride, const bf16_t* weight,
                   int64_t num_tokens, int64_t hidden, float eps, bf16_t* out,
                   int64_t out_stride, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t)
        normalize_row_bf16(x + t * x_stride, weight, hidden, eps, out + t * out_stride);
}

/* In place: residual[t] = bf16(residual[t] + x[t]); x[t] = rms_norm(residual[t]). */
void fused_add_rms_norm_bf16(bf16_t* x, int64_t x_stride, bf16_t* residual,
                             int64_t residual_stride, const bf16_t* weight, int64_t num_tokens,
                             int64_t hidden, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        bf16_t* restrict x_row = x + t * x_stride;
        bf16_t* restrict residual_row = residual + t * residual_stride;
#pragma omp simd
        for (int64_t e = 0; e < hidden; ++e)
            residual_row[e] = f_to_bf16(bf16_to_f(residual_row[e]) + bf16_to_f(x_row[e]));
        normalize_row_bf16(residual_row, weight, hidden, eps, x_row);
    }
}

/* x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), bf16 tables. */
static void rotate_heads_bf16(bf16_t* restrict row, int64_t num_heads, int64_t head_dim,
                              const bf16_t* restrict cos_row, const bf16_t* restrict sin_row) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; ++h) {
        bf16_t* restrict x1 = row + h * head_dim;
        bf16_t* restrict x2 = x1 + half;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
            const float a = bf16_to_f(x1[d]), b = bf16_to_f(x2[d]);
            x1[d] = f_to_bf16(round_bf16(a * bf16_to_f(cos_row[d]))
                              + round_bf16(-b * bf16_to_f(sin_row[d])));
            x2[d] = f_to_bf16(round_bf16(b * bf16_to_f(cos_row[half + d]))
                              + round_bf16(a * bf16_to_f(sin_row[half + d])));
        }
    }
}

/* As rotary_embedding_f32 on bf16 q, k and tables. */
int rotary_embedding_bf16(const int64_t* positions, int64_t num_tokens, bf16_t* q,
                          int64_t q_stride, int64_t num_heads, bf16_t* k, int64_t k_stride,
                          int64_t num_kv_heads, const bf16_t* cos, const bf16_t* sin,
                          int64_t max_positions, int64_t head_dim, int num_threads) {
    for (int64_t t = 0; t < num_tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_positions) return -2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const bf16_t* cos_row = cos + positions[t] * head_dim;
        const bf16_t* sin_row = sin + positions[t] * head_dim;
        rotate_heads_bf16(q + t * q_stride, num_heads, head_dim, cos_row, sin_row);
        rotate_heads_bf16(k + t * k_stride, num_kv_heads, head_dim, cos_row, sin_row);
    }
    return 0;
}
