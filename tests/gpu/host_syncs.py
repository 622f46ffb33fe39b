"""The host syncs one call makes, as the GPU tests count them (torch's sync debug mode)."""

from __future__ import annotations

import warnings

import torch


def host_syncs(fn) -> list[str]:
    """Call ``fn`` twice (the first warms the compiler and the caching allocators) and return
    the host-sync warnings the second call raised."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
