"""Process helpers: for the worker processes that commpress starts (benchmarks, tests),
:func:`tune_cpu_allocator` for a training process on a CPU, and :func:`advise_huge_pages`, the
huge-page backing of commpress's own large CPU buffers (:func:`use_huge_pages` turns it off)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable

#: ``madvise``'s advice that asks the kernel to back a range with transparent huge pages (Linux's
#: ``MADV_HUGEPAGE``, mman-common.h).
_MADV_HUGEPAGE = 14
#: The smallest block :func:`advise_huge_pages` advises (numpy's threshold for its own arrays):
#: below it a block holds at most one aligned 2 MiB page and usually comes from reused heap.
HUGE_PAGE_MIN_BYTES = 4 << 20
_PAGE = mmap.PAGESIZE  # madvise takes whole pages (4 KiB on x86-64)
_huge_pages = {"on": True}

#: glibc's ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: :func:`tune_cpu_allocator`'s defaults: blocks up to 1 GiB from the heap, and up to 2 GiB
#: of freed memory kept for reuse.
DEFAULT_MMAP_THRESHOLD = 1 << 30
DEFAULT_TRIM_THRESHOLD = 2 << 30


def tune_cpu_allocator(
    *, mmap_threshold: int = DEFAULT_MMAP_THRESHOLD, trim_threshold: int = DEFAULT_TRIM_THRESHOLD
) -> bool:
    """Let this process reuse freed large blocks of CPU memory instead of mapping fresh pages
    for each one (glibc only); ``True`` when the settings took effect, ``False`` where the C
    library is not glibc or refuses the mmap threshold (glibc before the limit was lifted caps
    it at 32 MiB on 64-bit systems, ``man mallopt``); nothing changed then.

    By default glibc serves a block of 32 MiB or more (less after some frees) with a fresh
    ``mmap`` and unmaps it when freed, so the next block of that size is page-faulted again,
    page by page: a 32 MiB payload costs 8,193 faults, and a codec's encode or decode or a
    collective's receive buffer of that size pays them at every step (on the 2-core Xeon of
    the README, 64 MB of bfloat16: decodes into fresh tensors 2.0-3.1 GB/s by default, 3.9-9.6
    with this setting; the fp16 cast's encode 2.1-3.1 against 7.6-9.0; a fresh 64 MiB block and
    its fill 47.7 against 16.4 ms). With this call, blocks up to ``mmap_threshold``
    bytes come from the heap and up to ``trim_threshold`` bytes of freed memory are kept
    there, so repeated blocks of the same sizes are reused, already mapped. That holds for
    blocks made on the main thread (glibc's main arena): another thread's blocks (the DDP
    hook's queue thread, gloo's threads) come from that thread's own arena, and blocks of
    16-80 MiB made and freed on a Python thread were page-faulted afresh each time with or
    without this call (measured, glibc 2.36); a process started with
    ``GLIBC_TUNABLES=glibc.malloc.arena_max=1`` as well serves every thread from the main
    arena (no faults then). The price: the
    process keeps the memory it freed (its resident size stays near its peak), and the
    setting is global to the process (every library's allocations). The same as starting the
    process with ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:glibc.malloc.trim_threshold=...``
    or with jemalloc/tcmalloc preloaded; GPU memory is not concerned.

    Call it once, early (before the large allocations): ``commpress.tune_cpu_allocator()``.
    Thresholds above ``2**31 - 1`` bytes are set to that (``mallopt`` takes a C ``int``).
    """
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 62:
            # a ValueError (this foundation module imports no other): commpress's
            # ConfigError is one too
            raise ValueError(f"tune_cpu_allocator: {name} must be a positive int of bytes, "
                             f"got {value!r}")
    libc = _glibc()
    if libc is None:
        return False
    # the mmap threshold first, the trim threshold only where it took: older glibc refuses
    # mmap thresholds above 32 MiB, and a trim threshold set alone would also freeze the mmap
    # threshold at its 128 KiB start (every block above it mapped afresh)
    if not libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(min(mmap_threshold, 2**31 - 1))):
        return False
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(min(trim_threshold, 2**31 - 1))))


def use_huge_pages(enabled: bool) -> bool:
    """Whether :func:`advise_huge_pages` advises from now on (default: it does); returns the
    previous setting. Off, commpress's large CPU buffers are plain ``torch.empty`` memory
    (the choice for a process that must never wait on the kernel's compaction of memory into
    huge pages, which ``/sys/kernel/mm/transparent_hugepage/defrag`` may allow on a fault)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"use_huge_pages: enabled must be a bool, got {enabled!r}")
    previous = _huge_pages["on"]
    _huge_pages["on"] = enabled
    return previous


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back the whole pages (4 KiB on x86-64) of the ``nbytes`` at ``address`` with
    transparent huge pages (``madvise(MADV_HUGEPAGE)``) before they are first touched;
    ``True`` when the advice was taken. Nothing is done (``False``) for a block under
    :data:`HUGE_PAGE_MIN_BYTES`, off Linux or glibc, when :func:`use_huge_pages` turned it
    off, or where the kernel refuses (transparent huge pages compiled out); the memory is
    the same either way, only its page size differs.

    Why: a fresh block of CPU memory is mapped one 4 KiB page per fault on first touch, and
    those faults (kernel entry, zeroing, page-table update) cost several times the pass that
    fills the block: 64 MiB, fresh and filled, took 17 ms against a hot copy's 3.9 ms on the
    2-core AMD EPYC of the README; advised, 4.3 ms (545 faults, 31 of them of 2 MiB, instead
    of 16,385), and the passes over it take fewer TLB misses afterwards. numpy advises its
    own arrays the same way from 4 MiB; torch does so only when a process starts with
    ``THP_MEM_ALLOC_ENABLE=1``. The advice applies where the system's
    ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise`` (the usual
    default); with ``never`` it has no effect."""
    if not _huge_pages["on"] or nbytes < HUGE_PAGE_MIN_BYTES or address <= 0:
        return False
    madvise = _madvise()
    if madvise is None:
        return False
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    return end > start and madvise(start, end - start, _MADV_HUGEPAGE) == 0


_madvise_fn: list[Callable[[int, int, int], int] | None] = []


def _madvise() -> Callable[[int, int, int], int] | None:
    """glibc's ``madvise`` on Linux (looked up once), else ``None``."""
    if not _madvise_fn:
        libc = _glibc() if sys.platform.startswith("linux") else None
        fn = None
        if libc is not None:
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
        _madvise_fn.append(fn)
    return _madvise_fn[0]


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (it has ``mallopt`` and
    ``gnu_get_libc_version``), else ``None``."""
    try:
        # the C library this process already runs on (find_library would need ldconfig, gcc
        # or ld, and could name another file)
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError, TypeError):  # TypeError: Windows has no CDLL(None)
        return None
    return libc


def exit_when_orphaned(poll_s: float = 1.0) -> None:
    """End this process (exit code 3) soon after its parent dies.

    A spawned worker that is blocked in a collective would otherwise outlive a launcher that
    was killed (``kill -9``, a CI runner's timeout), keep its CPU and ports, and wait for peers
    forever. A daemon thread compares the parent's pid every ``poll_s`` seconds with the one
    seen now; when the parent is gone the process is re-parented and the pid changes.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="commpress-orphan-watch", daemon=True).start()
