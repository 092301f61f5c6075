/* A small-M fp32 product from a weight packed once into column panels: y[M, N] = x[M, K] @ wt[K, N] (+ bias).
 *
 * The decode step's products have a few rows (one per sequence) and weights of 64 KiB to 1 MiB. MKL's sgemm
 * packs the whole weight on every call, which is most of its time at such M; here the weight is packed once
 * (panel_pack_f32) into panels of 32 columns, each [K][32] contiguous (the last zero-padded), and the product
 * streams each panel once per 8 rows of x, holding the 8 x 32 outputs in registers (AVX-512: 16 accumulators), and
 * adds the sum of every 64 k to the outputs (blocked sums, as mm's).
 * Without AVX-512 a plain C loop over the same layout (vectorised by the compiler) does the same.
 *
 * Reference: torch.mm(x, wt) (model/layers/fused.py, linear_t); tests/kernels/test_panel_gemm.py. Sums run in fp32
 * (fused multiply-adds), in blocks of 64 k: within rounding of mm, not bitwise equal to it.
 */
#include <stdint.h>
#include <string.h>

#define NR 32 /* columns per panel */
#define MR 8  /* rows per register block */
#define KB 64 /* k per partial sum */

int panel_pack_f32(int64_t K, int64_t N, const float *wt, float *wp) {
    if (K < 1 || N < 1) return -1;
    int64_t panels = (N + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) {
        int64_t n0 = p * NR, nb = N - n0 < NR ? N - n0 : NR;
        float *dst = wp + p * K * NR;
        for (int64_t k = 0; k < K; k++) {
            memcpy(dst + k * NR, wt + k * N + n0, sizeof(float) * nb);
            if (nb < NR) memset(dst + k * NR + nb, 0, sizeof(float) * (NR - nb));
        }
    }
    return 0;
}

#if defined(__AVX512F__)
#include <immintrin.h>

static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* rows [0, R) of x (K apart) times one panel -> y columns [n0, n0 + nb) (N apart). The k loop runs in blocks of
   KB, each summed from zero in registers and then added to y: blocked sums, whose rounding error grows with KB
   and K / KB rather than with K (as mm's blocked kernels'). */
#define BLOCK(R)                                                                                               \
    static void block##R(const float *restrict x, int64_t K, const float *restrict w, const float *bias,        \
                         float *restrict y, int64_t N, int64_t n0, int64_t nb) {                                \
        __mmask16 m0 = lanes(nb), m1 = lanes(nb - 16);                                                        \
        __m512 c0[R], c1[R];                                                                                   \
        for (int64_t k0 = 0; k0 < K; k0 += KB) {                                                               \
            int64_t k1 = K - k0 < KB ? K : k0 + KB;                                                            \
            for (int r = 0; r < R; r++) { c0[r] = _mm512_setzero_ps(); c1[r] = _mm512_setzero_ps(); }         \
            for (int64_t k = k0; k < k1; k++, w += NR) {                                                       \
                __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);                                 \
                for (int r = 0; r < R; r++) {                                                                  \
                    __m512 a = _mm512_set1_ps(x[r * K + k]);                                                   \
                    c0[r] = _mm512_fmadd_ps(a, w0, c0[r]);                                                     \
                    c1[r] = _mm512_fmadd_ps(a, w1, c1[r]);                                                     \
                }                                                                                              \
            }                                                                                                  \
            for (int r = 0; r < R; r++) {                                                                      \
                float *yr = y + r * N + n0;                                                                    \
                __m512 p0 = k0 ? _mm512_maskz_loadu_ps(m0, yr)                                                 \
                               : bias ? _mm512_maskz_loadu_ps(m0, bias + n0) : _mm512_setzero_ps();             \
                __m512 p1 = k0 ? _mm512_maskz_loadu_ps(m1, yr + 16)                                            \
                               : bias ? _mm512_maskz_loadu_ps(m1, bias + n0 + 16) : _mm512_setzero_ps();        \
                _mm512_mask_storeu_ps(yr, m0, _mm512_add_ps(p0, c0[r]));                                       \
                _mm512_mask_storeu_ps(yr + 16, m1, _mm512_add_ps(p1, c1[r]));                                  \
            }                                                                                                  \
        }                                                                                                      \
    }
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6) BLOCK(7) BLOCK(8)
typedef void (*block_fn)(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t, int64_t);
static const block_fn BLOCKS[MR + 1] = {0, block1, block2, block3, block4, block5, block6, block7, block8};

#else

static void block_c(int64_t R, const float *restrict x, int64_t K, const float *restrict w, const float *bias,
                    float *restrict y, int64_t N, int64_t n0, int64_t nb) {
    float acc[MR][NR];
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        int64_t k1 = K - k0 < KB ? K : k0 + KB;
        for (int64_t r = 0; r < R; r++)
            for (int j = 0; j < NR; j++) acc[r][j] = 0.f;
        for (int64_t k = k0; k < k1; k++, w += NR)
            for (int64_t r = 0; r < R; r++) {
                const float a = x[r * K + k];
                for (int j = 0; j < NR; j++) acc[r][j] += a * w[j];
            }
        for (int64_t r = 0; r < R; r++)
            for (int64_t j = 0; j < nb; j++)
                y[r * N + n0 + j] = (k0 ? y[r * N + n0 + j] : bias ? bias[n0 + j] : 0.f) + acc[r][j];
    }
}

#endif

/* x [M, K], wp from panel_pack_f32(K, N), bias [N] or NULL, y [M, N]; all contiguous */
int panel_gemm_f32(int64_t M, int64_t N, int64_t K, const float *x, const float *wp, const float *bias, float *y) {
    if (M < 1 || N < 1 || K < 1) return -1;
    int64_t panels = (N + NR - 1) / NR;
    for (int64_t p = 0; p < panels; p++) { /* each panel read from memory once, then from L1 for every 8 rows */
        int64_t n0 = p * NR, nb = N - n0 < NR ? N - n0 : NR;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            int64_t rows = M - m0 < MR ? M - m0 : MR;
#if defined(__AVX512F__)
            BLOCKS[rows](x + m0 * K, K, wp + p * K * NR, bias, y + m0 * N, N, n0, nb);
#else
            block_c(rows, x + m0 * K, K, wp + p * K * NR, bias, y + m0 * N, N, n0, nb);
#endif
        }
    }
    return 0;
}
