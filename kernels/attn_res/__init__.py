"""Attention-Residual kernels: the torch reference is ``model/layers/attn_res.py`` (and fla-core's
``naive_attnres``); ``cpu`` fuses a decode step's mix and the norm after it into one C call."""
