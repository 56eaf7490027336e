/* fp32 linear for a few rows on CPU (a decode step of 1-8 streams):
 * y[M, N] = x[M, K] . W^T + bias[N], M <= MAX_ROWS (8 as built by kernels/cpu_gemv.py).
 *
 * Such a matmul reads every weight once and does 2*M flops per 4-byte weight, so it is bound
 * by memory bandwidth. The weight is packed once at load (`kernels/cpu_gemv.py`) into K-major
 * panels of PANEL output channels, so one k step reads the PANEL weights of that input
 * feature contiguously and each thread streams whole panels front to back:
 *
 *     wpacked[p][k][c] = W[PANEL * p + c][k]     p < N_pad / PANEL (N padded with zero rows)
 *
 * Every output is one fp32 FMA chain over k in order 0..K-1 (x[m, k] broadcast times the
 * weight), plus bias[n] at the end: the same operations whatever M, so a row's result never
 * depends on the other rows of the call.
 *
 * Threads (OpenMP) take runs of consecutive panels; the next panels' cache lines are
 * prefetched PREFETCH_AHEAD bytes ahead of the loads.
 */
#include <stdint.h>
#include <stddef.h>

#ifndef PANEL
#define PANEL 32
#endif
#ifndef MAX_ROWS
#define MAX_ROWS 16
#endif
#define TILE_ROWS 4
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1024
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

#define VECS (PANEL / 16)

/* mb (<= TILE_ROWS) rows against one panel [K][PANEL]. */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, int64_t x_stride, const int mb, const float *w, int64_t K,
        const float *b, float *y, int64_t N, int64_t n0, int64_t n_valid) {
    __m512 acc[TILE_ROWS][VECS];
    for (int i = 0; i < mb; i++)
        for (int v = 0; v < VECS; v++) acc[i][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float *wk = w + k * PANEL;
        _mm_prefetch((const char *)(wk + PREFETCH_AHEAD / 4), _MM_HINT_T0);
#if PANEL >= 32
        _mm_prefetch((const char *)(wk + PREFETCH_AHEAD / 4 + 16), _MM_HINT_T0);
#endif
#if PANEL >= 64
        _mm_prefetch((const char *)(wk + PREFETCH_AHEAD / 4 + 32), _MM_HINT_T0);
        _mm_prefetch((const char *)(wk + PREFETCH_AHEAD / 4 + 48), _MM_HINT_T0);
#endif
        __m512 wv[VECS];
        for (int v = 0; v < VECS; v++) wv[v] = _mm512_loadu_ps(wk + 16 * v);
        for (int i = 0; i < mb; i++) {
            __m512 xv = _mm512_set1_ps(x[i * x_stride + k]);
            for (int v = 0; v < VECS; v++) acc[i][v] = _mm512_fmadd_ps(xv, wv[v], acc[i][v]);
        }
    }
    for (int v = 0; v < VECS; v++) {
        const int64_t c0 = 16 * v;
        const int64_t left = n_valid - c0;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF
                         : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1));
        __m512 bv = b != NULL ? _mm512_loadu_ps(b + c0) : _mm512_setzero_ps();
        for (int i = 0; i < mb; i++)
            _mm512_mask_storeu_ps(y + i * N + n0 + c0, mask, _mm512_add_ps(acc[i][v], bv));
    }
}

static void run_panel(const float *x, int64_t x_stride, int64_t M, const float *w,
                      const float *b, float *y, int64_t N, int64_t n0, int64_t n_valid,
                      int64_t K) {
    /* Tiles of 4 rows; a panel read again by the next tile comes from L2. */
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const float *xm = x + m0 * x_stride;
        float *ym = y + m0 * N;
        switch (M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS) {
            case 4: panel_rows(xm, x_stride, 4, w, K, b, ym, N, n0, n_valid); break;
            case 3: panel_rows(xm, x_stride, 3, w, K, b, ym, N, n0, n_valid); break;
            case 2: panel_rows(xm, x_stride, 2, w, K, b, ym, N, n0, n_valid); break;
            default: panel_rows(xm, x_stride, 1, w, K, b, ym, N, n0, n_valid); break;
        }
    }
}
#else
/* Portable: the same per-output FMA chain order (k ascending), one output at a time. */
static void run_panel(const float *x, int64_t x_stride, int64_t M, const float *w,
                      const float *b, float *y, int64_t N, int64_t n0, int64_t n_valid,
                      int64_t K) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < n_valid; c++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++)
                acc = __builtin_fmaf(x[m * x_stride + k], w[k * PANEL + c], acc);
            y[m * N + n0 + c] = acc + (b != NULL ? b[c] : 0.f);
        }
}
#endif

/* The panel width this library was built with (the packer must agree). */
int f32_gemv_panel(void) { return PANEL; }

/* y [M, N] (row stride N) = x [M, K] (row stride x_stride) . W^T + bias. wpacked:
 * ceil(N / PANEL) panels [K][PANEL] fp32; bias: NULL or N_pad = PANEL * ceil(N / PANEL)
 * floats. Returns 0, or -1 when M is outside 1..MAX_ROWS. */
int f32_gemv(const float *x, int64_t x_stride, const float *wpacked, const float *bias,
             float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > MAX_ROWS) return -1;
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        const int64_t n0 = p * PANEL;
        const int64_t n_valid = N - n0 < PANEL ? N - n0 : PANEL;
        run_panel(x, x_stride, M, wpacked + p * K * PANEL, bias != NULL ? bias + n0 : NULL, y,
                  N, n0, n_valid, K);
    }
    return 0;
}
