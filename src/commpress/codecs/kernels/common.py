"""Buffers shared by every kernel backend: fp32 scratch, widening, decode outputs, and
:func:`empty`, the fresh large CPU tensors on huge pages."""

from __future__ import annotations

import threading

import torch

from commpress.errors import CommpressError
from commpress.procs import advise_huge_pages

_scratch = threading.local()


def empty(
    shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, a large CPU one advised onto huge
    pages before anything touches it (:func:`commpress.procs.advise_huge_pages`: from 4 MiB,
    on Linux): the codecs' fresh payloads, decodes and kept buffers are written right away,
    and a fresh block's 4 KiB page faults cost them several times the pass itself. The
    tensor is torch's own (its allocator, storage and lifetime), only its pages differ."""
    t = torch.empty(shape, dtype=dtype, device=device)
    # a plain tensor only: a subclass (torch's FakeTensor while tracing) has no real memory
    if t.device.type == "cpu" and type(t) is torch.Tensor:
        advise_huge_pages(t.data_ptr(), t.numel() * t.element_size())
    return t


def copy_of(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tensor holding ``x`` (converted to ``dtype`` when given): ``x.to(dtype,
    copy=True)``, made by :func:`empty` when ``x`` is contiguous (the same values, the same
    contiguous layout); another layout (channels-last, a view with gaps) keeps torch's copy,
    whose strides follow ``x``'s."""
    if not x.is_contiguous():
        return x.to(dtype=dtype if dtype is not None else x.dtype, copy=True)
    return empty(x.shape, dtype if dtype is not None else x.dtype, x.device).copy_(x)


def zeros(
    shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``torch.zeros`` as :func:`empty` makes it: a large CPU one on huge pages (torch's own
    ``zeros`` is an empty tensor and a fill on a CPU too)."""
    return empty(shape, dtype, device).zero_()


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
    return thread_buffer(n, torch.float32, "scratch32")


def thread_buffer(n: int, dtype: torch.dtype, use: str) -> torch.Tensor:
    """``n`` elements of ``dtype`` of this thread's CPU buffer for ``use`` (one per use and
    dtype, grown on demand and kept while the thread lives; its content undefined): memory
    reused call after call instead of page-faulted afresh. Each ``use`` names one caller's
    purpose, so two never write into the same buffer (:func:`scratch32`'s is
    ``"scratch32"``)."""
    bufs: dict[tuple[str, torch.dtype], torch.Tensor] | None = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    buf = bufs.get((use, dtype))
    if buf is None or buf.numel() < n:
        buf = bufs[(use, dtype)] = empty(max(n, 1), dtype)
    return buf[:n]


def codes_buffer(codes: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    """The packed codes' output of an encode kernel: ``codes`` (the caller's buffer, checked
    by :func:`check_codes`) when given, else a new uint8 tensor of ``nbytes`` on ``device``."""
    if codes is not None:
        return codes
    return empty(nbytes, torch.uint8, device)


def check_codes(codes: torch.Tensor | None, n: int, bits: int, x: torch.Tensor) -> None:
    """Refuse a ``codes=`` buffer that cannot take the packed ``bits``-bit codes of ``n``
    values of ``x``: it must be a contiguous 1-D uint8 tensor of exactly ``ceil(n bits / 8)``
    bytes on ``x``'s device, not overlapping ``x``."""
    if codes is None:
        return
    nbytes = -(-n * bits // 8)
    if not isinstance(codes, torch.Tensor):
        raise CommpressError(f"codes must be a tensor, got {type(codes).__name__}")
    if (codes.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() != nbytes
            or not codes.is_contiguous() or codes.device != x.device):
        raise CommpressError(
            f"codes must be a contiguous 1-D uint8 tensor of {nbytes} bytes on {x.device}; got "
            f"{tuple(codes.shape)} {codes.dtype} on {codes.device}"
            f"{'' if codes.is_contiguous() else ', not contiguous'}"
        )
    lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
    if nbytes and lo < codes.data_ptr() + nbytes and codes.data_ptr() < hi:
        raise CommpressError("codes must not overlap the input")


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
