"""Plain-torch recurrent reference for KDA (Kimi Delta Attention), one time step at a time, in fp32."""

import torch

from kernels.kda.utils import check_inputs, check_scale, check_state, seq_bounds


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Reference KDA recurrence. Per step and head, with state ``S`` of shape ``[K, V]``::

        S = S * exp(g_t)[:, None]
        S = S + outer(beta_t * k_t, v_t - k_t @ S)
        o_t = (scale * q_t) @ S

    Args:
        q: queries ``[B, T, H, K]``.
        k: keys ``[B, T, H, K]``.
        v: values ``[B, T, H, V]``.
        g: log-space per-key-channel decay ``[B, T, H, K]``.
        beta: write strength ``[B, T, H]`` (already through sigmoid).
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]``; zeros when None.
        output_final_state: return the state after the last step of every sequence.
        cu_seqlens: ``[N + 1]`` int64 offsets of sequences packed along T (requires B == 1).

    Returns:
        ``(o, final_state)``: o ``[B, T, H, V]`` in v's dtype, final_state ``[N, H, K, V]`` fp32 or None.
    """
    N = check_inputs(q, k, v, g, beta, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = check_scale(scale, K)
    if initial_state is not None:
        check_state(initial_state, N, H, K, V)

    q, k, v, g = (x.float().flatten(0, 1) for x in (q, k, v, g))
    beta = beta.float().flatten(0, 1)
    o = []
    final = []
    for i_n, (bos, eos) in enumerate(seq_bounds(cu_seqlens, B, T)):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[i_n].float()
        for t in range(bos, eos):
            S = S * g[t].exp()[..., None]
            v_new = v[t] - torch.einsum("hk,hkv->hv", k[t], S)
            S = S + torch.einsum("hk,hv->hkv", beta[t][:, None] * k[t], v_new)
            o.append(torch.einsum("hk,hkv->hv", q[t] * scale, S))
        final.append(S)
    o = torch.stack(o).reshape(B, T, H, V) if o else v.new_zeros(B, T, H, V, dtype=torch.float)
    return o.to(v.dtype), (torch.stack(final) if output_final_state else None)
