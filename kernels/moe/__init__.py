"""Routed-expert kernels: the torch references live in ``model/layers/moe.py`` (run_experts_loop,
run_experts_packed); ``cpu`` is the fused C path for a few tokens."""
