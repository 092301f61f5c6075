/* Attention-Residual mix followed by RMSNorm, for N tokens on CPU (fp32): one call per mixing point.
 *
 * For token n with completed blocks B[n, 0..nb-1] (their logits at this mixing point precomputed: L[n, s])
 * and the partial sum h[n] (absent for a mix over the blocks only):
 *   l_h  = (row . h) / sqrt(|h|^2 + D * eps_mix)          the partial's logit
 *   p    = softmax([L[n, :], l_h])
 *   m    = sum_s p_s B[n, s] + p_h h
 *   out  = m / sqrt(|m|^2 + D * eps_norm) * weight       (weight = sqrt(D) * the norm's weight)
 * The torch reference is model/layers/attn_res.py AttnResStream.mix / mix_blocks then fused.rms_norm.
 */
#include <math.h>
#include <stdint.h>

int attn_res_mix_norm_f32(
    int64_t N, int64_t D, int64_t nb,
    const float *h,        /* [N, D] partial sums, or NULL: mix over the blocks only */
    const float *blocks,   /* [N, nb, D] */
    const float *logits,   /* [N, nb] block logits at this mixing point */
    const float *row,      /* [D] this mixing point's query (sqrt(D) * norm weight * proj) */
    float eps_mix,
    const float *weight,   /* [D] sqrt(D) * the following RMSNorm's weight */
    float eps_norm,
    float *out             /* [N, D] */
) {
    if (nb < 1 || nb > 64) return -1;
    for (int64_t n = 0; n < N; n++) {
        const float *B = blocks + n * nb * D, *L = logits + n * nb, *x = h ? h + n * D : 0;
        float p[65], mx = L[0];
        for (int64_t s = 0; s < nb; s++) { p[s] = L[s]; mx = fmaxf(mx, p[s]); }
        int64_t S = nb;
        if (x) {
            float dot = 0.f, sq = 0.f;
            for (int64_t j = 0; j < D; j++) { dot += row[j] * x[j]; sq += x[j] * x[j]; }
            p[nb] = dot / sqrtf(sq + (float)D * eps_mix);
            mx = fmaxf(mx, p[nb]);
            S = nb + 1;
        }
        float z = 0.f;
        for (int64_t s = 0; s < S; s++) { p[s] = expf(p[s] - mx); z += p[s]; }
        for (int64_t s = 0; s < S; s++) p[s] /= z;
        float *o = out + n * D;
        for (int64_t j = 0; j < D; j++) o[j] = x ? p[nb] * x[j] : 0.f;
        for (int64_t s = 0; s < nb; s++) {
            const float ps = p[s], *b = B + s * D;
            for (int64_t j = 0; j < D; j++) o[j] += ps * b[j];
        }
        float sq = 0.f;
        for (int64_t j = 0; j < D; j++) sq += o[j] * o[j];
        const float r = 1.0f / sqrtf(sq + (float)D * eps_norm);
        for (int64_t j = 0; j < D; j++) o[j] *= r * weight[j];
    }
    return 0;
}
