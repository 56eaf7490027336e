/* Weight-only int8 linear on CPU: y[M, N] = (x[M, K] . dequant(q)[N, K]^T) + bias[N], where
 * dequant(q)[n, k] = scale[n] * q[n, k] (symmetric per output channel). Activations stay fp32.
 *
 * Tiling: each OpenMP thread takes blocks of NB = 4 weight rows; for every block of MB = 4 x
 * rows it keeps MB x NB fp32 accumulators of 16 lanes (AVX-512) and walks K 16 at a time:
 * 4 weight vectors (widened int8 -> int32 -> fp32) are used by 4 x rows (16 FMAs). With more
 * than 4 x rows the block's 4 weight rows are widened once into a per-thread fp32 buffer
 * (4 x K floats, L1/L2-resident) that every group of 4 x rows then reads; with at most 4 (the
 * decode of a few streams) they are widened in registers on the fly, so the weights are read
 * from memory as int8 only. The scale is applied once per output (after the sum over K), so
 * the result is an fp32 dot product with the int8 values, in 16-lane order, times the scale;
 * it does not depend on the other rows of the batch.
 *
 * Without AVX-512 the same loop runs on plain C (gcc vectorizes it for AVX2 at -O3).
 * Requires: K % 16 == 0, x rows contiguous (row stride x_stride), q [N, K] contiguous.
 */
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load_w16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* One tile: mb x rows (mb <= 4) times 4 weight rows, widened in registers. Always inlined
 * and called with a constant mb, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile_4n_mb(
        const float *x, int64_t x_stride, const int mb, const int8_t *q, int64_t K,
        float out[4][4]) {
    __m512 acc[4][4];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    const int8_t *q0 = q, *q1 = q + K, *q2 = q + 2 * K, *q3 = q + 3 * K;
    for (int64_t k = 0; k < K; k += 16) {
        __m512 w0 = load_w16(q0 + k), w1 = load_w16(q1 + k);
        __m512 w2 = load_w16(q2 + k), w3 = load_w16(q3 + k);
        for (int i = 0; i < mb; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * x_stride + k);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < 4; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

static inline void tile_4n(const float *x, int64_t x_stride, int mb, const int8_t *q,
                           int64_t K, float out[4][4]) {
    switch (mb) {
        case 1: tile_4n_mb(x, x_stride, 1, q, K, out); break;
        case 2: tile_4n_mb(x, x_stride, 2, q, K, out); break;
        case 3: tile_4n_mb(x, x_stride, 3, q, K, out); break;
        default: tile_4n_mb(x, x_stride, 4, q, K, out); break;
    }
}

/* The same tile from 4 weight rows already widened to fp32 (w [4, K], row stride K). */
static inline void tile_4n_f32(const float *x, int64_t x_stride, int mb, const float *w,
                               int64_t K, float out[4][4]) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    for (int64_t k = 0; k < K; k += 16) {
        __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
        __m512 v2 = _mm512_loadu_ps(w2 + k), v3 = _mm512_loadu_ps(w3 + k);
        for (int i = 0; i < mb; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * x_stride + k);
            acc[i][0] = _mm512_fmadd_ps(xv, v0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, v1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xv, v2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(xv, v3, acc[i][3]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < 4; j++) out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

static inline float dot_1n(const float *x, const int8_t *q, int64_t K) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load_w16(q + k), acc);
    return _mm512_reduce_add_ps(acc);
}
#else
static inline void tile_4n(const float *x, int64_t x_stride, int mb, const int8_t *q,
                           int64_t K, float out[4][4]) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < 4; j++) {
            float lanes[16] = {0};
            const float *xr = x + i * x_stride;
            const int8_t *qr = q + j * K;
            for (int64_t k = 0; k < K; k += 16)
                for (int l = 0; l < 16; l++) lanes[l] += xr[k + l] * (float)qr[k + l];
            float s = 0.f;
            for (int l = 0; l < 16; l++) s += lanes[l];
            out[i][j] = s;
        }
}

static inline void tile_4n_f32(const float *x, int64_t x_stride, int mb, const float *w,
                               int64_t K, float out[4][4]) {
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < 4; j++) {
            float lanes[16] = {0};
            const float *xr = x + i * x_stride, *wr = w + j * K;
            for (int64_t k = 0; k < K; k += 16)
                for (int l = 0; l < 16; l++) lanes[l] += xr[k + l] * wr[k + l];
            float s = 0.f;
            for (int l = 0; l < 16; l++) s += lanes[l];
            out[i][j] = s;
        }
}

static inline float dot_1n(const float *x, const int8_t *q, int64_t K) {
    float lanes[16] = {0};
    for (int64_t k = 0; k < K; k += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[k + l] * (float)q[k + l];
    float s = 0.f;
    for (int l = 0; l < 16; l++) s += lanes[l];
    return s;
}
#endif

/* y [M, N] (row stride N) = x [M, K] . (scale * q)^T + bias (bias may be NULL).
 * Returns 0, or -1 when the per-thread buffer could not be allocated (y untouched). */
int int8_linear_f32(const float *x, int64_t x_stride, const int8_t *q, const float *scale,
                    const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                    int num_threads) {
    const int64_t num_nblocks = N / 4;
    const int widen = M > 4;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *wbuf = widen ? (float *)malloc((size_t)(4 * K) * sizeof(float)) : NULL;
        if (widen && wbuf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < num_nblocks; nb++) {
                const int64_t n0 = nb * 4;
                const int8_t *qb = q + n0 * K;
                float out[4][4];
                float s[4], b[4];
                for (int j = 0; j < 4; j++) {
                    s[j] = scale[n0 + j];
                    b[j] = bias ? bias[n0 + j] : 0.f;
                }
                if (widen)
                    for (int64_t k = 0; k < 4 * K; k++) wbuf[k] = (float)qb[k];
                for (int64_t m0 = 0; m0 < M; m0 += 4) {
                    int mb = (int)(M - m0 < 4 ? M - m0 : 4);
                    if (widen)
                        tile_4n_f32(x + m0 * x_stride, x_stride, mb, wbuf, K, out);
                    else
                        tile_4n(x + m0 * x_stride, x_stride, mb, qb, K, out);
                    for (int i = 0; i < mb; i++)
                        for (int j = 0; j < 4; j++)
                            y[(m0 + i) * N + n0 + j] = out[i][j] * s[j] + b[j];
                }
            }
        }
        free(wbuf);
    }
    if (failed) return -1;
    /* The last N % 4 rows, one at a time. */
    for (int64_t n = num_nblocks * 4; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            y[m * N + n] = dot_1n(x + m * x_stride, q + n * K, K) * scale[n]
                           + (bias ? bias[n] : 0.f);
    return 0;
}
