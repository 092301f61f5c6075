/* Routed experts of a few tokens on CPU (fp32): out[t] = sum_j w[t][j] * expert_{idx[t][j]}(x[t]).
 *
 * Experts are GLUs over stacked, pre-folded weights (model/layers/moe.py PackedExperts): for expert e,
 *   h = x @ w13[e]            (w13 [E, D, 2I]: gate columns then up columns)
 *   a = act(h[:I], h[I:])     0: silu(g) * u
 *                             1: beta * tanh(g / beta) * sigmoid(g) * u           (SiTU)
 *                             2: sigmoid(beta * g) * tanh(g) * tanh(u)            (SiTU, both betas folded in)
 *   y = a @ w2[e]             (w2 [E, I, D])
 * Tokens are grouped per expert (a counting sort of the assignments), and each expert's weights are
 * streamed once, in order, for up to TB tokens at a time (rows_times_matrix): a grouped matrix-vector
 * product, memory-bound on the weights. The torch reference is run_experts_packed / run_experts_loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TB 8   /* most tokens per block (fewer are padded with zero rows up to 4 or 8) */
#define CW 32  /* columns per register block */
#define RB 8   /* weight rows per block */

/* exp of -|x| only: no overflow to infinity (fast math assumes none; a reciprocal of inf turns to NaN) */
static inline float sigmoidf_(float x) {
    const float e = expf(-fabsf(x)), s = 1.0f / (1.0f + e);
    return x >= 0.0f ? s : e * s;
}

/* The GLU activation of one gate/up pair (modes as in the header comment). */
static inline float glu_(int32_t act, float beta, float g, float u) {
    if (act == 0) return g * sigmoidf_(g) * u;
    if (act == 1) return beta * tanhf(g / beta) * sigmoidf_(g) * u;
    return sigmoidf_(beta * g) * tanhf(g) * tanhf(u);
}

/* c[b][:] = sum_r a[b][r] * W[r][:] for the TBN rows a[b], W [R, C] row-major, c [TBN, ldc] (one copy for each
 * TBN, 4 and 8). W is read in order, RB rows at a time (they stay in L1 while every column chunk passes over
 * them), with each chunk's TBN x CW accumulators in registers across the block: a cold weight matrix streams
 * from memory once. */
#define ROWS_TIMES_MATRIX(TBN) \
static void rows_times_matrix_##TBN(const float *const *a, int64_t R, const float *W, int64_t C, float *c, int64_t ldc, \
                              const float *next) {                                                                  \
    for (int b = 0; b < TBN; b++)                                                                                   \
        for (int64_t j = 0; j < C; j++) c[b * ldc + j] = 0.f;                                                       \
    for (int64_t r0 = 0; r0 < R; r0 += RB) {                                                                        \
        const int64_t rb = R - r0 < RB ? R - r0 : RB;                                                               \
        int64_t j0 = 0;                                                                                             \
        /* Software prefetch one block ahead, spread over the block's column chunks (a row is too short for the     \
         * hardware prefetcher to ramp up): the next RB rows at this chunk's columns, or during the last block      \
         * the start of ``next`` (the matrix read after this one), as many bytes as a block, in order. */           \
        const int64_t rn = R - (r0 + RB) < RB ? R - (r0 + RB) : RB;  /* rows of the next block; <= 0: last */       \
        for (int64_t k = 0; j0 + CW <= C; j0 += CW, k++) {                                                          \
            if (rn > 0) {                                                                                           \
                for (int64_t rr = 0; rr < rn; rr++) {                                                               \
                    __builtin_prefetch(W + (r0 + RB + rr) * C + j0, 0, 3);                                          \
                    __builtin_prefetch(W + (r0 + RB + rr) * C + j0 + 16, 0, 3);                                     \
                }                                                                                                   \
            } else if (next) {                                                                                      \
                for (int64_t t = 0; t < 2 * RB; t++) __builtin_prefetch(next + (k * 2 * RB + t) * 16, 0, 3);        \
            }                                                                                                       \
            float acc[TBN][CW];                                                                                     \
            for (int b = 0; b < TBN; b++)                                                                           \
                for (int jj = 0; jj < CW; jj++) acc[b][jj] = c[b * ldc + j0 + jj];                                  \
            for (int64_t rr = 0; rr < rb; rr++) {                                                                   \
                const float *w = W + (r0 + rr) * C + j0;                                                            \
                for (int b = 0; b < TBN; b++) {                                                                     \
                    const float av = a[b][r0 + rr];                                                                 \
                    for (int jj = 0; jj < CW; jj++) acc[b][jj] += av * w[jj];                                       \
                }                                                                                                   \
            }                                                                                                       \
            for (int b = 0; b < TBN; b++)                                                                           \
                for (int jj = 0; jj < CW; jj++) c[b * ldc + j0 + jj] = acc[b][jj];                                  \
        }                                                                                                           \
        for (; j0 < C; j0++)  /* columns left over */                                                               \
            for (int64_t rr = 0; rr < rb; rr++)                                                                     \
                for (int b = 0; b < TBN; b++) c[b * ldc + j0] += a[b][r0 + rr] * W[(r0 + rr) * C + j0];             \
    }                                                                                                               \
}
ROWS_TIMES_MATRIX(4)
ROWS_TIMES_MATRIX(8)

/* the rows of one block: 8 when the expert has more than 4 tokens left (its weights then stream once for
 * 8 tokens instead of twice for 4 each), else 4 (a lone token computes 3 zero rows, not 7) */
static void rows_times_matrix(int64_t nb, const float *const *a, int64_t R, const float *W, int64_t C, float *c,
                              int64_t ldc, const float *next) {
    if (nb > 4) rows_times_matrix_8(a, R, W, C, c, ldc, next);
    else rows_times_matrix_4(a, R, W, C, c, ldc, next);
}

int moe_experts_f32(
    int64_t T, int64_t D, int64_t I, int64_t K, int64_t E,
    const float *x, int64_t x_stride,  /* [T, D], row stride */
    const int64_t *idx,                /* [T, K] expert ids */
    const float *w,                    /* [T, K] weights */
    const float *w13,                  /* [E, D, 2I] */
    const float *w2,                   /* [E, I, D] */
    int32_t act, float beta,
    float *out                         /* [T, D], overwritten */
) {
    const int64_t A = T * K, I2 = 2 * I;
    for (int64_t a = 0; a < A; a++)
        if (idx[a] < 0 || idx[a] >= E) return -3;
    if (act < 0 || act > 2) return -4;
    if (D > 4096) return -5;
    int64_t *count = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *order = malloc((size_t)(A > 0 ? A : 1) * sizeof(int64_t));
    float *h = malloc((size_t)TB * I2 * sizeof(float));
    if (!count || !order || !h) { free(count); free(order); free(h); return -2; }
    for (int64_t a = 0; a < A; a++) count[idx[a] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];  /* count[e] = first assignment of expert e */
    int64_t *fill = malloc((size_t)E * sizeof(int64_t));
    if (!fill) { free(count); free(order); free(h); return -2; }
    memcpy(fill, count, (size_t)E * sizeof(int64_t));
    for (int64_t a = 0; a < A; a++) order[fill[idx[a]]++] = a;  /* stable: token order within an expert */
    free(fill);
    memset(out, 0, (size_t)T * D * sizeof(float));

    static const float zeros[4096];
    float *y = malloc((size_t)TB * D * sizeof(float));
    if (!y) { free(count); free(order); free(h); return -2; }
    for (int64_t e = 0; e < E; e++) {
        const float *W13 = w13 + e * D * I2, *W2 = w2 + e * I * D;
        int64_t en = e + 1;  /* the next expert with tokens: its W13 is prefetched while W2 of this one runs */
        while (en < E && count[en + 1] == count[en]) en++;
        for (int64_t s = count[e]; s < count[e + 1]; s += TB) {
            const int64_t nb = count[e + 1] - s < TB ? count[e + 1] - s : TB;
            const float *nxt = s + TB < count[e + 1] ? W13 : (en < E ? w13 + en * D * I2 : NULL);
            const float *xs[TB], *as[TB];
            for (int64_t b = 0; b < TB; b++) {
                xs[b] = b < nb ? x + (order[s + b] / K) * x_stride : zeros;
                as[b] = h + b * I2;
            }
            rows_times_matrix(nb, xs, D, W13, I2, h, I2, W2);  /* h = x @ W13 */
            for (int64_t b = 0; b < nb; b++) {  /* activation, in the gate half of h, times the routing weight */
                float *hb = h + b * I2;
                const float wt = w[order[s + b]];
                for (int64_t i = 0; i < I; i++) hb[i] = glu_(act, beta, hb[i], hb[I + i]) * wt;
            }
            for (int64_t b = nb; b < TB; b++)
                for (int64_t i = 0; i < I; i++) h[b * I2 + i] = 0.f;
            rows_times_matrix(nb, as, I, W2, D, y, D, nxt);  /* y = a @ W2 (padded rows: zeros, not stored) */
            for (int64_t b = 0; b < nb; b++) {
                float *ob = out + (order[s + b] / K) * D;
                for (int64_t j = 0; j < D; j++) ob[j] += y[b * D + j];
            }
        }
    }
    free(y);
    free(count); free(order); free(h);
    return 0;
}

/* Router, fast path (one expert group): s = sigmoid(logits); the top K of s + bias (bias may be NULL), in
 * descending order (the first index wins a tie); w = s[idx], renormalised to sum 1 when renorm, times scaling.
 * The torch reference is model/layers/moe.py Router.forward. */
int moe_route_f32(
    int64_t T, int64_t E, int64_t K,
    const float *logits, int64_t stride,  /* [T, E], row stride */
    const float *bias,                    /* [E] or NULL */
    int32_t renorm, float scaling,
    int64_t *idx, float *w                /* [T, K] each */
) {
    if (K < 1 || K > E || E > 4096) return -1;
    float s[4096], c[4096];
    unsigned char taken[4096];  /* no -inf marks: fast math assumes there are no infinities */
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * stride;
        for (int64_t e = 0; e < E; e++) { s[e] = sigmoidf_(l[e]); c[e] = bias ? s[e] + bias[e] : s[e]; taken[e] = 0; }
        float sum = 0.f;
        for (int64_t j = 0; j < K; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || c[e] > c[best])) best = e;
            idx[t * K + j] = best;
            w[t * K + j] = s[best];
            sum += s[best];
            taken[best] = 1;
        }
        const float f = renorm && K > 1 ? scaling / (sum + 1e-20f) : scaling;
        for (int64_t j = 0; j < K; j++) w[t * K + j] *= f;
    }
    return 0;
}

/* After the routed experts of a LatentMoE layer: out[:, :L] = y / sqrt(|y|^2 + L * eps) (the latent RMSNorm
 * over sqrt(L), its weight folded into the up projection; eps < 0: no norm), and out[:, L:] = act(z) for the
 * shared expert's gate|up pre-activation z [T, 2S] (S = 0: none); act as in moe_experts_f32. */
int moe_combine_f32(
    int64_t T, int64_t L, int64_t S,
    const float *y,                       /* [T, L] */
    float eps,
    const float *z, int64_t z_stride,     /* [T, 2S], row stride; NULL when S = 0 */
    int32_t act, float beta,
    float *out                            /* [T, L + S] */
) {
    if (act < 0 || act > 2) return -4;
    for (int64_t t = 0; t < T; t++) {
        const float *yt = y + t * L;
        float *o = out + t * (L + S);
        float r = 1.0f;
        if (eps >= 0.0f) {
            float sq = 0.f;
            for (int64_t i = 0; i < L; i++) sq += yt[i] * yt[i];
            r = 1.0f / sqrtf(sq + (float)L * eps);
        }
        for (int64_t i = 0; i < L; i++) o[i] = yt[i] * r;
        if (S > 0) {
            const float *zt = z + t * z_stride;
            for (int64_t i = 0; i < S; i++) o[L + i] = glu_(act, beta, zt[i], zt[S + i]);
        }
    }
    return 0;
}
