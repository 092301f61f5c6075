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

/* sk = kd^T S and sq = qd^T S for one head's state S [D, D]. Inlined, so that a constant D keeps the sums in
 * vector registers across the rows (with D known only at run time they are loaded and stored for every row). */
static inline __attribute__((always_inline)) void read_state(const float *restrict S, int64_t D, const float *kd,
                                                             const float *qd, float *restrict sk, float *restrict sq) {
    float ask[MAX_D], asq[MAX_D];
    for (int64_t j = 0; j < D; j++) { ask[j] = 0.f; asq[j] = 0.f; }
    for (int64_t i = 0; i < D; i++) {
        const float *row = S + i * D;
        const float ki = kd[i], qi = qd[i];
        for (int64_t j = 0; j < D; j++) { ask[j] += ki * row[j]; asq[j] += qi * row[j]; }
    }
    for (int64_t j = 0; j < D; j++) { sk[j] = ask[j]; sq[j] = asq[j]; }
}

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
            if (D == 64) read_state(S, 64, kd, qd, sk, sq);  /* constant D: the sums stay in registers */
            else read_state(S, D, kd, qd, sk, sq);
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

/* One token's state update S = diag(d) S + k u^T (rows i: S[i] = d[i] S[i] + k[i] u), and the next token's reads of
 * the new state, sk = kd^T S and sq = qd^T S. Inlined, so that a constant D (the common head size) lets the compiler
 * keep sk and sq in vector registers across the rows instead of loading and storing them for every row. */
static inline __attribute__((always_inline)) void update_and_read(float *restrict S, int64_t D, const float *dh,
                                                                  const float *k, const float *u, const float *kd,
                                                                  const float *qd, float *restrict sk, float *restrict sq) {
    float ask[MAX_D], asq[MAX_D];
    for (int64_t j = 0; j < D; j++) { ask[j] = 0.f; asq[j] = 0.f; }
    for (int64_t i = 0; i < D; i++) {
        float *row = S + i * D;
        const float di = dh[i], ki = k[i], kn = kd[i], qn = qd[i];
        for (int64_t j = 0; j < D; j++) {
            const float r = di * row[j] + ki * u[j];
            row[j] = r;
            ask[j] += kn * r;
            asq[j] += qn * r;
        }
    }
    for (int64_t j = 0; j < D; j++) { sk[j] = ask[j]; sq[j] = asq[j]; }
}

/* Fused KDA prefill on CPU (fp32): the decode step's math for N packed sequences of any length, token after
 * token from each sequence's slot (conv tails and state read and updated in place).
 *
 * Per sequence: the short conv + SiLU, the L2 norms and the decays of all its tokens first (the conv window
 * of token t is rows t..t+W-1 of [tails ; inputs]); then head by head, so that the head's state stays in L1
 * across the sequence, one pass over the state per token: row i of S_t = d_t,i S_{t-1},i + k_t,i u_t is
 * written and, in the same pass, dotted with the next token's decayed key and query (the reads the next
 * token's u and o need). Sequence n is rows cu[n] .. cu[n+1]-1 of the [T_total, .] inputs and of out.
 */
int kda_prefill_f32(
    int64_t N, int64_t H, int64_t D, int64_t W,
    const float *qkv, int64_t qkv_stride,
    float *conv, const float *wc,
    const float *g, int64_t g_stride, const float *a, int32_t softplus_form,
    const float *b, int64_t b_stride,
    const float *gate, int64_t gate_stride,
    float *state, const int64_t *slots, int64_t num_slots,
    const int64_t *cu,                       /* [N + 1] token offsets */
    float eps_sum,
    float *out                               /* [T_total, P] */
) {
    if (D > MAX_D || W < 1) return -1;
    int64_t L_max = 0;
    for (int64_t n = 0; n < N; n++) {
        if (slots[n] < 0 || slots[n] >= num_slots) return -3;
        if (cu[n + 1] < cu[n]) return -4;
        if (cu[n + 1] - cu[n] > L_max) L_max = cu[n + 1] - cu[n];
    }
    const int64_t P = H * D, C = 3 * P, T = W - 1;
    /* per token: q|k|v after conv, SiLU and (q, k) the L2 norm [C], then the decays [P]; the tails [T, C] */
    float *buf = malloc((size_t)(L_max * (C + P) + T * C + 1) * sizeof(float));
    if (!buf) return -2;
    float *tl = buf + L_max * (C + P);
    for (int64_t n = 0; n < N; n++) {
        const int64_t r0 = cu[n], L = cu[n + 1] - cu[n];
        if (L == 0) continue;
        float *tails = conv + slots[n] * C * T;
        for (int64_t j = 0; j < T; j++)
            for (int64_t c = 0; c < C; c++) tl[j * C + c] = tails[c * T + j];
        for (int64_t t = 0; t < L; t++) {
            float *y = buf + t * (C + P), *d = y + C;
            const float *x = qkv + (r0 + t) * qkv_stride;
            for (int64_t c = 0; c < C; c++) y[c] = x[c] * wc[T * C + c];
            for (int64_t j = 0; j < T; j++) {  /* window row t + j of [tails ; inputs] */
                const int64_t i = t + j;
                const float *row = i < T ? tl + i * C : qkv + (r0 + i - T) * qkv_stride, *w = wc + j * C;
                for (int64_t c = 0; c < C; c++) y[c] += row[c] * w[c];
            }
            for (int64_t c = 0; c < C; c++) y[c] = y[c] * sigmoidf_(y[c]);
            for (int64_t h = 0; h < 2 * H; h++) {  /* L2 norm of q and k per head */
                float *v = y + h * D, ss = 0.f;
                for (int64_t i = 0; i < D; i++) ss += v[i] * v[i];
                const float r = 1.0f / sqrtf(ss + 1e-6f);
                for (int64_t i = 0; i < D; i++) v[i] *= r;
            }
            const float *gn = g + (r0 + t) * g_stride;
            if (softplus_form) for (int64_t p = 0; p < P; p++) d[p] = expf(a[p] * softplusf_(gn[p]));
            else for (int64_t p = 0; p < P; p++) d[p] = expf(a[p] * sigmoidf_(gn[p]));
        }
        /* the new tails: the last T rows of [tails ; inputs] */
        for (int64_t j = 0; j < T; j++) {
            const int64_t i = L + j;
            const float *row = i < T ? tl + i * C : qkv + (r0 + i - T) * qkv_stride;
            for (int64_t c = 0; c < C; c++) tails[c * T + j] = row[c];
        }
        for (int64_t h = 0; h < H; h++) {
            float *S = state + (slots[n] * H + h) * D * D;
            float sk[MAX_D], sq[MAX_D], kd[MAX_D], qd[MAX_D], u[MAX_D];
            /* the first token's reads of the state */
            {
                const float *y = buf, *d = y + C;
                for (int64_t i = 0; i < D; i++) { kd[i] = y[P + h * D + i] * d[h * D + i]; qd[i] = y[h * D + i] * d[h * D + i]; }
                if (D == 64) read_state(S, 64, kd, qd, sk, sq);
                else read_state(S, D, kd, qd, sk, sq);
            }
            for (int64_t t = 0; t < L; t++) {
                const float *y = buf + t * (C + P), *dh = y + C + h * D;
                const float *q = y + h * D, *k = y + P + h * D, *v = y + 2 * P + h * D;
                float qk = 0.f;
                for (int64_t i = 0; i < D; i++) qk += q[i] * k[i];
                const float beta = sigmoidf_(b[(r0 + t) * b_stride + h]);
                float oo = 0.f, o[MAX_D];
                for (int64_t j = 0; j < D; j++) {
                    u[j] = beta * (v[j] - sk[j]);
                    o[j] = sq[j] + qk * u[j];
                    oo += o[j] * o[j];
                }
                const float ro = 1.0f / sqrtf(oo + eps_sum), *gt = gate + (r0 + t) * gate_stride + h * D;
                float *on = out + (r0 + t) * P + h * D;
                for (int64_t j = 0; j < D; j++) on[j] = o[j] * ro * sigmoidf_(gt[j]);
                if (t + 1 < L) {  /* the update, with the next token's reads of the new state */
                    const float *yn = y + C + P, *dn = yn + C + h * D;
                    for (int64_t i = 0; i < D; i++) { kd[i] = yn[P + h * D + i] * dn[i]; qd[i] = yn[h * D + i] * dn[i]; }
                    if (D == 64) update_and_read(S, 64, dh, k, u, kd, qd, sk, sq);  /* constant D: sk, sq in registers */
                    else update_and_read(S, D, dh, k, u, kd, qd, sk, sq);
                } else {
                    for (int64_t i = 0; i < D; i++) {
                        float *row = S + i * D;
                        const float di = dh[i], ki = k[i];
                        for (int64_t j = 0; j < D; j++) row[j] = di * row[j] + ki * u[j];
                    }
                }
            }
        }
    }
    free(buf);
    return 0;
}
