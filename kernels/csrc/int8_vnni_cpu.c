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
 * 16-bit activations (act_bits 16, `Int8Weight.a16`): qa in [-A16_MAX, A16_MAX] per block
 * (d = max|x| / A16_MAX), split as qa = 256 * hi + lo with hi, lo int8, and run as two
 * vpdpbusd per 4 k (MR16 = 4 rows per tile): dot = 256 * (q + 128) . hi + (q + 128) . lo + cs,
 * |dot| < 2^31 for QK <= 256; about weight-only int8's accuracy at half the W8A8 rate.
 *
 * Non-finite activations: a block holding a NaN gets d = NaN, one holding +-inf (and no NaN)
 * d = +inf with qa = +-127 at the infinities and 0 elsewhere, so the row's outputs come out
 * NaN / +-inf as fp32 would (never finite); a block with max|x| below FLT_MIN counts as zero.
 *
 * Schedule: the activations are quantized once per call (OpenMP over rows; up to
 * SERIAL_ROWS rows by the calling thread, which spares a barrier) into a buffer
 * kept per calling thread (grown, never shrunk); then OpenMP threads take (row block of
 * ROW_BLOCK rows, panel of 32 channels) items in row-block-major order, each run as tiles of
 * MR (6) rows x 32 columns: 12 int32 + 12 fp32 accumulators in zmm registers, 4 bytes of
 * a row's activations broadcast per 4 k, the panel (K x 32 bytes) from L1/L2, the row
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
#define MR16 4  /* rows per tile with 16-bit activations (twice the accumulators) */
#define A16_MAX 32639  /* 127 * 257: 16-bit activations v = 256 q + lo, q and lo int8 */
#ifndef ROW_BLOCK
#define ROW_BLOCK 96  /* rows per work item: 96 x 1536 bytes of activations stay in L2 */
#endif
#define SERIAL_ROWS 16  /* up to this many rows the calling thread quantizes them */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define HAVE_VNNI 1

/* x[K] fp32 -> the activations of QK-blocks: 8 bits: q[K] int8 in [-127, 127]; 16 bits
 * (lo != NULL): v = 256 * q + lo in [-A16_MAX, A16_MAX], q and lo int8. d[K / qk] fp32 (the
 * step), cs[K / qk] = -128 * block sums of q (8 bits) or of v (16 bits). */
static void quantize_row(const float *x, int64_t K, int64_t qk, int8_t *q, int8_t *lo,
                         float *d, int32_t *cs) {
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    const int32_t vmax = lo != NULL ? A16_MAX : 127;
    const __m512i hi = _mm512_set1_epi32(vmax), low = _mm512_set1_epi32(-vmax);
    const __m512i qinf = _mm512_set1_epi32(127), off = _mm512_set1_epi32(128);
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
            db = amax / (float)vmax;
            id = 1.0f / db;
        }
        const __m512 idv = _mm512_set1_ps(id);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < qk; i += 16) {
            const __m512 xv = _mm512_loadu_ps(xb + i);
            __m512i qv, lv = _mm512_setzero_si512();
            if (special) {  /* q = +-127 at +-inf, 0 elsewhere (NaN included); lo = 0 */
                const __mmask16 pos = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
                const __mmask16 neg = _mm512_cmp_ps_mask(xv, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
                qv = _mm512_mask_mov_epi32(_mm512_maskz_mov_epi32(pos, qinf), neg,
                                           _mm512_sub_epi32(_mm512_setzero_si512(), qinf));
                sum = _mm512_add_epi32(sum, lo != NULL ? _mm512_slli_epi32(qv, 8) : qv);
            } else {  /* cvtps rounds to nearest even (MXCSR default), like torch.round */
                qv = _mm512_cvtps_epi32(_mm512_mul_ps(xv, idv));
                qv = _mm512_max_epi32(_mm512_min_epi32(qv, hi), low);
                sum = _mm512_add_epi32(sum, qv);
                if (lo != NULL) {  /* v = 256 q + lo, lo in [-128, 127] */
                    lv = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(qv, off),
                                                           _mm512_set1_epi32(255)), off);
                    qv = _mm512_srai_epi32(_mm512_sub_epi32(qv, lv), 8);
                }
            }
            _mm_storeu_si128((__m128i *)(q + b * qk + i), _mm512_cvtepi32_epi8(qv));
            if (lo != NULL) _mm_storeu_si128((__m128i *)(lo + b * qk + i), _mm512_cvtepi32_epi8(lv));
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

/* mb (<= MR; <= MR16 with a16) rows of quantized activations (q [mb][K], with a16 also lo
 * [mb][K]; d and cs [mb][nb]) against one packed panel wv [K / 4][32][4]:
 * y[i][c] = acc[i][c] * s[c] + bias[c] for the n_valid columns. */
static inline __attribute__((always_inline)) void run_tile(
        const int8_t *q, const int8_t *lo, const int a16, const float *d, const int32_t *cs,
        const int mb, const uint8_t *wv, const int64_t K, const int64_t qk, float *y,
        const int64_t N, const int64_t n_valid, const float *s, const float *bias) {
    const int64_t nb = K / qk;
    __m512 f[MR][2];
    for (int i = 0; i < mb; i++) f[i][0] = f[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i acc[MR][2], acl[MR][2];  /* acl: the low bytes of 16-bit activations */
        for (int i = 0; i < mb; i++) {  /* the offset's correction: into the low part */
            const __m512i c = _mm512_set1_epi32(cs[i * nb + b]);
            acc[i][0] = acc[i][1] = a16 ? _mm512_setzero_si512() : c;
            if (a16) acl[i][0] = acl[i][1] = c;
        }
        const uint8_t *wb = wv + b * qk * PANEL;
        const int64_t kb = b * qk;
#pragma GCC unroll 8
        for (int64_t g = 0; g < qk / 4; g++) {
            const __m512i w0 = _mm512_loadu_si512(wb + g * 4 * PANEL);
            const __m512i w1 = _mm512_loadu_si512(wb + g * 4 * PANEL + 64);
            for (int i = 0; i < mb; i++) {
                const __m512i av = _mm512_set1_epi32(load4(q + i * K + kb + g * 4));
                if (a16) {  /* acc: the high bytes, acl: the low ones */
                    const __m512i al = _mm512_set1_epi32(load4(lo + i * K + kb + g * 4));
                    acl[i][0] = _mm512_dpbusd_epi32(acl[i][0], w0, al);
                    acl[i][1] = _mm512_dpbusd_epi32(acl[i][1], w1, al);
                }
                acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], w0, av);
                acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], w1, av);
            }
        }
        for (int i = 0; i < mb; i++) {
            const __m512 dv = _mm512_set1_ps(d[i * nb + b]);
            if (a16) {  /* 256 * high + low */
                acc[i][0] = _mm512_add_epi32(_mm512_slli_epi32(acc[i][0], 8), acl[i][0]);
                acc[i][1] = _mm512_add_epi32(_mm512_slli_epi32(acc[i][1], 8), acl[i][1]);
            }
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
#define TILE(MB, QK, A16) run_tile(q + m * K, lo + m * K, A16, d + m * nb, cs + m * nb, MB, \
                                   wv, K, QK, y + m * N, N, n_valid, s, bias)
#define PANEL_ROWS(QK)                                                   \
    do {                                                                 \
        int64_t m = m0;                                                  \
        for (; m + MR <= m1; m += MR) TILE(MR, QK, 0);                   \
        switch (m1 - m) {                                                \
            case 5: TILE(5, QK, 0); break;                               \
            case 4: TILE(4, QK, 0); break;                               \
            case 3: TILE(3, QK, 0); break;                               \
            case 2: TILE(2, QK, 0); break;                               \
            case 1: TILE(1, QK, 0); break;                               \
            default: break;                                              \
        }                                                                \
    } while (0)
#define PANEL_ROWS16(QK)                                                 \
    do {                                                                 \
        int64_t m = m0;                                                  \
        for (; m + MR16 <= m1; m += MR16) TILE(MR16, QK, 1);             \
        switch (m1 - m) {                                                \
            case 3: TILE(3, QK, 1); break;                               \
            case 2: TILE(2, QK, 1); break;                               \
            case 1: TILE(1, QK, 1); break;                               \
            default: break;                                              \
        }                                                                \
    } while (0)

static void run_panel(const int8_t *q, const int8_t *lo, const float *d, const int32_t *cs,
                      int64_t m0, int64_t m1, const uint8_t *wv, int64_t K, int64_t qk,
                      float *y, int64_t N, int64_t n_valid, const float *s, const float *bias) {
    const int64_t nb = K / qk;
    if (lo != NULL) {
        if (qk == 32)
            PANEL_ROWS16(32);
        else
            PANEL_ROWS16(qk);
    } else if (qk == 32) {
        PANEL_ROWS(32);
    } else {
        PANEL_ROWS(qk);
    }
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

/* y [M, N] (row stride N) = the W8A8 (act_bits 8) or W8A16 (16) product above. x: [M, K] fp32, row stride x_stride,
 * unit column stride; wv: ceil(N / 32) packed panels [K / 4][32][4] uint8 (q + 128);
 * scale, bias: 32 * ceil(N / 32) floats. qk: the activation block (a multiple of 16 dividing
 * K; at most 256 with act_bits 16). Returns 0; -1 when the buffer could not be allocated;
 * -2 for a bad qk or act_bits; -3 without VNNI. Not reentrant per calling thread only in that it reuses that thread's buffer. */
int int8_vnni_linear_f32(const float *x, int64_t x_stride, const uint8_t *wv,
                         const float *scale, const float *bias, float *y, int64_t M,
                         int64_t N, int64_t K, int64_t qk, int act_bits, int num_threads) {
#ifdef HAVE_VNNI
    if (qk <= 0 || qk % 16 != 0 || K % qk != 0 || (act_bits != 8 && act_bits != 16) ||
        (act_bits == 16 && qk > 256))
        return -2;
    const int64_t nb = K / qk, num_panels = (N + PANEL - 1) / PANEL;
    const int64_t q_bytes = (M * K + 63) / 64 * 64, s_bytes = (M * nb * 4 + 63) / 64 * 64;
    const int64_t lo_bytes = act_bits == 16 ? q_bytes : 0;
    char *buf = (char *)get_buffer((size_t)(q_bytes + lo_bytes + 2 * s_bytes));
    if (buf == NULL) return -1;
    int8_t *q = (int8_t *)buf;
    int8_t *lo = act_bits == 16 ? (int8_t *)(buf + q_bytes) : NULL;
    float *d = (float *)(buf + q_bytes + lo_bytes);
    int32_t *cs = (int32_t *)(buf + q_bytes + lo_bytes + s_bytes);
    const int64_t num_blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
#define QUANTIZE(m) quantize_row(x + (m) * x_stride, K, qk, q + (m) * K, \
                                 lo != NULL ? lo + (m) * K : NULL, d + (m) * nb, cs + (m) * nb)
    const int serial = M <= SERIAL_ROWS;
    if (serial)  /* a few rows: by the calling thread, no barrier inside the region */
        for (int64_t m = 0; m < M; m++) QUANTIZE(m);
#pragma omp parallel num_threads(num_threads)
    {
        if (!serial) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) QUANTIZE(m);
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < num_blocks; r++) {
            for (int64_t p = 0; p < num_panels; p++) {
                const int64_t m0 = r * ROW_BLOCK, m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
                const int64_t n0 = p * PANEL, n_valid = N - n0 < PANEL ? N - n0 : PANEL;
                run_panel(q, lo, d, cs, m0, m1, wv + p * K * PANEL, K, qk, y + n0, N, n_valid,
                          scale + n0, bias + n0);
            }
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)wv; (void)scale; (void)bias; (void)y; (void)M;
    (void)N; (void)K; (void)qk; (void)act_bits; (void)num_threads;
    return -3;
#endif
}
