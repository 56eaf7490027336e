/* int8 x int8 linear on CPU with AVX-512 VNNI (vpdpbusd), W8A8:
 *
 *     y[M, N] = sum_b a_scale[m, b] * (qa[m, block b] . q[n, block b]) * scale[n] + bias[n]
 *
 * Activations are quantized here, dynamically, per row and per block of QK consecutive k
 * (symmetric: d = max|x| / 127 over the block, qa = round_half_even(x * (1 / d)) in
 * [-127, 127], d = 0 gives qa = 0): llama.cpp's Q8_0 activation format (ggml
 * `quantize_row_q8_0`, dot product `ggml_vec_dot_q8_0_q8_0`: int dot per block, fp32 sum
 * of block dot * scales). The weights stay as `kernels/cpu_int8.py` packs them (symmetric per
 * output channel, K-major panels of 32 channels, qpacked[p][k][c] = q[32p + c][k]) and are
 * re-packed on the fly (see Paths) into the VNNI layout
 *
 *     wv[k / 4][c][k % 4]      (4 consecutive k of one column adjacent: one int32 lane)
 *
 * and computes, per block, corr[b][c] = -128 * sum_{k in b} q[c][k].
 *
 * vpdpbusd multiplies unsigned by signed bytes (Intel VNNI, `_mm512_dpbusd_epi32`), so the
 * activations are stored offset, qa + 128 in [1, 255], and the int32 accumulator of each
 * block starts at corr[b][c], which removes the offset exactly: (qa + 128) . q - 128 sum q.
 * The int32 dots are exact (|dot| <= QK * 127 * 127 < 2^24 for QK <= 1040: exact in fp32); the
 * fp32 part is, per row and output, acc = fma(float(dot_b), d[m][b], acc) for b = 0, 1, ...
 * then fma(acc, scale[n], bias[n]): the same operations for a row whatever the rest of the
 * batch (either path, any tile), so a row's result does not depend on the other rows.
 *
 * Paths: with up to DIRECT_ROWS (16) rows each panel is read once as stored and re-packed in
 * registers 4 k at a time (vpermt2b with AVX-512 VBMI, else unpacks), the block sums taken on
 * the way, tiles of 4 rows (a decode step of a few streams reads the int8 weights once, at
 * memory speed); with more rows each thread re-packs its panel into a buffer once per call
 * and runs tiles of 6 rows x 32 columns, 12 int32 + 12 fp32 accumulators in zmm registers.
 * Both give the same integers and fp32 operations. OpenMP threads quantize rows, then take
 * panels. Built without AVX-512 VNNI + BW the entry point returns -3 and
 * `int8_vnni_available` 0 (the caller then uses `int8_linear_cpu.c`). Never built with
 * -ffast-math (round-half-even and the IEEE fp32 operations above are relied on).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 32
#define MR 6
#ifndef DIRECT_ROWS
#define DIRECT_ROWS 16  /* up to this many rows: run_panel_direct (micro-timed) */
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1

/* x[K] fp32 -> a[K] u8 (q + 128), d[K / qk] fp32 (qk a multiple of 16). */
static void quantize_row(const float *x, int64_t K, int64_t qk, uint8_t *a, float *d) {
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m512i offset = _mm512_set1_epi32(128);
    for (int64_t b = 0; b < K / qk; b++) {
        const float *xb = x + b * qk;
        __m512 mx = _mm512_setzero_ps();
        for (int64_t i = 0; i < qk; i += 16)
            mx = _mm512_max_ps(mx, _mm512_and_ps(_mm512_loadu_ps(xb + i), absmask));
        const float db = _mm512_reduce_max_ps(mx) / 127.0f;
        const __m512 id = _mm512_set1_ps(db != 0.0f ? 1.0f / db : 0.0f);
        d[b] = db;
        for (int64_t i = 0; i < qk; i += 16) {
            /* cvtps rounds to nearest even (MXCSR default), like torch.round */
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), id));
            q = _mm512_add_epi32(_mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)),
                                                  _mm512_set1_epi32(-127)), offset);
            _mm_storeu_si128((__m128i *)(a + b * qk + i), _mm512_cvtepi32_epi8(q));
        }
    }
}

/* 4 consecutive k of a panel (qp [4][32]) -> the VNNI layout: w0 = columns 0-15, w1 = 16-31,
 * each int32 lane the 4 k of one column. */
static inline __attribute__((always_inline)) void vnni_group(const int8_t *qp, __m512i *w0,
                                                             __m512i *w1) {
#if defined(__AVX512VBMI__)
    /* byte 4c + j of w0 is byte 32j + c of qp (j < 2: the first zmm, else the second) */
    const __m512i idx0 = _mm512_set_epi8(
        111, 79, 47, 15, 110, 78, 46, 14, 109, 77, 45, 13, 108, 76, 44, 12,
        107, 75, 43, 11, 106, 74, 42, 10, 105, 73, 41, 9, 104, 72, 40, 8,
        103, 71, 39, 7, 102, 70, 38, 6, 101, 69, 37, 5, 100, 68, 36, 4,
        99, 67, 35, 3, 98, 66, 34, 2, 97, 65, 33, 1, 96, 64, 32, 0);
    const __m512i idx1 = _mm512_add_epi8(idx0, _mm512_set1_epi8(16));
    const __m512i lo = _mm512_loadu_si512(qp), hi = _mm512_loadu_si512(qp + 64);
    *w0 = _mm512_permutex2var_epi8(lo, idx0, hi);
    *w1 = _mm512_permutex2var_epi8(lo, idx1, hi);
#else
    const __m256i r0 = _mm256_loadu_si256((const __m256i *)(qp + 0 * PANEL));
    const __m256i r1 = _mm256_loadu_si256((const __m256i *)(qp + 1 * PANEL));
    const __m256i r2 = _mm256_loadu_si256((const __m256i *)(qp + 2 * PANEL));
    const __m256i r3 = _mm256_loadu_si256((const __m256i *)(qp + 3 * PANEL));
    /* per 128-bit lane (columns 0-15 | 16-31): bytes, then pairs, interleaved */
    const __m256i t0 = _mm256_unpacklo_epi8(r0, r1), t1 = _mm256_unpackhi_epi8(r0, r1);
    const __m256i t2 = _mm256_unpacklo_epi8(r2, r3), t3 = _mm256_unpackhi_epi8(r2, r3);
    const __m256i u0 = _mm256_unpacklo_epi16(t0, t2);  /* cols 0-3  | 16-19 */
    const __m256i u1 = _mm256_unpackhi_epi16(t0, t2);  /* cols 4-7  | 20-23 */
    const __m256i u2 = _mm256_unpacklo_epi16(t1, t3);  /* cols 8-11 | 24-27 */
    const __m256i u3 = _mm256_unpackhi_epi16(t1, t3);  /* cols 12-15 | 28-31 */
    *w0 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(u0, u1, 0x20)),
                             _mm256_permute2x128_si256(u2, u3, 0x20), 1);
    *w1 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(u0, u1, 0x31)),
                             _mm256_permute2x128_si256(u2, u3, 0x31), 1);
#endif
}

/* qp [K][32] int8 -> wv [K / 4][32][4] int8, corr [K / qk][32] = -128 * block sums. */
static void repack_panel(const int8_t *qp, int64_t K, int64_t qk, int8_t *wv, int32_t *corr) {
    for (int64_t k = 0; k < K; k += 4) {
        __m512i w0, w1;
        vnni_group(qp + k * PANEL, &w0, &w1);
        _mm512_storeu_si512(wv + k * PANEL, w0);
        _mm512_storeu_si512(wv + k * PANEL + 64, w1);
    }
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t b = 0; b < K / qk; b++) {
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int64_t k = b * qk; k < (b + 1) * qk; k += 4) {
            s0 = _mm512_dpbusd_epi32(s0, ones, _mm512_loadu_si512(wv + k * PANEL));
            s1 = _mm512_dpbusd_epi32(s1, ones, _mm512_loadu_si512(wv + k * PANEL + 64));
        }
        _mm512_storeu_si512(corr + b * PANEL, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                               _mm512_slli_epi32(s0, 7)));
        _mm512_storeu_si512(corr + b * PANEL + 16,
                            _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s1, 7)));
    }
}

static inline __attribute__((always_inline)) int32_t load4(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* y[i][n0 + c] = acc[i][c] * s[c] + bias[c] for the n_valid (<= 32) columns of mb rows. */
static inline __attribute__((always_inline)) void store_rows(
        __m512 accf[][2], const int mb, float *y, int64_t N, int64_t n0, int64_t n_valid,
        const float *s, const float *bias) {
    const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
    const __mmask16 k0 = n_valid >= 16 ? 0xFFFF : (__mmask16)((1u << n_valid) - 1);
    const __mmask16 k1 = n_valid >= 32 ? 0xFFFF
                         : (n_valid <= 16 ? 0 : (__mmask16)((1u << (n_valid - 16)) - 1));
    for (int i = 0; i < mb; i++) {
        float *row = y + i * N + n0;
        _mm512_mask_storeu_ps(row, k0, _mm512_fmadd_ps(accf[i][0], s0, b0));
        _mm512_mask_storeu_ps(row + 16, k1, _mm512_fmadd_ps(accf[i][1], s1, b1));
    }
}

/* mb (<= MR) rows of offset activations a [mb][K] (scales ad [mb][nb]) against one re-packed
 * panel, then y = acc * scale + bias for the n_valid columns. */
static inline __attribute__((always_inline)) void run_tile(
        const uint8_t *a, const float *ad, const int mb, const int8_t *wv, const int32_t *corr,
        int64_t K, int64_t qk, float *y, int64_t N, int64_t n0, int64_t n_valid,
        const float *s, const float *bias) {
    const int64_t nb = K / qk;
    __m512 accf[MR][2];
    for (int i = 0; i < mb; i++) accf[i][0] = accf[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512i c0 = _mm512_loadu_si512(corr + b * PANEL);
        const __m512i c1 = _mm512_loadu_si512(corr + b * PANEL + 16);
        __m512i acc[MR][2];
        for (int i = 0; i < mb; i++) { acc[i][0] = c0; acc[i][1] = c1; }
        const int8_t *wb = wv + b * qk * PANEL;
        const uint8_t *ab = a + b * qk;
        for (int64_t g = 0; g < qk / 4; g++) {
            const __m512i w0 = _mm512_loadu_si512(wb + g * 4 * PANEL);
            const __m512i w1 = _mm512_loadu_si512(wb + g * 4 * PANEL + 64);
            for (int i = 0; i < mb; i++) {
                const __m512i av = _mm512_set1_epi32(load4(ab + i * K + g * 4));
                acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], av, w0);
                acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], av, w1);
            }
        }
        for (int i = 0; i < mb; i++) {
            const __m512 dv = _mm512_set1_ps(ad[i * nb + b]);
            accf[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][0]), dv, accf[i][0]);
            accf[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][1]), dv, accf[i][1]);
        }
    }
    store_rows(accf, mb, y, N, n0, n_valid, s, bias);
}

/* mb (<= 4) rows against the panel as stored (qp [K][32]), re-packed in registers per 4 k
 * and the block sums taken on the way: the same integers and fp32 operations as run_tile
 * (the weights are read once, as int8: a decode step of a few streams is bound by that). */
static inline __attribute__((always_inline)) void run_tile_direct(
        const uint8_t *a, const float *ad, const int mb, const int8_t *qp, int64_t K,
        int64_t qk, float *y, int64_t N, int64_t n0, int64_t n_valid, const float *s,
        const float *bias) {
    const int64_t nb = K / qk;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 accf[4][2];
    for (int i = 0; i < mb; i++) accf[i][0] = accf[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[4][2], s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        for (int i = 0; i < mb; i++) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
        for (int64_t g = 0; g < qk / 4; g++) {
            __m512i w0, w1;
            vnni_group(qp + (b * qk + 4 * g) * PANEL, &w0, &w1);
            s0 = _mm512_dpbusd_epi32(s0, ones, w0);
            s1 = _mm512_dpbusd_epi32(s1, ones, w1);
            for (int i = 0; i < mb; i++) {
                const __m512i av = _mm512_set1_epi32(load4(a + i * K + b * qk + g * 4));
                acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], av, w0);
                acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], av, w1);
            }
        }
        s0 = _mm512_slli_epi32(s0, 7);
        s1 = _mm512_slli_epi32(s1, 7);
        for (int i = 0; i < mb; i++) {
            const __m512 dv = _mm512_set1_ps(ad[i * nb + b]);
            accf[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][0], s0)),
                                         dv, accf[i][0]);
            accf[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][1], s1)),
                                         dv, accf[i][1]);
        }
    }
    store_rows(accf, mb, y, N, n0, n_valid, s, bias);
}

#define TILE(MB) run_tile(a + m0 * K, ad + m0 * nb, MB, wv, corr, K, qk, y + m0 * N, N, n0, \
                          n_valid, s, bias)

static void run_panel(const uint8_t *a, const float *ad, int64_t M, const int8_t *wv,
                      const int32_t *corr, int64_t K, int64_t qk, float *y, int64_t N,
                      int64_t n0, int64_t n_valid, const float *s, const float *bias) {
    const int64_t nb = K / qk;
    int64_t m0 = 0;
    for (; m0 + MR <= M; m0 += MR) TILE(MR);
    switch (M - m0) {
        case 5: TILE(5); break;
        case 4: TILE(4); break;
        case 3: TILE(3); break;
        case 2: TILE(2); break;
        case 1: TILE(1); break;
        default: break;
    }
}

#define DIRECT(MB) run_tile_direct(a + m0 * K, ad + m0 * nb, MB, qp, K, qk, y + m0 * N, N, \
                                   n0, n_valid, s, bias)

static void run_panel_direct(const uint8_t *a, const float *ad, int64_t M, const int8_t *qp,
                             int64_t K, int64_t qk, float *y, int64_t N, int64_t n0,
                             int64_t n_valid, const float *s, const float *bias) {
    const int64_t nb = K / qk;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) DIRECT(4);
    switch (M - m0) {
        case 3: DIRECT(3); break;
        case 2: DIRECT(2); break;
        case 1: DIRECT(1); break;
        default: break;
    }
}
#endif

/* 1 when this build has the VNNI path and the CPU running it supports AVX-512 VNNI and BW. */
int int8_vnni_available(void) {
#ifdef HAVE_VNNI
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

/* y [M, N] (row stride N) = W8A8 product above. x: [M, K] fp32, row stride x_stride, unit
 * column stride; qpacked: ceil(N / 32) panels [K][32] int8 in [-127, 127]; scale, bias:
 * 32 * ceil(N / 32) floats. qk: the activation block (a multiple of 16, dividing K).
 * Returns 0; -1 when a buffer could not be allocated; -2 for a bad qk; -3 without VNNI. */
int int8_vnni_linear_f32(const float *x, int64_t x_stride, const int8_t *qpacked,
                         const float *scale, const float *bias, float *y, int64_t M,
                         int64_t N, int64_t K, int64_t qk, int num_threads) {
#ifdef HAVE_VNNI
    if (qk <= 0 || qk % 16 != 0 || K % qk != 0) return -2;
    const int64_t nb = K / qk, num_panels = (N + PANEL - 1) / PANEL;
    uint8_t *a = (uint8_t *)malloc((size_t)(M * K) + 64);
    float *ad = (float *)malloc((size_t)(M * nb) * sizeof(float) + 64);
    if (a == NULL || ad == NULL) {
        free(a);
        free(ad);
        return -1;
    }
    int failed = 0;
    const int direct = M <= DIRECT_ROWS;
    if (direct)  /* a few rows: quantized by the calling thread, no barrier in the region */
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * x_stride, K, qk, a + m * K,
                                                     ad + m * nb);
#pragma omp parallel num_threads(num_threads)
    {
        int8_t *wv = NULL;
        int32_t *corr = NULL;
        if (!direct) {  /* the same for every thread */
            wv = (int8_t *)aligned_alloc(64, (size_t)(K * PANEL));
            corr = (int32_t *)aligned_alloc(64, (size_t)(nb * PANEL) * sizeof(int32_t));
            if (wv == NULL || corr == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) quantize_row(x + m * x_stride, K, qk, a + m * K,
                                                         ad + m * nb);
            /* (its implicit barrier also publishes `failed`) */
        }
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++) {
                const int64_t n0 = p * PANEL;
                const int64_t n_valid = N - n0 < PANEL ? N - n0 : PANEL;
                const int8_t *qp = qpacked + p * K * PANEL;
                const float *s = scale + n0, *b = bias + n0;
                if (direct) {  /* few rows: no re-packed copy of the panel */
                    run_panel_direct(a, ad, M, qp, K, qk, y, N, n0, n_valid, s, b);
                } else {
                    repack_panel(qp, K, qk, wv, corr);
                    run_panel(a, ad, M, wv, corr, K, qk, y, N, n0, n_valid, s, b);
                }
            }
        }
        free(wv);
        free(corr);
    }
    free(a);
    free(ad);
    return failed ? -1 : 0;
#else
    (void)x; (void)x_stride; (void)qpacked; (void)scale; (void)bias; (void)y; (void)M;
    (void)N; (void)K; (void)qk; (void)num_threads;
    return -3;
#endif
}
