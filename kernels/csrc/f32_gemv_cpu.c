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
 *
 * bf16 weights have their own kernel (`bf16_gemm_cpu.c`, VDPBF16PS over k pairs).
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

typedef float wtype;
#define ENTRY(name) f32_##name
static inline float w_to_f(float w) { return w; }
#define W_ROW_BYTES (PANEL * (int)sizeof(wtype))

#if defined(__AVX512F__)
#include <immintrin.h>

#define VECS (PANEL / 16)
#define LOAD_W(p) _mm512_loadu_ps(p)

/* mb (<= TILE_ROWS) rows against one panel [K][PANEL]. */
static inline __attribute__((always_inline)) void panel_rows(
        const float *x, int64_t x_stride, const int mb, const wtype *w, int64_t K,
        const float *b, float *y, int64_t N, int64_t n0, int64_t n_valid) {
    __m512 acc[TILE_ROWS][VECS];
    for (int i = 0; i < mb; i++)
        for (int v = 0; v < VECS; v++) acc[i][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const wtype *wk = w + k * PANEL;
        for (int line = 0; line < W_ROW_BYTES; line += 64)
            _mm_prefetch((const char *)wk + PREFETCH_AHEAD + line, _MM_HINT_T0);
        __m512 wv[VECS];
        for (int v = 0; v < VECS; v++) wv[v] = LOAD_W(wk + 16 * v);
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

static void run_panel(const float *x, int64_t x_stride, int64_t M, const wtype *w,
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
static void run_panel(const float *x, int64_t x_stride, int64_t M, const wtype *w,
                      const float *b, float *y, int64_t N, int64_t n0, int64_t n_valid,
                      int64_t K) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < n_valid; c++) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++)
                acc = __builtin_fmaf(x[m * x_stride + k], w_to_f(w[k * PANEL + c]), acc);
            y[m * N + n0 + c] = acc + (b != NULL ? b[c] : 0.f);
        }
}
#endif

/* ---- Any number of rows: a blocked GEMM over the same panels (prefill, wide batches). ----
 *
 * The panels are the packed-B operand of a GotoBLAS/BLIS-style GEMM (Goto & van de Geijn,
 * 2008; Van Zee & van de Geijn, 2015) with nr = PANEL: a micro-tile of GEMM_MR rows by one
 * panel keeps GEMM_MR x PANEL / 16 accumulators in registers while k runs over a GEMM_KC
 * chunk of the panel (kept in L1/L2), then leaves the partial sums in y and goes on with the
 * next chunk. Every output is still one fp32 FMA chain over k in order 0..K-1 started from
 * zero, with the bias added last (a partial sum stored and reloaded is the same fp32
 * value): bit for bit what f32_gemv gives, so a row's result never depends on M.
 *
 * Work items are (panel, block of GEMM_MC rows), panel-major, so a thread's consecutive
 * items read the same panel from its L2.
 */
#ifndef GEMM_MR
#define GEMM_MR 6
#endif
#ifndef GEMM_KC
#define GEMM_KC 256
#endif
#ifndef GEMM_MC
#define GEMM_MC 96
#endif

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void gemm_tile(
        const float *x, int64_t x_stride, const int mr, const wtype *w, int64_t kc,
        float *y, int64_t N, const int first, const int last, const float *b,
        __mmask16 mask[VECS]) {
    __m512 acc[GEMM_MR][VECS];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < VECS; v++)
            acc[i][v] = first ? _mm512_setzero_ps()
                              : _mm512_maskz_loadu_ps(mask[v], y + i * N + 16 * v);
    for (int64_t k = 0; k < kc; k++) {
        const wtype *wk = w + k * PANEL;
        __m512 wv[VECS];
        for (int v = 0; v < VECS; v++) wv[v] = LOAD_W(wk + 16 * v);
        for (int i = 0; i < mr; i++) {
            __m512 xv = _mm512_set1_ps(x[i * x_stride + k]);
            for (int v = 0; v < VECS; v++) acc[i][v] = _mm512_fmadd_ps(xv, wv[v], acc[i][v]);
        }
    }
    for (int v = 0; v < VECS; v++) {
        __m512 bv = (last && b != NULL) ? _mm512_loadu_ps(b + 16 * v) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            _mm512_mask_storeu_ps(y + i * N + 16 * v, mask[v],
                                  last ? _mm512_add_ps(acc[i][v], bv) : acc[i][v]);
    }
}

static void gemm_item(const float *x, int64_t x_stride, int64_t m0, int64_t m1,
                      const wtype *w, const float *b, float *y, int64_t N, int64_t n0,
                      int64_t n_valid, int64_t K) {
    __mmask16 mask[VECS];
    for (int v = 0; v < VECS; v++) {
        const int64_t left = n_valid - 16 * v;
        mask[v] = left >= 16 ? (__mmask16)0xFFFF
                  : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1));
    }
    for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
        const int64_t kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
        const int first = k0 == 0, last = k0 + kc == K;
        for (int64_t m = m0; m < m1; m += GEMM_MR) {
            const float *xm = x + m * x_stride + k0;
            float *ym = y + m * N + n0;
            const wtype *wk = w + k0 * PANEL;
            switch (m1 - m < GEMM_MR ? m1 - m : GEMM_MR) {
                case 6: gemm_tile(xm, x_stride, 6, wk, kc, ym, N, first, last, b, mask); break;
                case 5: gemm_tile(xm, x_stride, 5, wk, kc, ym, N, first, last, b, mask); break;
                case 4: gemm_tile(xm, x_stride, 4, wk, kc, ym, N, first, last, b, mask); break;
                case 3: gemm_tile(xm, x_stride, 3, wk, kc, ym, N, first, last, b, mask); break;
                case 2: gemm_tile(xm, x_stride, 2, wk, kc, ym, N, first, last, b, mask); break;
                default: gemm_tile(xm, x_stride, 1, wk, kc, ym, N, first, last, b, mask); break;
            }
        }
    }
}
#else
static void gemm_item(const float *x, int64_t x_stride, int64_t m0, int64_t m1,
                      const wtype *w, const float *b, float *y, int64_t N, int64_t n0,
                      int64_t n_valid, int64_t K) {
    run_panel(x + m0 * x_stride, x_stride, m1 - m0, w, b, y + m0 * N, N, n0, n_valid, K);
}
#endif

/* As f32_gemv for any M >= 1 (bit-identical results). Returns 0, or -1 when M < 1. */
int ENTRY(gemm)(const float *x, int64_t x_stride, const wtype *wpacked, const float *bias,
             float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1) return -1;
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
    /* Blocks of up to GEMM_MC rows, smaller (a multiple of GEMM_MR) while there are fewer
     * than 4 items per thread, or while the items split unevenly over the threads (9 panels
     * on 2 threads: one waits a ninth of the call), so that few panels still spread evenly. */
    int64_t mc = GEMM_MC;
    for (;;) {
        const int64_t items = num_panels * ((M + mc - 1) / mc);
        const int64_t per_thread = (items + num_threads - 1) / num_threads;
        const int uneven = per_thread * num_threads * 20 > items * 21; /* > 5% idle */
        if (mc <= GEMM_MR || (items >= 4 * (int64_t)num_threads && !uneven)) break;
        mc = ((mc / 2 + GEMM_MR - 1) / GEMM_MR) * GEMM_MR;
    }
    const int64_t num_mblocks = (M + mc - 1) / mc;
    const int64_t num_items = num_panels * num_mblocks;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t item = 0; item < num_items; item++) {
        const int64_t p = item / num_mblocks, mb = item % num_mblocks;
        const int64_t n0 = p * PANEL;
        const int64_t n_valid = N - n0 < PANEL ? N - n0 : PANEL;
        const int64_t m0 = mb * mc;
        const int64_t m1 = M - m0 < mc ? M : m0 + mc;
        gemm_item(x, x_stride, m0, m1, wpacked + p * K * PANEL,
                  bias != NULL ? bias + n0 : NULL, y, N, n0, n_valid, K);
    }
    return 0;
}

/* The panel width this library was built with (the packer must agree). */
int ENTRY(gemv_panel)(void) { return PANEL; }

/* y [M, N] (row stride N) = x [M, K] (row stride x_stride) . W^T + bias. wpacked:
 * ceil(N / PANEL) panels [K][PANEL] fp32; bias: NULL or N_pad = PANEL * ceil(N / PANEL)
 * floats. Returns 0, or -1 when M is outside 1..MAX_ROWS. */
int ENTRY(gemv)(const float *x, int64_t x_stride, const wtype *wpacked, const float *bias,
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
