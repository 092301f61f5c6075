"""MLA kernels: the torch reference is ``model/layers/mla.py`` (``_decode`` / ``_decode_absorbed``);
``cpu`` is the C latent-space decode attention for a batch of short contexts."""
