/* int8 x int8 linear on CPU with AVX-512 VNNI (vpdpbusd), W8A8:
 *
 *     y[M, N] = sum_b d[m, b] * (qa[m, block b] . q[n, block b]) * scale[n] + bias[n]
 *
 * Activations are quantized here, dynamically, per row and per block of QK consecutive k
 * (symmetric: d = max|x| / 127 over the block, qa = round_half_even(x * (1 / d)) in
 * [-127, 127]): llama.cpp's Q8_0 activation format (ggml `quantize_row_q8_0`, dot product
 * `ggml_vec_dot_q8_0_q8_0`: int dot per block, fp32 sum of block dot * scales). The weights
 * (symmetric per output channel, `kernels/cpu_int8.py`) are packed once at load time by
 * `kernels/cpu_int8_vnni.py` in the layout the tile reads, offset to unsigned:
 *
 *     wv[p][k / 4][c][k % 4] = q[32p + c][k] + 128      (uint8; 4 k of a column: one int32 lane)
 *
 * vpdpbusd multiplies unsigned by signed bytes (Intel VNNI, `_mm512_dpbusd_epi32`): the
 * weights are the unsigned operand, the activations the signed one (4 k of a row broadcast
 * to every lane), and each block's int32 accumulator starts at cs[m][b] = -128 * sum qa over
 * the block, which removes the offset exactly: (q + 128) . qa - 128 sum qa = q . qa. The int
 * dots are exact (|dot| <= QK * 127 * 127 < 2^24 for QK <= 1040: exact in fp32); the fp32
 * part is, per row and output, acc = fma(float(dot_b), d[m][b], acc) for b = 0, 1, ... then
 * fma(acc, scale[n], bias[n]): the same operations for a row whatever the rest of the batch
 * and whichever tile it lands in, so a row's result never depends on the other rows.
 *
 * Non-finite activations: a block holding a NaN gets d = NaN, one holding +-inf (and no NaN)
 * d = +inf with qa = +-127 at the infinities and 0 elsewhere, so the row's outputs come out
 * NaN / +-inf as fp32 would (never finite); a block with max|x| below FLT_MIN counts as zero.
 *
 * Schedule: the activations are quantized once per call (OpenMP over rows; up to
 * SERIAL_ROWS rows by the calling thread, which spares a barrier) into a buffer
 * kept per calling thread (grown, never shrunk); then OpenMP threads take (row block of
 * ROW_BLOCK rows, panel of 32 channels) items in row-block-major order, each run as tiles of
 * MR (6) rows x 32 columns: 12 int32 + 12 fp32 accumulators in zmm registers, the
 * activations read as embedded broadcasts, the panel (K x 32 bytes) from L1/L2, the row
 * block's activations from L2. With few rows (decode) every weight is read once. Built
 * without AVX-512 VNNI + BW the entry point returns -3 and `int8_vnni_available` 0 (the
 * caller then runs the weight-only path). Never built with -ffast-math (round-half-even and
 * the IEEE fp32 operations above are relied on).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 32
#define MR 6
#ifndef ROW_BLOCK
#define ROW_BLOCK 96  /* rows per work item: 96 x 1536 bytes of activations stay in L2 */
#endif
#define SERIAL_ROWS 16  /* up to this many rows the calling thread quantizes them */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1

/* x[K] fp32 -> q[K] int8, d[K / qk] fp32, cs[K / qk] = -128 * block sums of q. */
static void quantize_row(const float *x, int64_t K, int64_t qk, int8_t *q, float *d,
                         int32_t *cs) {
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    for (int64_t b = 0; b < K / qk; b++) {
        const float *xb = x + b * qk;
        __m512i mx = _mm512_setzero_si512();  /* max |x| as bits: NaN > inf > finite */
        for (int64_t i = 0; i < qk; i += 16)
            mx = _mm512_max_epi32(mx, _mm512_and_si512(_mm512_loadu_si512(xb + i), absmask));
        const int32_t bits = _mm512_reduce_max_epi32(mx);
        const int special = bits >= 0x7f800000;
        float amax, db = 0.0f, id = 0.0f;
        memcpy(&amax, &bits, sizeof amax);
        if (special) {
            db = bits > 0x7f800000 ? NAN : INFINITY;
        } else if (amax >= FLT_MIN) {
            db = amax / 127.0f;
            id = 1.0f / db;
        }
        const __m512 idv = _mm512_set1_ps(id);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < qk; i += 16) {
            const __m512 xv = _mm512_loadu_ps(xb + i);
            __m512i qv;
            if (special) {  /* +-127 at +-inf, 0 elsewhere (NaN included) */
                const __mmask16 pos = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
                const __mmask16 neg = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
                qv = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(pos, hi), neg, lo);
            } else {  /* cvtps rounds to nearest even (MXCSR default), like torch.round */
                qv = _mm512_cvtps_epi32(_mm512_mul_ps(xv, idv));
                qv = _mm512_max_epi32(_mm512_min_epi32(qv, hi), lo);
            }
            sum = _mm512_add_epi32(sum, qv);
            _mm_storeu_si128((__m128i *)(q + b * qk + i), _mm512_cvtepi32_epi8(qv));
        }
        d[b] = db;
        cs[b] = -128 * _mm512_reduce_add_epi32(sum);
    }
}

static inline __attribute__((always_inline)) int32_t load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* mb (<= MR) rows of quantized activations (q [mb][K], d and cs [mb][nb]) against one
 * packed panel wv [K / 4][32][4]: y[i][c] = acc[i][c] * s[c] + bias[c], n_valid columns. */
static inline __attribute__((always_inline)) void run_tile(
        const int8_t *q, const float *d, const int32_t *cs, const int mb, const uint8_t *wv,
        const int64_t K, const int64_t qk, float *y, const int64_t N, const int64_t n_valid,
        const float *s, const float *bias) {
    const int64_t nb = K / qk;
    __m512 f[MR][2];
    for (int i = 0; i < mb; i++) f[i][0] = f[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[MR][2];
        for (int i = 0; i < mb; i++) acc[i][0] = acc[i][1] = _mm512_set1_epi32(cs[i * nb + b]);
        const uint8_t *wb = wv + b * qk * PANEL;
        const int8_t *qb = q + b * qk;
#pragma GCC unroll 8
        for (int64_t g = 0; g < qk / 4; g++) {
            const __m512i w0 = _mm512_loadu_si512(wb + g * 4 * PANEL);
            const __m512i w1 = _mm512_loadu_si512(wb + g * 4 * PANEL + 64);
            for (int i = 0; i < mb; i++) {
                const __m512i av = _mm512_set1_epi32(load4(qb + i * K + g * 4));
                acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], w0, av);
                acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], w1, av);
            }
        }
        for (int i = 0; i < mb; i++) {
            const __m512 dv = _mm512_set1_ps(d[i * nb + b]);
            f[i][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][0]), dv, f[i][0]);
            f[i][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][1]), dv, f[i][1]);
        }
    }
    const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
    const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
    const __mmask16 k0 = n_valid >= 16 ? 0xFFFF : (__mmask16)((1u << n_valid) - 1);
    const __mmask16 k1 = n_valid >= 32 ? 0xFFFF
                         : (n_valid <= 16 ? 0 : (__mmask16)((1u << (n_valid - 16)) - 1));
    for (int i = 0; i < mb; i++) {
        _mm512_mask_storeu_ps(y + i * N, k0, _mm512_fmadd_ps(f[i][0], s0, b0));
        _mm512_mask_storeu_ps(y + i * N + 16, k1, _mm512_fmadd_ps(f[i][1], s1, b1));
    }
}

/* rows [m0, m1) against panel wv; qk == 32 (Q8_0's block) gets its own unrolled copy. */
#define TILE(MB, QK) run_tile(q + m * K, d + m * nb, cs + m * nb, MB, wv, K, QK, y + m * N, N, \
                              n_valid, s, bias)
#define PANEL_ROWS(QK)                                                   \
    do {                                                                 \
        int64_t m = m0;                                                  \
        for (; m + MR <= m1; m += MR) TILE(MR, QK);                      \
        switch (m1 - m) {                                                \
            case 5: TILE(5, QK); break;                                  \
            case 4: TILE(4, QK); break;                                  \
            case 3: TILE(3, QK); break;                                  \
            case 2: TILE(2, QK); break;                                  \
            case 1: TILE(1, QK); break;                                  \
            default: break;                                              \
        }                                                                \
    } while (0)

static void run_panel(const int8_t *q, const float *d, const int32_t *cs, int64_t m0,
                      int64_t m1, const uint8_t *wv, int64_t K, int64_t qk, float *y, int64_t N,
                      int64_t n_valid, const float *s, const float *bias) {
    const int64_t nb = K / qk;
    if (qk == 32)
        PANEL_ROWS(32);
    else
        PANEL_ROWS(qk);
}

/* The quantized activations of the calling thread's last call, grown as needed. */
static _Thread_local void *buffer = NULL;
static _Thread_local size_t buffer_bytes = 0;

static void *get_buffer(size_t bytes) {
    if (bytes > buffer_bytes) {
        free(buffer);
        buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
        buffer_bytes = buffer != NULL ? bytes : 0;
    }
    return buffer;
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

/* y [M, N] (row stride N) = the W8A8 product above. x: [M, K] fp32, row stride x_stride,
 * unit column stride; wv: ceil(N / 32) packed panels [K / 4][32][4] uint8 (q + 128);
 * scale, bias: 32 * ceil(N / 32) floats. qk: the activation block (a multiple of 16 dividing
 * K). Returns 0; -1 when the buffer could not be allocated; -2 for a bad qk; -3 without
 * VNNI. Not reentrant per calling thread only in that it reuses that thread's buffer. */
int int8_vnni_linear_f32(const float *x, int64_t x_stride, const uint8_t *wv,
                         const float *scale, const float *bias, float *y, int64_t M,
                         int64_t N, int64_t K, int64_t qk, int num_threads) {
#ifdef HAVE_VNNI
    if (qk <= 0 || qk % 16 != 0 || K % qk != 0) return -2;
    const int64_t nb = K / qk, num_panels = (N + PANEL - 1) / PANEL;
    const int64_t q_bytes = (M * K + 63) / 64 * 64, s_bytes = (M * nb * 4 + 63) / 64 * 64;
    char *buf = (char *)get_buffer((size_t)(q_bytes + 2 * s_bytes));
    if (buf == NULL) return -1;
    int8_t *q = (int8_t *)buf;
    float *d = (float *)(buf + q_bytes);
    int32_t *cs = (int32_t *)(buf + q_bytes + s_bytes);
    const int64_t num_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    const int serial = M <= SERIAL_ROWS;
    if (serial)  /* a few rows: by the calling thread, no barrier inside the region */
        for (int64_t m = 0; m < M; m++)
            quantize_row(x + m * x_stride, K, qk, q + m * K, d + m * nb, cs + m * nb);
#pragma omp parallel num_threads(num_threads)
    {
        if (!serial) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++)
                quantize_row(x + m * x_stride, K, qk, q + m * K, d + m * nb, cs + m * nb);
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < num_blocks; r++) {
            for (int64_t p = 0; p < num_panels; p++) {
                const int64_t m0 = r * ROW_BLOCK, m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
                const int64_t n0 = p * PANEL, n_valid = N - n0 < PANEL ? N - n0 : PANEL;
                run_panel(q, d, cs, m0, m1, wv + p * K * PANEL, K, qk, y + n0, N, n_valid,
                          scale + n0, bias + n0);
            }
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)wv; (void)scale; (void)bias; (void)y; (void)M;
    (void)N; (void)K; (void)qk; (void)num_threads;
    return -3;
#endif
}
