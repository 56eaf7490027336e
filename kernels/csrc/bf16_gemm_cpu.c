/* bf16 linear on CPUs with AVX512-BF16: y[M, N] (fp32) = x[M, K] (bf16) . W^T + bias[N].
 *
 * The weight is packed once at load (`kernels/cpu_gemv.py`) into K-major panels of PANEL
 * output channels whose k steps come in pairs, the layout VDPBF16PS reads:
 *
 *     wpacked[p][j][c][h] = W[PANEL * p + c][2 * j + h]     j < K / 2, h in {0, 1}
 *
 * (N padded with zero rows; K must be even). One VDPBF16PS takes a broadcast pair
 * (x[m, 2j], x[m, 2j + 1]) against 16 channels' pairs and adds both exact bf16 x bf16
 * products to 16 fp32 accumulators, so a k pair costs one instruction where fp32 takes two
 * FMAs, and a weight is 2 bytes where fp32's is 4.
 *
 * The result is written as fp32 to y, or, with y16, rounded once to bf16 (nearest even, as
 * torch's .to(torch.bfloat16)) into y16, y then only holding the partial sums of K > GEMM_KC.
 *
 * Every output is one chain of VDPBF16PS over j in order 0..K/2-1 started from zero (fp32
 * accumulation, round to nearest even, bf16 denormals read as zero), plus bias[n] at the
 * end: the same operations whatever M and whichever entry point (bf16_gemv for up to
 * MAX_ROWS rows, bandwidth bound; bf16_gemm for any M, register-blocked as BLIS does), so a
 * row's result never depends on the other rows of the call.
 *
 * Source: Intel's AVX512_BF16 (Cooper Lake, 2020; AMD Zen 4); the pair-interleaved weight
 * is oneDNN's "VNNI" bf16 blocking; the GEMM blocking is Goto & van de Geijn (2008) / BLIS
 * (Van Zee & van de Geijn, 2015).
 */
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#ifndef PANEL
#define PANEL 64
#endif
#ifndef MAX_ROWS
#define MAX_ROWS 8
#endif
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2048
#endif
#define TILE_ROWS 4
#define PAIR_BYTES (PANEL * 4)
#define GEMM_MR 6
#ifndef GEMM_KC
#define GEMM_KC 1024
#endif
#define GEMM_MC 96

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define VECS (PANEL / 16)

typedef uint16_t bf16;

static inline __m512i pair_of(const bf16 *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return _mm512_set1_epi32(v);
}

static inline __m512 dot2(__m512 acc, __m512i x2, __m512i w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x2, (__m512bh)w);
}

/* fp32 -> bf16, round to nearest even (c10::BFloat16's rounding; NaN -> 0x7FC0). */
static inline __m256i to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r,
                                _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

static inline void panel_masks(int64_t n_valid, __mmask16 mask[VECS]) {
    for (int v = 0; v < VECS; v++) {
        const int64_t left = n_valid - 16 * v;
        mask[v] = left >= 16 ? (__mmask16)0xFFFF
                  : (left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1));
    }
}

/* mr rows x one panel over k pairs [0, kp) of a slice: acc from y (first: from zero); y gets
 * the partial sums, or when last the result plus bias (in y16 as bf16 when y16 is not NULL).
 * prefetch: stream-ahead for the GEMV. */
static inline __attribute__((always_inline)) void tile(
        const bf16 *x, int64_t x_stride, const int mr, const bf16 *w, int64_t kp, float *y,
        bf16 *y16, int64_t N, const int first, const int last, const float *b,
        const __mmask16 *mask, const int prefetch) {
    __m512 acc[GEMM_MR][VECS];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < VECS; v++)
            acc[i][v] = first ? _mm512_setzero_ps()
                              : _mm512_maskz_loadu_ps(mask[v], y + i * N + 16 * v);
    for (int64_t j = 0; j < kp; j++) {
        const bf16 *wj = w + j * (2 * PANEL);
        if (prefetch)
            for (int line = 0; line < PAIR_BYTES; line += 64)
                _mm_prefetch((const char *)wj + PREFETCH_AHEAD + line, _MM_HINT_T0);
        __m512i wv[VECS];
        for (int v = 0; v < VECS; v++) wv[v] = _mm512_loadu_si512(wj + 32 * v);
        for (int i = 0; i < mr; i++) {
            const __m512i xv = pair_of(x + i * x_stride + 2 * j);
            for (int v = 0; v < VECS; v++) acc[i][v] = dot2(acc[i][v], xv, wv[v]);
        }
    }
    for (int v = 0; v < VECS; v++) {
        const __m512 bv = (last && b != NULL) ? _mm512_loadu_ps(b + 16 * v)
                                              : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++) {
            if (last && y16 != NULL)
                _mm256_mask_storeu_epi16(y16 + i * N + 16 * v, mask[v],
                                         to_bf16(_mm512_add_ps(acc[i][v], bv)));
            else
                _mm512_mask_storeu_ps(y + i * N + 16 * v, mask[v],
                                      last ? _mm512_add_ps(acc[i][v], bv) : acc[i][v]);
        }
    }
}

/* The GEMV: tiles of 4 rows over a whole panel, streamed with prefetch. */
static void gemv_panel_rows(const bf16 *x, int64_t x_stride, int64_t M, const bf16 *w,
                            const float *b, float *y, bf16 *y16, int64_t N, int64_t n0,
                            int64_t n_valid, int64_t kp) {
    __mmask16 mask[VECS];
    panel_masks(n_valid, mask);
    for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const bf16 *xm = x + m0 * x_stride;
        float *ym = y16 != NULL ? NULL : y + m0 * N + n0;
        bf16 *ym16 = y16 != NULL ? y16 + m0 * N + n0 : NULL;
        switch (M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS) {
            case 4: tile(xm, x_stride, 4, w, kp, ym, ym16, N, 1, 1, b, mask, 1); break;
            case 3: tile(xm, x_stride, 3, w, kp, ym, ym16, N, 1, 1, b, mask, 1); break;
            case 2: tile(xm, x_stride, 2, w, kp, ym, ym16, N, 1, 1, b, mask, 1); break;
            default: tile(xm, x_stride, 1, w, kp, ym, ym16, N, 1, 1, b, mask, 1); break;
        }
    }
}

/* The GEMM: GEMM_MR-row micro-tiles over GEMM_KC-deep slices of one panel. */
static void gemm_item(const bf16 *x, int64_t x_stride, int64_t m0, int64_t m1, const bf16 *w,
                      const float *b, float *y, bf16 *y16, int64_t N, int64_t n0,
                      int64_t n_valid, int64_t K) {
    __mmask16 mask[VECS];
    panel_masks(n_valid, mask);
    for (int64_t k0 = 0; k0 < K; k0 += GEMM_KC) {
        const int64_t kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
        const int first = k0 == 0, last = k0 + kc == K;
        const bf16 *wk = w + k0 * PANEL;
        for (int64_t m = m0; m < m1; m += GEMM_MR) {
            const bf16 *xm = x + m * x_stride + k0;
            float *ym = y + m * N + n0;
            bf16 *ym16 = y16 != NULL ? y16 + m * N + n0 : NULL;
            const int64_t kp = kc / 2;
            switch (m1 - m < GEMM_MR ? m1 - m : GEMM_MR) {
                case 6: tile(xm, x_stride, 6, wk, kp, ym, ym16, N, first, last, b, mask, 0); break;
                case 5: tile(xm, x_stride, 5, wk, kp, ym, ym16, N, first, last, b, mask, 0); break;
                case 4: tile(xm, x_stride, 4, wk, kp, ym, ym16, N, first, last, b, mask, 0); break;
                case 3: tile(xm, x_stride, 3, wk, kp, ym, ym16, N, first, last, b, mask, 0); break;
                case 2: tile(xm, x_stride, 2, wk, kp, ym, ym16, N, first, last, b, mask, 0); break;
                default: tile(xm, x_stride, 1, wk, kp, ym, ym16, N, first, last, b, mask, 0); break;
            }
        }
    }
}

/* y [M, N] fp32 (row stride N) = x [M, K] bf16 (row stride x_stride) . W^T + bias, any
 * M >= 1; bit-identical to bf16_gemv. wpacked: ceil(N / PANEL) panels [K/2][PANEL][2] bf16;
 * bias: NULL or PANEL * ceil(N / PANEL) floats. y16: NULL, or [M, N] bf16 that gets the
 * result (y then holds partial sums only, and is not read or written when K <= GEMM_KC).
 * Returns 0, or -1 when M < 1 or K is odd. */
int bf16_gemm(const bf16 *x, int64_t x_stride, const bf16 *wpacked, const float *bias,
              float *y, bf16 *y16, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || K % 2 != 0) return -1;
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
                  bias != NULL ? bias + n0 : NULL, y, y16, N, n0, n_valid, K);
    }
    return 0;
}

/* As bf16_gemm for 1..MAX_ROWS rows, each thread streaming whole panels front to back (y
 * unused when y16 is given). Returns 0, or -1 when M is outside 1..MAX_ROWS or K is odd. */
int bf16_gemv(const bf16 *x, int64_t x_stride, const bf16 *wpacked, const float *bias,
              float *y, bf16 *y16, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || M > MAX_ROWS || K % 2 != 0) return -1;
    const int64_t num_panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_panels; p++) {
        const int64_t n0 = p * PANEL;
        const int64_t n_valid = N - n0 < PANEL ? N - n0 : PANEL;
        gemv_panel_rows(x, x_stride, M, wpacked + p * K * PANEL,
                        bias != NULL ? bias + n0 : NULL, y, y16, N, n0, n_valid, K / 2);
    }
    return 0;
}

/* The panel width this library was built with (the packer must agree). */
int bf16_gemv_panel(void) { return PANEL; }
#endif
