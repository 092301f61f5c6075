/* MLA decode attention in latent space (weights absorbed) for N sequences on CPU (fp32), each reading its
 * own latent cache in place (no padded copy of the caches):
 *
 *   scores[h, s] = q[n, h, :] . ctx_n[s, :]          (ctx rows: [latent (R) | rope], Dc wide; q scaled)
 *   p            = softmax_s(scores[h, :])
 *   out[n, h, :] = sum_s p[h, s] * ctx_n[s, :R]
 *
 * Two passes over each cache (scores, then the weighted sum), each row read once per pass for all heads.
 * The torch reference is model/layers/mla.py MLAttention._decode / _decode_absorbed.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_H 128

int mla_decode_f32(
    int64_t N, int64_t H, int64_t Dc, int64_t R,
    const float *q,            /* [N, H, Dc] */
    const int64_t *ctx_addr,   /* [N] address of each sequence's cache, rows of Dc floats */
    const int64_t *lengths,    /* [N] rows to attend over */
    float *out                 /* [N, H, R] */
) {
    if (H > MAX_H || R > Dc) return -1;
    int64_t S_max = 1;
    for (int64_t n = 0; n < N; n++) {
        if (lengths[n] < 1 || !ctx_addr[n]) return -3;
        if (lengths[n] > S_max) S_max = lengths[n];
    }
    float *sc = malloc((size_t)H * S_max * sizeof(float));
    if (!sc) return -2;
    for (int64_t n = 0; n < N; n++) {
        const float *ctx = (const float *)(intptr_t)ctx_addr[n], *qn = q + n * H * Dc;
        const int64_t S = lengths[n];
        for (int64_t s = 0; s < S; s++) {
            const float *row = ctx + s * Dc;
            for (int64_t h = 0; h < H; h++) {
                const float *qh = qn + h * Dc;
                float acc = 0.f;
                for (int64_t j = 0; j < Dc; j++) acc += qh[j] * row[j];
                sc[h * S + s] = acc;
            }
        }
        float inv[MAX_H];
        for (int64_t h = 0; h < H; h++) {
            float *p = sc + h * S, mx = p[0], z = 0.f;
            for (int64_t s = 1; s < S; s++) mx = p[s] > mx ? p[s] : mx;
            for (int64_t s = 0; s < S; s++) { p[s] = expf(p[s] - mx); z += p[s]; }
            inv[h] = 1.0f / z;
        }
        float *on = out + n * H * R;
        for (int64_t i = 0; i < H * R; i++) on[i] = 0.f;
        for (int64_t s = 0; s < S; s++) {
            const float *row = ctx + s * Dc;
            for (int64_t h = 0; h < H; h++) {
                const float ps = sc[h * S + s];
                float *oh = on + h * R;
                for (int64_t j = 0; j < R; j++) oh[j] += ps * row[j];
            }
        }
        for (int64_t h = 0; h < H; h++)
            for (int64_t j = 0; j < R; j++) on[h * R + j] *= inv[h];
    }
    free(sc);
    return 0;
}
