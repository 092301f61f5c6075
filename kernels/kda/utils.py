"""Argument checking, backend selection and small helpers shared by the KDA paths.

Shape letters used throughout ``kernels.kda``:
``B`` batch, ``T`` time, ``H`` heads, ``K`` key/query dim, ``V`` value dim,
``N`` number of sequences (``B``, or ``len(cu_seqlens) - 1`` in varlen mode),
``P`` number of slots in a decode state pool.
"""

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2-normalise ``x`` over its last dim as ``x / sqrt(sum(x**2) + eps)`` (fla's in-kernel form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def resolve_backend(backend: str, device: torch.device, needs_grad: bool) -> str:
    """Map ``backend`` ("auto", "torch", "triton") to "torch" or "triton" for tensors on ``device``.

    "auto" picks Triton on CUDA unless autograd is needed (the Triton paths are forward-only).
    "triton" on a non-CUDA device works only under the Triton interpreter (``TRITON_INTERPRET=1``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and not needs_grad else "torch"
    if backend == "triton":
        if needs_grad:
            raise ValueError("backend='triton' is forward-only; inputs require grad, use backend='torch'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"backend='triton' with tensors on {device.type!r} needs the Triton interpreter: "
                "set the environment variable TRITON_INTERPRET=1 before triton is imported"
            )
    return backend


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """True when autograd is enabled and any of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
) -> int:
    """Validate q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]`` and cu_seqlens ``[N + 1]``.

    Returns the number of sequences ``N``. Values of ``cu_seqlens`` are checked only on CPU
    (checking them on CUDA would force a host synchronisation).
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    for name, t in (("k", k), ("g", g)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got shape {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got shape {tuple(beta.shape)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if cu_seqlens is None:
        return B
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (sequences packed along T), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int64 (or int32), got {cu_seqlens.dtype}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    if cu_seqlens.device.type == "cpu":
        if cu_seqlens[0].item() != 0 or cu_seqlens[-1].item() != T:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu_seqlens.tolist()}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    return cu_seqlens.numel() - 1


def check_state(state: torch.Tensor, n: int, h: int, k: int, v: int, name: str = "initial_state") -> None:
    """Validate a recurrent state of shape ``[n, h, k, v]``."""
    if state.shape != (n, h, k, v):
        raise ValueError(f"{name} must be [N, H, K, V] = [{n}, {h}, {k}, {v}], got shape {tuple(state.shape)}")


def check_scale(scale: float | None, k: int) -> float:
    """Return ``scale`` or the default ``k ** -0.5``."""
    if scale is None:
        return k ** -0.5
    if not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a python number, got {type(scale).__name__}")
    return float(scale)


def seq_bounds(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int) -> list[tuple[int, int]]:
    """Host-side ``(bos, eos)`` token ranges per sequence, indexing the flattened ``[B * T]`` time axis."""
    if cu_seqlens is None:
        return [(i * seqlen, (i + 1) * seqlen) for i in range(batch)]
    offsets = cu_seqlens.tolist()
    return list(zip(offsets[:-1], offsets[1:]))


def check_launchable(kernel: object, device: torch.device) -> None:
    """Raise unless ``kernel`` can run on ``device``: off CUDA it must have been built for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise ValueError(
            f"Triton kernels cannot run on {device.type!r} tensors: kernels.kda was imported before "
            "TRITON_INTERPRET=1 was set; set it before the first import"
        )
