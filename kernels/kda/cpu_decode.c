/* Fused KDA decode step on CPU (fp32): short conv + SiLU, L2-norm, gate, delta rule, output norm and gate.
 *
 * One call does everything of a KDA layer's decode step between its input projections and o_proj,
 * for N sequences whose state slots are addressed by index and updated in place (conv tails and the
 * recurrent state; other slots are never touched). Per sequence n, channel c < 3P (P = H * D) and head h:
 *
 *   y_c      = silu(sum_j tails[c][j] * wc[j][c] + qkv[c] * wc[W-1][c]);  tails shift left, qkv enters
 *   q, k, v  = y[0:P], y[P:2P], y[2P:3P];  q, k /= sqrt(|.|^2 + 1e-6) per head
 *   d        = exp(a * softplus(g))  (softplus form)  or  exp(a * sigmoid(g))  (lower-bound form)
 *   beta     = sigmoid(b_h)
 *   u        = beta * (v - (k*d)^T S);   o = (q*d)^T S + (q.k) u;   S = d S + k u^T
 *   out      = o / sqrt(|o|^2 + eps_sum) * sigmoid(gate)    (RMSNorm / sqrt(D) with eps_sum = D * eps;
 *                                                           the caller folds sqrt(D) and the weight into o_proj)
 *
 * The same math as model/layers/kda.py's torch decode fast path (its reference) and fla's naive recurrence.
 * S is [D (key), D (value)] per head, row-major: both passes over it stay in L1 (16 KiB at D = 64).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_D 256

/* exp of -|x| only: no overflow to infinity (fast math assumes none; a reciprocal of inf turns to NaN) */
static inline float sigmoidf_(float x) {
    const float e = expf(-fabsf(x)), s = 1.0f / (1.0f + e);
    return x >= 0.0f ? s : e * s;
}
static inline float softplusf_(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }

int kda_decode_f32(
    int64_t N, int64_t H, int64_t D, int64_t W,
    const float *qkv, int64_t qkv_stride,    /* [N, 3P] pre-conv q|k|v projections, row stride */
    float *conv,                             /* pool conv tails [slots, 3P, W-1] */
    const float *wc,                         /* conv taps [W, 3P], oldest first */
    const float *g, int64_t g_stride,        /* [N, P] gate pre-activation (f_b(f_a x) + dt, constants folded) */
    const float *a,                          /* [P] gate factor */
    int32_t softplus_form,
    const float *b, int64_t b_stride,        /* [N, H] beta logits */
    const float *gate, int64_t gate_stride,  /* [N, P] output gate logits */
    float *state,                            /* pool states [slots, H, D, D] */
    const int64_t *slots, int64_t num_slots, /* [N] slot of each sequence, < num_slots */
    float eps_sum,
    float *out                               /* [N, P] */
) {
    if (D > MAX_D || W < 1) return -1;
    for (int64_t n = 0; n < N; n++)
        if (slots[n] < 0 || slots[n] >= num_slots) return -3;
    const int64_t P = H * D, C = 3 * P, T = W - 1;
    float *y = malloc((size_t)(C + P) * sizeof(float));  /* conv outputs q|k|v, then the decays d */
    if (!y) return -2;
    float *d = y + C;
    for (int64_t n = 0; n < N; n++) {
        const float *x = qkv + n * qkv_stride;
        float *tails = conv + slots[n] * C * T;
        /* short conv (taps oldest first, then the new input), then the tails shift by one */
        for (int64_t c = 0; c < C; c++) y[c] = x[c] * wc[T * C + c];
        for (int64_t j = 0; j < T; j++) {
            const float *w = wc + j * C;
            for (int64_t c = 0; c < C; c++) y[c] += tails[c * T + j] * w[c];
        }
        for (int64_t c = 0; c < C; c++) {
            float *t = tails + c * T;
            for (int64_t j = 0; j + 1 < T; j++) t[j] = t[j + 1];
            if (T > 0) t[T - 1] = x[c];
        }
        for (int64_t c = 0; c < C; c++) y[c] = y[c] * sigmoidf_(y[c]);  /* SiLU */
        const float *gn = g + n * g_stride, *gt = gate + n * gate_stride;
        if (softplus_form) for (int64_t p = 0; p < P; p++) d[p] = expf(a[p] * softplusf_(gn[p]));
        else for (int64_t p = 0; p < P; p++) d[p] = expf(a[p] * sigmoidf_(gn[p]));
        for (int64_t h = 0; h < H; h++) {
            const float *q = y + h * D, *k = y + P + h * D, *v = y + 2 * P + h * D, *dh = d + h * D;
            float qq = 0.f, kk = 0.f;
            for (int64_t i = 0; i < D; i++) { qq += q[i] * q[i]; kk += k[i] * k[i]; }
            const float rq = 1.0f / sqrtf(qq + 1e-6f), rk = 1.0f / sqrtf(kk + 1e-6f);
            float kn[MAX_D], qd[MAX_D], kd[MAX_D], u[MAX_D], o[MAX_D];
            float qk = 0.f;
            for (int64_t i = 0; i < D; i++) {
                const float qi = q[i] * rq, ki = k[i] * rk;
                kn[i] = ki;
                qk += qi * ki;
                qd[i] = qi * dh[i];
                kd[i] = ki * dh[i];
            }
            const float beta = sigmoidf_(b[n * b_stride + h]);
            float *S = state + (slots[n] * H + h) * D * D;
            float sk[MAX_D], sq[MAX_D];
            for (int64_t j = 0; j < D; j++) { sk[j] = 0.f; sq[j] = 0.f; }
            for (int64_t i = 0; i < D; i++) {
                const float *row = S + i * D;
                const float ki = kd[i], qi = qd[i];
                for (int64_t j = 0; j < D; j++) { sk[j] += ki * row[j]; sq[j] += qi * row[j]; }
            }
            float oo = 0.f;
            for (int64_t j = 0; j < D; j++) {
                u[j] = beta * (v[j] - sk[j]);
                o[j] = sq[j] + qk * u[j];
                oo += o[j] * o[j];
            }
            /* the next state this call updates (the next head, or the next sequence's first head: slots need
             * not be consecutive, so the hardware prefetcher cannot guess it), fetched while this one is
             * rewritten from L1 */
            const float *Sn = h + 1 < H ? S + D * D : (n + 1 < N ? state + slots[n + 1] * H * D * D : 0);
            for (int64_t i = 0; i < D; i++) {
                float *row = S + i * D;
                const float di = dh[i], ki = kn[i];
                if (Sn)
                    for (int64_t j = 0; j < D; j += 16) __builtin_prefetch(Sn + i * D + j, 1, 3);
                for (int64_t j = 0; j < D; j++) row[j] = di * row[j] + ki * u[j];
            }
            const float ro = 1.0f / sqrtf(oo + eps_sum);
            float *on = out + n * P + h * D;
            for (int64_t j = 0; j < D; j++) on[j] = o[j] * ro * sigmoidf_(gt[h * D + j]);
        }
    }
    free(y);
    return 0;
}
