"""Dense products: the torch reference is ``torch.mm`` (``model/layers/fused.py``, ``linear_t``); ``cpu`` is the
C path for the few rows of a decode step, from weights packed once into column panels."""
