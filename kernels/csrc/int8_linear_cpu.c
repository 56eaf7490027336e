/* Weight-only int8 linear on CPU: y[M, N] = (x[M, K] . dequant(q)^T) + bias[N], where
 * dequant(q)[n, k] = scale[n] * q[n, k] (symmetric per output channel). Activations stay fp32.
 *
 * Weight layout (packed once at load, `kernels/cpu_int8.py`): panels of 32 output channels,
 * each K-major, so one k step reads the 32 int8 weights of that input feature contiguously:
 *
 *     qpacked[p][k][c] = q[32 * p + c][k]     p < N_pad / 32 (N padded with zero rows)
 *
 * Every output is one fp32 FMA chain over k in order 0..K-1 (x[m, k] broadcast times the
 * widened weight), then times scale[n] plus bias[n]: the same operations whatever the number
 * of rows, so a row's result never depends on the rest of the batch.
 *
 * Tiling: OpenMP threads take panels. With at most 4 rows, each k step widens the panel's 32
 * int8 weights in registers (int8 -> int32 -> fp32) and feeds every row: the weights are read
 * from memory as int8 only (decode of a few streams is bound by that read). With more rows
 * the panel is widened once into a per-thread fp32 buffer [K][32] (<= 4 * 32 * K bytes, L2)
 * that blocks of 12 rows then read, 24 accumulators, the x value broadcast from memory:
 * the inner loop is 2 loads + 24 FMAs per k.
 */
#include <stdint.h>
#include <stdlib.h>

#define PANEL 32

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void widen32(const int8_t *p, __m512 *lo,
                                                           __m512 *hi) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
}

static inline __attribute__((always_inline)) void store_rows(
        __m512 acc[][2], const int mb, float *y, int64_t N, int64_t n0, int64_t n_valid,
        const float *s, const float *b) {
    __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
    __mmask16 k0 = n_valid >= 16 ? 0xFFFF : (__mmask16)((1u << n_valid) - 1);
    __mmask16 k1 = n_valid >= 32 ? 0xFFFF
                   : (n_valid <= 16 ? 0 : (__mmask16)((1u << (n_valid - 16)) - 1));
    for (int i = 0; i < mb; i++) {
        float *row = y + i * N + n0;
        _mm512_mask_storeu_ps(row, k0, _mm512_fmadd_ps(acc[i][0], s0, b0));
        _mm512_mask_storeu_ps(row + 16, k1, _mm512_fmadd_ps(acc[i][1], s1, b1));
    }
}

/* mb (<= 4) rows against one int8 panel, widened in registers. */
static inline __attribute__((always_inline)) void panel_int8(
        const float *x, int64_t x_stride, const int mb, const int8_t *qp, int64_t K,
        __m512 acc[][2]) {
    for (int i = 0; i < mb; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 w0, w1;
        widen32(qp + k * PANEL, &w0, &w1);
        for (int i = 0; i < mb; i++) {
            __m512 xv = _mm512_set1_ps(x[i * x_stride + k]);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
}

/* mb (<= 12) rows against one panel already widened to fp32 (w [K][32]). */
static inline __attribute__((always_inline)) void panel_f32(
        const float *x, int64_t x_stride, const int mb, const float *w, int64_t K,
        __m512 acc[][2]) {
    for (int i = 0; i < mb; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 w0 = _mm512_loadu_ps(w + k * PANEL), w1 = _mm512_loadu_ps(w + k * PANEL + 16);
        for (int i = 0; i < mb; i++) {
            __m512 xv = _mm512_set1_ps(x[i * x_stride + k]);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
}

/* One tile of MB rows: PANEL_FN over the panel W, then the scaled rows stored. */
#define RUN_TILE(PANEL_FN, W, MB)                                                 \
    do {                                                                          \
        __m512 acc[MB][2];                                                        \
        PANEL_FN(x + m0 * x_stride, x_stride, MB, W, K, acc);                     \
        store_rows(acc, MB, y + m0 * N, N, n0, n_valid, s, b);                    \
    } while (0)
#define RUN_INT8(MB) RUN_TILE(panel_int8, qp, MB)
#define RUN_F32(MB) RUN_TILE(panel_f32, wbuf, MB)

static void run_panel(const float *x, int64_t x_stride, int64_t M, const int8_t *qp,
                      const float *s, const float *b, float *y, int64_t N, int64_t n0,
                      int64_t n_valid, int64_t K, float *wbuf) {
    int64_t m0 = 0;
    if (wbuf == NULL) {
        for (; m0 + 4 <= M; m0 += 4) RUN_INT8(4);
        switch (M - m0) {
            case 3: RUN_INT8(3); break;
            case 2: RUN_INT8(2); break;
            case 1: RUN_INT8(1); break;
            default: break;
        }
        return;
    }
    for (int64_t i = 0; i < K * PANEL; i += 16)
        _mm512_storeu_ps(wbuf + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128((const __m128i *)(qp + i)))));
    for (; m0 + 12 <= M; m0 += 12) RUN_F32(12);
    for (; m0 + 4 <= M; m0 += 4) RUN_F32(4);
    for (; m0 < M; m0++) RUN_F32(1);
}
#else
/* Portable: the same per-output FMA chain order (k ascending), one output at a time. */
static void run_panel(const float *x, int64_t x_stride, int64_t M, const int8_t *qp,
                      const float *s, const float *b, float *y, int64_t N, int64_t n0,
                      int64_t n_valid, int64_t K, float *wbuf) {
    (void)wbuf;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < n_valid; c++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++)
                acc = __builtin_fmaf(x[m * x_stride + k], (float)qp[k * PANEL + c], acc);
            y[m * N + n0 + c] = __builtin_fmaf(acc, s[c], b[c]);
        }
}
#endif

/* y [M, N] (row stride N) = x [M, K] . (scale * q)^T + bias. qpacked: ceil(N / 32) panels
 * [K][32] int8; scale and bias: N_pad = 32 * ceil(N / 32) floats each (bias zeros when the
 * layer has none). Returns 0, or -1 when a per-thread buffer could not be allocated. */
int int8_linear_f32(const float *x, int64_t x_stride, const int8_t *qpacked,
                    const float *scale, const float *bias, float *y, int64_t M, int64_t N,
                    int64_t K, int num_threads) {
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    const int widen = M > 4;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *wbuf = widen ? (float *)malloc((size_t)(K * PANEL) * sizeof(float)) : NULL;
        if (widen && wbuf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++) {
                const int64_t n0 = p * PANEL;
                const int64_t n_valid = N - n0 < PANEL ? N - n0 : PANEL;
                run_panel(x, x_stride, M, qpacked + p * K * PANEL, scale + n0, bias + n0, y,
                          N, n0, n_valid, K, wbuf);
            }
        }
        free(wbuf);
    }
    return failed ? -1 : 0;
}
