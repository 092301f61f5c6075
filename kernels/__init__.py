"""Compute kernels for deltaserve (KDA linear attention, MoE, MXFP4)."""
