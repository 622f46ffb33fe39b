"""Compute ops, one module per op: its pure-torch reference (the definition) and its public entry,
which runs the op's Triton kernel (``epserve.kernels.triton``) where ``dispatch.use_triton`` says
so and the reference otherwise; no Ray, no models."""
