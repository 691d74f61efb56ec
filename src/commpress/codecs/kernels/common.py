"""Buffers shared by every kernel backend: fp32 scratch, widening, decode outputs."""

from __future__ import annotations

import threading

import torch

_scratch = threading.local()


def scratch32(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``n`` float32 elements of this thread's scratch buffer on ``device`` (CPU when not
    given; grown on demand, reused).

    Large fresh allocations cost page faults on first touch (glibc maps every block above
    32 MB afresh), as much as the pass that fills them: the kernel paths widen float16 and
    bfloat16 inputs, and decode for a narrower ``out=``, through this buffer instead. Its
    content is valid only until the next call on the same thread, and it never leaves the
    codec call that asked for it. On a GPU the caching allocator already reuses memory, so
    other devices get a fresh tensor."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type != "cpu":
        return torch.empty(n, dtype=torch.float32, device=dev)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        buf = torch.empty(max(n, 1), dtype=torch.float32)
        _scratch.buf = buf
    return buf[:n]


#: The Triton kernels' size limit (int32 indexing): larger tensors take the torch path.
TRITON_MAX_ELEMENTS = 2**31 - 2**16


def widen(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 1-D contiguous float32 tensor: itself when it already is one, else a copy
    (in :func:`scratch32` on a CPU; exact for float16 and bfloat16)."""
    flat = x.reshape(-1)
    if flat.dtype == torch.float32 and flat.is_contiguous():
        return flat
    return scratch32(flat.numel(), flat.device).copy_(flat)


__all__ = ["scratch32", "widen"]
