"""KDA (Kimi Delta Attention) kernels: chunked prefill/training, fused recurrent decode, and a naive reference."""

from kernels.kda.chunk import chunk_kda
from kernels.kda.naive import naive_recurrent_kda
from kernels.kda.triton_recurrent import fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "naive_recurrent_kda"]
