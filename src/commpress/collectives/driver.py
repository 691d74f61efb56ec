"""Drive codec protocols with real ``torch.distributed`` calls.

A codec describes aggregation as a generator of requests (:mod:`commpress.codecs.protocol`).
This module turns those requests into collectives on a process group:

* :class:`~commpress.codecs.protocol.AllReduce` -> one ``all_reduce`` per dtype (the named
  tensors are copied into one flat buffer per dtype; request tensors are never modified).
  Integer lanes narrower than their dtype (``int_bits``) are summed in a dtype wide enough for
  the world size and checked for overflow; *saturating* lanes are all-gathered and added on
  every rank with :func:`commpress.codecs.simulate.reduce_tensors` in rank order, so the result
  is bit-identical to the simulator's and identical on all ranks.
* :class:`~commpress.codecs.protocol.AllGather` -> ``all_gather`` of the payload's parts packed
  into one byte buffer; when the codec is not ``fixed_size`` the part shapes are exchanged
  first, buffers are padded to the largest and trimmed after. Large CPU send and receive
  buffers of a protocol's all-gathers are kept for the next all-gather of the same size
  (:class:`GatherBuffers`).

The building block is a *task*: a generator that issues asynchronous ``torch.distributed``
operations and yields the list of their work handles; the scheduler waits for them and resumes
the task. :func:`execute` runs one protocol; :func:`run_tasks` interleaves many (one per bucket)
in a fixed first-in-first-out order, so every rank issues the same operations in the same order
while encoding one bucket overlaps the network transfer of another.

Codec work (encoding, decoding, the codec's protocol steps) may run on an *offload* pool, the
software analogue of a compressing NIC: a task submits it with :func:`offloaded`, which yields
an :class:`OffloadedWork` that the scheduler waits for like any other work. Only the scheduler's
thread ever issues ``torch.distributed`` operations; the pool computes on tensors only.

Every wait is bounded by ``timeout`` (or the process group's own timeout): a peer that dies or
stalls makes the survivors raise :class:`~commpress.errors.ExchangeError` (a
:class:`~commpress.errors.CommpressError`; :class:`~commpress.errors.PeerLostError` or
:class:`~commpress.errors.ExchangeTimeoutError` where the backend's error says which), never
hang.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import functools
import math
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

import torch
import torch.distributed as dist

from commpress.codecs import kernels
from commpress.codecs.base import Codec, CodecContext, Payload, memory_span
from commpress.codecs.protocol import AllGather, AllReduce, Bound, Protocol, Reduced, Request
from commpress.codecs.simulate import reduce_tensors
from commpress.collectives.queue import Steps, resume_final, run_steps
from commpress.errors import (
    CommpressError,
    ExchangeError,
    ExchangeTimeoutError,
    MismatchError,
    PeerLostError,
    error_context,
)

ProcessGroup: TypeAlias = dist.ProcessGroup
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Pending:
    """What a task yields: the work handles of operations it just issued, and what they are.

    Attributes:
        works: ``torch.distributed`` work handles (``None`` entries are skipped).
        what: a short description for error messages (``"round 0 all-gather"``).
        last: the task issues no operation after these (what follows their completion is
            local work); :func:`schedule` then may mark its wait :attr:`Wait.final`.
    """

    works: Sequence[Any]
    what: str
    last: bool = False


#: A task issues operations, yields them as :class:`Pending`, is resumed once they complete.
Task: TypeAlias = Generator[Pending, None, Any]


# ---------------------------------------------------------------------------- offload
class OffloadedWork:
    """Codec work running on an offload pool, waitable like a ``torch.distributed`` work.

    Made by :func:`submit_offload`; a task yields it inside a :class:`Pending` and the
    scheduler's :meth:`Exchange.wait` waits for it in the same first-in-first-out order as the
    network operations. An exception raised by the work (a codec's :class:`CommpressError`)
    is re-raised by :meth:`wait` and :meth:`result` as itself, with the pool thread's traceback.

    Attributes:
        future: the ``concurrent.futures.Future`` of the submitted function.
        what: what the work computes, for error messages (``"reduce-scatter hop 0 encode"``).
    """

    __slots__ = ("future", "what")

    def __init__(self, future: ConcurrentFuture[Any], what: str) -> None:
        self.future = future
        self.what = what

    def is_completed(self) -> bool:
        """Whether the work has finished (successfully or not)."""
        return self.future.done()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the work is done; re-raise its exception, if any, unchanged.

        ``timeout`` (``None``: no limit) bounds the wait; running past it raises
        :class:`CommpressError` (the work keeps running on the pool). Returns ``True``.
        """
        self.result(None if timeout is None else timeout.total_seconds())
        return True

    def result(self, timeout: float | None = None) -> Any:
        """The work's return value (blocks like :meth:`wait`)."""
        try:
            return self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise CommpressError(
                f"offload worker: {self.what} did not finish within {timeout:g}s"
            ) from None
        except concurrent.futures.CancelledError:
            raise CommpressError(
                f"offload worker: {self.what} was cancelled (the offload pool was shut down)"
            ) from None


def submit_offload(pool: ThreadPoolExecutor, fn: Callable[[], T], what: str) -> OffloadedWork:
    """Run ``fn()`` on ``pool`` as the calling thread would; returns its :class:`OffloadedWork`.

    The pool thread adopts the caller's thread-local state that codec arithmetic depends on:
    whether autograd is recording, and on CUDA the caller's current device and stream (so the
    work is ordered after the kernels that produced its inputs, exactly as on the caller's
    thread). Errors become :class:`CommpressError` prefixed with ``"offload worker: <what>"``.

    ``fn`` must only compute on tensors: it must never issue ``torch.distributed`` operations
    (only the scheduler's thread does, in schedule order) nor wait for other offloaded work.
    """
    grad_enabled = torch.is_grad_enabled()
    stream = (
        torch.cuda.current_stream()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None
    )

    def run() -> T:
        with (
            error_context(f"offload worker: {what}"),
            torch.set_grad_enabled(grad_enabled),
            torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
        ):
            return fn()

    with error_context(f"offload worker: submitting {what}"):
        future = pool.submit(run)  # RuntimeError once the pool or the interpreter shut down
    return OffloadedWork(future, what)


def offloaded(
    pool: ThreadPoolExecutor | None, fn: Callable[[], T], what: str
) -> Generator[Pending, None, T]:
    """Task step computing ``fn()``: on ``pool`` when given, else inline on the caller's thread.

    Use as ``value = yield from offloaded(pool, fn, what)``. With a pool, the step submits
    ``fn`` (:func:`submit_offload`), yields ``Pending([work], what)`` and returns the result
    once the scheduler resumes the task; meanwhile the scheduler resumes the other tasks in
    flight (issuing their operations, waiting for their transfers). Without a pool it calls
    ``fn()`` at once and yields nothing, which is exactly the code path without offload.
    """
    if pool is None:
        return fn()
    work = submit_offload(pool, fn, what)
    yield Pending([work], what)
    return work.result()


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

#: Dtypes gloo reduces natively (NCCL reduces all of these except bool); others travel wider.
_NATIVE_REDUCE_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
    }
)

#: Stable small codes for dtypes in exchanged metadata.
_DTYPE_CODES: dict[torch.dtype, int] = {
    dt: i
    for i, dt in enumerate(
        (
            torch.float32,
            torch.float16,
            torch.bfloat16,
            torch.float64,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.uint16,
            torch.uint32,
            torch.uint64,
        )
    )
}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}
_MAX_PART_DIMS = 8
_ALIGN = 8


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype`` in exchanged metadata."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise CommpressError(
            f"cannot send tensors of dtype {dtype}; supported: "
            f"{', '.join(str(d).replace('torch.', '') for d in _DTYPE_CODES)}"
        ) from None


def code_dtype(code: int) -> torch.dtype:
    """Inverse of :func:`dtype_code`."""
    try:
        return _CODE_DTYPES[code]
    except KeyError:
        raise CommpressError(f"unknown dtype code {code} in received metadata") from None


def name_hash(*names: str) -> int:
    """A stable 31-bit hash of strings (part names, fingerprints) for metadata checks."""
    return zlib.crc32("\x00".join(names).encode()) & 0x7FFFFFFF


# ---------------------------------------------------------------------------- exchange
@dataclass(slots=True)
class Exchange:
    """Where and how operations are issued: a process group, this rank, a timeout.

    Attributes:
        group: the process group (``None`` is the default group).
        rank: this process's rank in ``group``.
        world_size: size of ``group``.
        timeout: seconds each wait may take before the exchange is declared failed
            (``None``: the process group's own timeout).
        label: what is being exchanged, for error messages (``"all_reduce of 'w'"``).
        device: device for exchanged metadata (``None``: follow the data).
        stats: byte counters filled as data is sent (shared with derived exchanges):
            ``wire_bytes`` is what this rank's payloads put on the wire (logical lane widths,
            as :attr:`AllReduce.wire_bytes` and :attr:`Payload.nbytes` count them, once per
            message); ``intra_node_bytes`` is the uncompressed traffic of hierarchical
            strategies inside a node.
        writable: a tensor the caller allows the driver to reduce into (in-place
            ``all_reduce``): a request tensor that *is* this memory is all-reduced directly
            instead of being copied first.
    """

    group: ProcessGroup | None
    rank: int
    world_size: int
    timeout: float | None = None
    label: str = "exchange"
    device: torch.device | None = None
    stats: dict[str, int] = field(default_factory=dict)
    writable: torch.Tensor | None = field(default=None, repr=False)
    _backend: str | None = field(default=None, repr=False)

    def may_overwrite(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is exactly the caller's :attr:`writable` tensor (same memory, same
        extent, contiguous), which an in-place reduction may use as its buffer."""
        w = self.writable
        return (
            w is not None
            and t.is_contiguous()
            and w.is_contiguous()
            and t.data_ptr() == w.data_ptr()
            and t.numel() == w.numel()
            and t.dtype == w.dtype
            and t.device == w.device
            and (self.backend != "nccl" or t.is_cuda)
        )

    def count(self, nbytes: int, kind: str = "wire_bytes") -> None:
        """Add ``nbytes`` to the ``kind`` counter of :attr:`stats`."""
        self.stats[kind] = self.stats.get(kind, 0) + int(nbytes)

    @classmethod
    def of(
        cls,
        group: ProcessGroup | None = None,
        *,
        timeout: float | None = None,
        label: str = "exchange",
    ) -> Exchange:
        """The exchange over ``group`` (the default group when ``None``) for this process."""
        require_initialized()
        if timeout is not None and not timeout > 0:
            raise CommpressError(f"timeout must be a positive number of seconds, got {timeout}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise CommpressError(
                "this process is not a member of the given process group; only members may "
                "take part in its collectives"
            )
        return cls(group, rank, dist.get_world_size(group), timeout, label)

    @property
    def backend(self) -> str:
        if self._backend is None:
            self._backend = str(dist.get_backend(self.group)).lower()
        return self._backend

    def comm_device(self, hint: torch.device | None) -> torch.device:
        """The device on which tensors for this group's collectives must live."""
        if self.device is not None:
            return self.device
        if "nccl" in self.backend and (hint is None or hint.type != "cuda"):
            return torch.device("cuda", torch.cuda.current_device())
        return hint if hint is not None else torch.device("cpu")

    def p2p_device(self, hint: torch.device | None) -> torch.device:
        """The device for this group's point-to-point messages.

        As :meth:`comm_device`, except that gloo sends and receives host memory only (given a
        CUDA tensor it fails with "Bad address" and can abort the process), so under gloo
        messages of CUDA tensors are staged through the CPU; its collectives take CUDA tensors.
        """
        device = self.comm_device(hint)
        if device.type != "cpu" and "gloo" in self.backend and "nccl" not in self.backend:
            return torch.device("cpu")
        return device

    def global_rank(self, group_rank: int) -> int:
        """The default-group rank of ``group_rank`` in this exchange's group."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def wait(self, pending: Pending) -> None:
        """Wait for pending works; a failure or a timeout becomes a :class:`CommpressError`.

        An :class:`OffloadedWork` is local codec work, not an exchange: it is waited for
        without :attr:`timeout` (it never depends on a peer) and its error, already a
        :class:`CommpressError` naming the codec step, is re-raised as itself.
        """
        start = time.monotonic()
        what = pending.what
        for work in pending.works:
            if work is None:
                continue
            if isinstance(work, OffloadedWork):
                work.wait()
                continue
            try:
                if self.timeout is None:
                    work.wait()
                else:
                    work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            except Exception as exc:  # gloo/NCCL raise RuntimeError or DistBackendError
                raise self.failure(what, exc, start) from exc

    def failure(self, what: str, exc: Exception, start: float) -> ExchangeError:
        """The error for exchange step ``what`` failing with ``exc`` (begun at ``start``,
        a :func:`time.monotonic` reading).

        Its type says what happened, as far as the backend's error tells:
        :class:`PeerLostError` (a closed connection), :class:`ExchangeTimeoutError` (no answer
        within the timeout), :class:`MismatchError` (ranks issued different operations), else
        :class:`ExchangeError`.
        """
        elapsed = time.monotonic() - start
        limit = "" if self.timeout is None else f" (timeout {self.timeout:g}s)"
        kind, why = classify_failure(exc, elapsed, self.timeout)
        return kind(
            f"{self.label}: {what} failed on rank {self.rank} of {self.world_size} after "
            f"{elapsed:.1f}s{limit}: {type(exc).__name__}: {exc}. {why}; this process group "
            "can no longer be used safely"
        )


#: Backend messages (lower case) of a peer that is gone: gloo's "Connection closed by peer",
#: socket errors, NCCL's remote errors.
_PEER_LOST = ("closed by peer", "reset by peer", "broken pipe", "connection refused",
              "remote worker crash", "remote process exited", "socket closed", "end of file")
#: Messages of a wait that ran out of time (gloo: "Timed out waiting 3000ms for recv operation",
#: "Wait timeout", and "Application timeout caused pair closure" on a pair an earlier timeout
#: closed; NCCL: "Watchdog caught collective operation timeout").
_TIMED_OUT = ("timed out", "timeout")
#: Messages of ranks that issued different operations (gloo: "Received data size doesn't match").
_MISMATCH = ("doesn't match", "does not match", "mismatch")


def classify_failure(
    exc: Exception, elapsed: float, timeout: float | None
) -> tuple[type[ExchangeError], str]:
    """The error type for a backend failure ``exc`` after ``elapsed`` seconds, and a reason."""
    text = str(exc).lower()
    if any(s in text for s in _PEER_LOST):
        return PeerLostError, "A peer died or closed its connection"
    if any(s in text for s in _TIMED_OUT) or (timeout is not None and elapsed >= timeout):
        return ExchangeTimeoutError, (
            "A peer did not answer in time: it is stuck, slow, or never made this call (or "
            "made another one: check='every', or COMMPRESS_CHECK=every, compares every call "
            "across ranks and names the difference)"
        )
    if any(s in text for s in _MISMATCH):
        return MismatchError, "Ranks issued different operations"
    return ExchangeError, "A peer probably died, stalled or issued a different operation"


def require_initialized() -> None:
    """Raise a clear error unless ``torch.distributed`` is available and initialized."""
    if not dist.is_available():
        raise CommpressError("torch.distributed is not available in this PyTorch build")
    if not dist.is_initialized():
        raise CommpressError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group "
            "(for example with backend 'gloo' or 'nccl') before using commpress collectives"
        )


# ---------------------------------------------------------------------------- byte packing
def _part_nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


def packed_layout(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets (aligned to 8) of tensors of the given shapes and dtypes packed in a row."""
    offsets, pos = [], 0
    for shape, dtype in specs:
        offsets.append(pos)
        pos += _part_nbytes(math.prod(shape), dtype)
        pos = -(-pos // _ALIGN) * _ALIGN
    return offsets, pos


def pack_bytes(
    tensors: Sequence[torch.Tensor], size: int | None = None, device: torch.device | None = None,
    *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy ``tensors`` into one uint8 buffer at the offsets of :func:`unpack_bytes`.

    ``size`` pads the buffer (to the largest of all ranks for an all-gather). ``out``, a
    contiguous uint8 tensor of ``size`` bytes (a kept buffer), is written instead of a new
    one: the parts, and zeros in every byte between and after them, so the bytes sent are
    those of a new buffer.
    """
    offsets, total = packed_layout([(tuple(t.shape), t.dtype) for t in tensors])
    size = total if size is None else size
    if out is not None:
        if out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous():
            raise CommpressError(f"pack_bytes: out must be {size} contiguous bytes (uint8)")
        buf, device = out, out.device
    else:
        if device is None:
            device = tensors[0].device if tensors else torch.device("cpu")
        buf = kernels.zeros(size, torch.uint8, device)
    pos = 0
    for off, t in zip(offsets, tensors, strict=True):
        if out is not None and off > pos:
            buf[pos:off].zero_()
        flat = t.detach().reshape(-1).contiguous()
        end = off + flat.numel() * flat.element_size()
        if t.numel():
            buf[off:end] = flat.view(torch.uint8).to(device)
        pos = max(pos, end)
    if out is not None and pos < size:
        buf[pos:].zero_()
    return buf


class GatherBuffers:
    """Send and receive buffers of CPU all-gathers, kept for the next all-gather of the same
    size instead of being freed.

    glibc maps every block above its mmap threshold (at most 32 MiB) afresh, so a fresh
    buffer of that size is page-faulted at every call (8,193 faults for 32 MiB): on 2 gloo
    ranks on loopback a 32 MiB all-gather into fresh buffers took 98-101 ms against 58 ms
    into kept ones (session 30). A task that all-gathers for a codec's protocol takes its
    buffers here (:func:`all_gather_task`'s ``hold``) and gives them back once the protocol
    has used the gathered payloads (:func:`protocol_task`,
    :func:`~commpress.collectives.batched.batched_task`); after a failure they are never
    given back (a collective may still write into them). Buffers of at least
    :attr:`min_bytes` are kept, at most :attr:`limit` bytes in all (0 keeps none); on a GPU
    the caching allocator already reuses memory, so only CPU buffers come from here.
    Thread-safe (a task may finish in a collective's completion callback).
    """

    __slots__ = ("limit", "min_bytes", "reused", "_free", "_kept", "_lock")

    def __init__(self, *, limit: int = 1 << 30, min_bytes: int = 1 << 20) -> None:
        self.limit = limit
        self.min_bytes = min_bytes
        #: How many buffers :meth:`take` handed out again.
        self.reused = 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def wanted(self, nbytes: int, device: torch.device) -> bool:
        """Whether a buffer of ``nbytes`` on ``device`` is one to keep."""
        return device.type == "cpu" and self.min_bytes <= nbytes <= self.limit

    def take(self, nbytes: int) -> torch.Tensor:
        """A CPU uint8 buffer of ``nbytes``: a kept one when there is one, else a new one
        (its content is undefined)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._kept -= nbytes
                self.reused += 1
                return free.pop()
        return kernels.empty(nbytes, torch.uint8)

    def give(self, buffers: Iterable[torch.Tensor]) -> None:
        """Keep ``buffers`` (taken with :meth:`take`, no longer used) while :attr:`limit`
        allows; the others are freed."""
        with self._lock:
            for buf in buffers:
                n = buf.numel()
                if self._kept + n <= self.limit:
                    self._free.setdefault(n, []).append(buf)
                    self._kept += n

    @property
    def kept_bytes(self) -> int:
        """Bytes held for reuse now."""
        return self._kept

    def clear(self) -> None:
        """Free every kept buffer."""
        with self._lock:
            self._free.clear()
            self._kept = 0


#: The process's kept all-gather buffers (``GATHER_BUFFERS.limit = 0`` keeps none;
#: ``GATHER_BUFFERS.clear()`` frees them).
GATHER_BUFFERS = GatherBuffers()


def unpack_bytes(
    buf: torch.Tensor, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]
) -> list[torch.Tensor]:
    """Tensors of the given shapes and dtypes read from a buffer made by :func:`pack_bytes`.

    The results are views into ``buf``.
    """
    offsets, total = packed_layout(specs)
    if buf.numel() < total:
        raise CommpressError(
            f"received {buf.numel()} bytes, the announced parts need {total}; corrupted exchange"
        )
    out = []
    for off, (shape, dtype) in zip(offsets, specs, strict=True):
        nbytes = _part_nbytes(math.prod(shape), dtype)
        out.append(buf[off : off + nbytes].view(dtype).reshape(shape))
    return out


def payload_meta(payload: Payload) -> torch.Tensor:
    """Fixed-layout int64 metadata of a payload's parts (names hash, dtypes, shapes)."""
    names = sorted(payload.parts)
    row = [len(names), name_hash(payload.codec, *names)]
    for name in names:
        t = payload.parts[name]
        if t.dim() > _MAX_PART_DIMS:
            raise CommpressError(
                f"payload part {name!r} has {t.dim()} dimensions; at most {_MAX_PART_DIMS} "
                "can be exchanged"
            )
        dims = list(t.shape) + [0] * (_MAX_PART_DIMS - t.dim())
        row += [dtype_code(t.dtype), t.dim(), *dims]
    return torch.tensor(row, dtype=torch.int64)


def parse_payload_meta(row: Sequence[int]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Part shapes and dtypes from :func:`payload_meta` (parts in sorted-name order)."""
    n, out = int(row[0]), []
    for i in range(n):
        base = 2 + i * (2 + _MAX_PART_DIMS)
        dtype = code_dtype(int(row[base]))
        ndim = int(row[base + 1])
        out.append((tuple(int(d) for d in row[base + 2 : base + 2 + ndim]), dtype))
    return out


# ---------------------------------------------------------------------------- requests
def _wide_int_dtype(limit: int, world_size: int) -> torch.dtype:
    need = limit * world_size
    if need <= 127:
        return torch.int8
    if need <= 2**31 - 1:
        return torch.int32
    return torch.int64


def _transport_dtype(dtype: torch.dtype, op: str) -> torch.dtype:
    if dtype in _NATIVE_REDUCE_DTYPES:
        return dtype
    if dtype == torch.bool:
        return torch.uint8 if op in ("max", "min") else torch.int32
    if dtype.is_floating_point:
        raise CommpressError(f"cannot all-reduce {dtype} tensors; use a supported float dtype")
    return torch.int64  # int16/uint16/uint32: wider lanes, wrapped back by the cast afterwards


def sums_plainly(codec: Codec) -> bool:
    """Whether ``codec``'s reduction is one plain all-reduce of the tensor as it is (what
    :func:`uncompressed_all_reduce` and :func:`plain_sum_task` compute): a lossless,
    element-wise, summable, stateless single-round codec whose payload is the input's own
    memory (the identity codec). The traits are read, and the last point checked once per
    codec configuration by encoding a probe (cached)."""
    known = _SUMS_PLAINLY.get(codec)
    if known is None:
        known = False
        if (codec.lossless and codec.elementwise and codec.summable and not codec.multi_round
                and not codec.stateful):
            probe = torch.zeros(2)
            parts = list(codec.encode(probe).parts.values())
            known = (
                len(parts) == 1 and parts[0].dtype == probe.dtype
                and parts[0].numel() == probe.numel() and parts[0].data_ptr() == probe.data_ptr()
            )
        _SUMS_PLAINLY[codec] = known
    return known


_SUMS_PLAINLY: dict[Codec, bool] = {}


def _plain_buffer(x: torch.Tensor, ex: Exchange) -> torch.Tensor:
    """What a plain all-reduce of ``x`` sums in: the caller's memory when it is
    :attr:`Exchange.writable`, else a copy (counted as wire bytes)."""
    flat = x.reshape(-1)
    buf = flat if ex.may_overwrite(flat) else kernels.copy_of(flat)
    if ex.world_size > 1:
        ex.count(buf.numel() * buf.element_size())
    return buf


def uncompressed_all_reduce(x: torch.Tensor, ex: Exchange, *, average: bool) -> Reduced | None:
    """The identity codec's reduction as one plain all-reduce; ``None`` where it cannot be.

    It computes exactly what the identity codec's one-round protocol computes through
    :func:`protocol_task` (the same buffer rule: the caller's memory when it is
    :attr:`Exchange.writable`, else a copy; the same sum; the same division for a mean), without
    the codec and scheduling layers. Those cost about 60 us of Python per call on a warm cache
    and, measured between a rank's calls in a training-like loop, 0.3-0.4 ms: as much as a 1 MB
    all-reduce over loopback. ``None`` (use the general path) for tensors that must first move
    to the group's device or travel as another dtype. :func:`plain_sum_task` is the same as a
    task, for the scheduler.
    """
    if not direct_path_applies(x, ex):
        return None
    buf = _plain_buffer(x, ex)
    sum_in_place(buf, ex, average=average)
    return Reduced(total=buf.view(x.shape))


def plain_sum_task(
    x: torch.Tensor, ex: Exchange, *, average: bool
) -> Generator[Pending, None, Reduced]:
    """Task computing :func:`uncompressed_all_reduce` (``x`` must pass
    :func:`direct_path_applies`): the all-reduce is issued, yielded to the scheduler, and the
    mean divided after it (float16: before, as :func:`sum_in_place` does)."""
    shot = shoot(ex, x, average=average)
    if shot.wait is not None:
        yield shot.wait.pending
    return shot.finish()


def _divides_first(buf: torch.Tensor, average: bool) -> bool:
    """float16 means divide before the sum (as the identity codec's protocol and PyTorch's DDP
    do), so a mean that fits float16 never overflows in the sum; other dtypes divide after."""
    return average and buf.dtype == torch.float16


def divide_by_world(t: torch.Tensor, world_size: int) -> None:
    """``t.div_(world_size)``, bit for bit, as a multiply where that is exact: for a world
    size that is a power of two its reciprocal is exact, and ``t * 2^-k`` and ``t / 2^k`` are
    the same real number rounded the same way in every floating dtype (subnormal results,
    infinities and NaNs included). On a CPU a float32 multiply of a buffer in cache runs
    1.3-2.4x faster than a division (one thread, 0.26-1.06 M values: 28-194 against 67-254
    us); in a DDP lane's completion callback, where the summed bucket has just arrived, the
    pass is mostly memory traffic and the gain about 8 % of it."""
    if world_size > 1 and world_size & (world_size - 1) == 0 and t.is_floating_point():
        t.mul_(1.0 / world_size)
    else:
        t.div_(world_size)


def direct_path_applies(x: torch.Tensor, ex: Exchange) -> bool:
    """Whether ``x`` can be all-reduced as it is over ``ex``'s group: a dtype the backends sum
    natively, already on the group's device."""
    return x.dtype in _NATIVE_REDUCE_DTYPES and x.device == ex.comm_device(x.device)


def sum_in_place(buf: torch.Tensor, ex: Exchange, *, average: bool) -> None:
    """All-reduce ``buf`` (contiguous, on the group's device) in place over ``ex``'s group, then
    divide it by the world size for a mean.

    Without a timeout of ours (``ex.timeout`` is ``None``: the process group's own timeout
    bounds the wait) it uses the blocking call, which waits exactly as ``work.wait()`` would,
    minus a round trip through a Python work object; with one, it waits on the work under
    that timeout. ``buf`` is the caller's writable buffer or a copy of ours: both ours to change.
    """
    if ex.world_size == 1:
        return
    early = _divides_first(buf, average)
    if early:
        divide_by_world(buf, ex.world_size)
    if buf.numel() and ex.timeout is not None:
        work = dist.all_reduce(buf, _REDUCE_OPS["sum"], group=ex.group, async_op=True)
        ex.wait(Pending([work], "round 0 (all-reduce)"))
    elif buf.numel():
        start = time.monotonic()
        try:
            dist.all_reduce(buf, _REDUCE_OPS["sum"], group=ex.group)
        except Exception as exc:  # gloo/NCCL raise RuntimeError or DistBackendError
            raise ex.failure("round 0 (all-reduce)", exc, start) from exc
    if average and not early:
        divide_by_world(buf, ex.world_size)


def all_reduce_task(
    request: AllReduce, ex: Exchange, *, what: str = "all-reduce", last: bool = False
) -> Generator[Pending, None, dict[str, torch.Tensor]]:
    """Task performing one :class:`AllReduce` request; returns the reply dict. Every path
    yields once: with ``last`` (the caller issues nothing after this request) that yield is
    marked :attr:`Pending.last`."""
    names = sorted(request.tensors)
    tensors = [request.tensors[n] for n in names]
    if ex.world_size == 1:
        # The reduction of one rank's tensor is that tensor: the caller's own buffer when it
        # allowed an in-place result, or the codec's scratch, otherwise a copy (requests are
        # never written to).
        return {
            n: t if (request.scratch or ex.may_overwrite(t)) and not request.saturate
            and request.int_bits is None
            else reduce_tensors([t], request, [0])
            for n, t in zip(names, tensors, strict=True)
        }
    ex.count(request.wire_bytes)
    if sum(t.numel() for t in tensors) == 0:
        return {n: t.clone() for n, t in zip(names, tensors, strict=True)}
    if request.saturate:
        # Saturating addition depends on the order of additions: gather every rank's lanes
        # and add them on each rank in rank order, exactly as the simulator does.
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        device = ex.comm_device(tensors[0].device)
        mine = pack_bytes(tensors, device=device)
        bufs = [kernels.empty(mine.shape, mine.dtype, mine.device) for _ in range(ex.world_size)]
        yield Pending(
            [dist.all_gather(bufs, mine, group=ex.group, async_op=True)],
            f"{what} (saturating all-reduce as all-gather)", last,
        )
        per_rank = [unpack_bytes(b.to(tensors[0].device), specs) for b in bufs]
        order = list(range(ex.world_size))
        return {
            n: reduce_tensors([lanes[i] for lanes in per_rank], request, order)
            for i, n in enumerate(names)
        }
    if request.int_bits is not None and request.op == "sum":
        limit = request.lane_limit
        assert limit is not None
        wide = _wide_int_dtype(limit, ex.world_size)
        flat = torch.cat([t.reshape(-1).to(wide) for t in tensors])
        flat = flat.to(ex.comm_device(flat.device))
        yield Pending(
            [dist.all_reduce(flat, _REDUCE_OPS["sum"], group=ex.group, async_op=True)],
            f"{what} (integer all-reduce)", last,
        )
        peak = int(flat.abs().max()) if flat.numel() else 0
        if peak > limit:
            raise CommpressError(
                f"integer sum overflows {request.int_bits}-bit lanes (|sum| = {peak} > {limit}); "
                "the codec must size its lanes for the world size or saturate"
            )
        out, pos = {}, 0
        for n, t in zip(names, tensors, strict=True):
            out[n] = flat[pos : pos + t.numel()].to(t.device, t.dtype).reshape(t.shape)
            pos += t.numel()
        return out
    if len(tensors) == 1:
        only = tensors[0]
        if only.dtype == _transport_dtype(only.dtype, request.op) and _in_place(request, only, ex):
            # One tensor reduced in its own memory (a cast's payload, the caller's buffer):
            # what the general path below does for it, without its bookkeeping.
            flat = only.reshape(-1)
            yield Pending(
                [dist.all_reduce(flat, _REDUCE_OPS[request.op], group=ex.group, async_op=True)],
                f"{what} (all-reduce)", last,
            )
            return {names[0]: flat.view(only.shape)}
    # Plain reduction: one flat buffer per transport dtype (a copy: requests stay untouched).
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(_transport_dtype(t.dtype, request.op), []).append(i)
    flats: dict[torch.dtype, torch.Tensor] = {}
    works = []
    for wire, idx in groups.items():
        only = tensors[idx[0]]
        if len(idx) == 1 and only.dtype == wire and _in_place(request, only, ex):
            # the caller or the codec allowed an in-place reduction: no copy
            flat = only.reshape(-1)
        else:
            flat = torch.cat([tensors[i].reshape(-1).to(wire) for i in idx])
            flat = flat.to(ex.comm_device(flat.device))
        flats[wire] = flat
        if flat.numel():
            works.append(
                dist.all_reduce(flat, _REDUCE_OPS[request.op], group=ex.group, async_op=True)
            )
    yield Pending(works, f"{what} (all-reduce)", last)
    out = {}
    for wire, idx in groups.items():
        pos = 0
        for i in idx:
            t = tensors[i]
            piece = flats[wire][pos : pos + t.numel()].reshape(t.shape)
            if t.dtype == torch.bool:
                piece = piece != 0
            out[names[i]] = piece.to(t.device, t.dtype)
            pos += t.numel()
    return out


class Shot:
    """One reduction whose only exchange, issued, is in flight: :meth:`finish` completes it
    once :meth:`futures` did (in their completion callback).

    Made by :func:`shoot`. For a request that is one in-place all-reduce (the identity's
    plain sum, a 16-bit cast's protocol) it holds just that collective and finishes without
    the task layers (:func:`plain_sum_task`, :func:`protocol_task` and
    :func:`all_reduce_task`, which a DDP bucket would otherwise traverse twice per step);
    for any other it holds the general task and its final wait. The results, the counts and
    the errors are the same either way.
    """

    __slots__ = ("wait", "task", "protocol", "name", "reply", "divide", "done")

    def __init__(
        self, wait: Wait | None, *, task: Task | None = None, protocol: Protocol | None = None,
        name: str = "", reply: torch.Tensor | None = None, divide: int = 0,
        done: Reduced | None = None,
    ) -> None:
        self.wait, self.task, self.protocol = wait, task, protocol
        self.name, self.reply, self.divide, self.done = name, reply, divide, done

    def futures(self) -> list[torch.futures.Future[Any]]:
        """The futures of the exchange in flight (none when nothing was sent)."""
        return [] if self.wait is None else self.wait.futures()

    def finish(self) -> Reduced:
        """The reduction's result, once :meth:`futures` completed; raises the exchange's
        failure as its task would have (:meth:`Wait.completed`)."""
        if self.done is not None:
            return self.done
        assert self.wait is not None
        if self.task is not None:
            return resume_final(self.task, self.wait)
        self.wait.completed()
        reply = self.reply
        assert reply is not None
        if self.protocol is None:  # a plain sum: its mean's division after the sum
            if self.divide:
                divide_by_world(reply, self.divide)
            return Reduced(total=reply)
        try:
            self.protocol.send({self.name: reply})
        except StopIteration as stop:
            return _check_reduced(stop.value)
        self.protocol.close()
        raise CommpressError(
            f"{self.wait.ex.label}: a single-round codec's protocol asked for round 1; a codec "
            "with more than one exchange must declare multi_round = True"
        )


def shoot(
    ex: Exchange, x: torch.Tensor, *, protocol: Protocol | None = None, average: bool = False,
) -> Shot:
    """Issue a single-exchange reduction now and return it in flight (:class:`Shot`).

    With ``protocol`` (a single-round codec protocol whose one request is an all-reduce:
    ``codec.reduce(x, ...)``; an all-gather may take two exchanges, which a shot cannot wait
    for, so it is refused before anything is issued), the codec encodes and its request is
    issued; without, ``x`` (which must pass
    :func:`direct_path_applies`) is summed as :func:`plain_sum_task` sums it (``average``: a
    mean). Where the request is not one in-place all-reduce of a tensor the backend sums as it
    is, :func:`protocol_task` takes the protocol over from that request and runs it to its
    final wait. Everything issued, counted and computed is what :func:`protocol_task` or
    :func:`plain_sum_task` does.
    """
    if protocol is None:
        buf = _plain_buffer(x, ex)
        if ex.world_size == 1:
            return Shot(None, done=Reduced(total=buf.view(x.shape)))
        early = _divides_first(buf, average)
        if early:
            divide_by_world(buf, ex.world_size)
        if not buf.numel():
            return Shot(None, done=Reduced(total=buf.view(x.shape)))
        work = dist.all_reduce(buf, _REDUCE_OPS["sum"], group=ex.group, async_op=True)
        return Shot(
            Wait(ex, Pending([work], "round 0 (all-reduce)", True), True),
            reply=buf.view(x.shape), divide=ex.world_size if average and not early else 0,
        )
    kind, request = _advance(protocol, None, start=True)
    if kind == "done":
        return Shot(None, done=_check_reduced(request))
    if not isinstance(request, AllReduce):
        protocol.close()
        raise CommpressError(
            f"{ex.label}: a shot takes a protocol whose one request is an all-reduce; this "
            f"one asked for {type(request).__name__}"
        )
    if (len(request.tensors) == 1 and ex.world_size > 1 and not request.saturate
            and request.int_bits is None):
        ((name, only),) = request.tensors.items()
        if (only.numel() and only.dtype == _transport_dtype(only.dtype, request.op)
                and _in_place(request, only, ex)):
            ex.count(request.wire_bytes)
            flat = only.reshape(-1)
            work = dist.all_reduce(flat, _REDUCE_OPS[request.op], group=ex.group, async_op=True)
            return Shot(
                Wait(ex, Pending([work], "round 0 (all-reduce)", True), True),
                protocol=protocol, name=name, reply=flat.view(only.shape),
            )
    # the general task, from that request: an all-reduce is one exchange (one wait)
    general = protocol_task(protocol, ex, first=(kind, request), single_round=True)
    try:
        pending = next(general)
    except StopIteration as stop:
        return Shot(None, done=_check_reduced(stop.value))
    return Shot(Wait(ex, pending, True), task=general)


def bind_plain(x: torch.Tensor, ex: Exchange, *, average: bool) -> Bound | None:
    """:func:`shoot`'s plain sum of ``x`` (no protocol) bound to ``x``'s memory
    (:class:`~commpress.codecs.protocol.Bound`): where ``x`` is :attr:`Exchange.writable`,
    which is summed in place, divided before (float16) or after the sum for a mean, as
    :func:`shoot` does; ``None`` where :func:`shoot` would sum a copy or send nothing (a group
    of one, an empty tensor)."""
    flat = x.reshape(-1)
    if ex.world_size < 2 or not flat.numel() or not ex.may_overwrite(flat):
        return None
    early = _divides_first(flat, average)
    divide = functools.partial(_divide, flat, ex.world_size)
    return Bound(flat, flat.numel() * flat.element_size(),
                 divide if early else _no_work, divide if average and not early else _no_work)


def _divide(t: torch.Tensor, world_size: int, _: Any) -> None:
    divide_by_world(t, world_size)


def _no_work(_: Any) -> None:
    return None


def bound_applies(bound: Bound, ex: Exchange) -> bool:
    """Whether :func:`fire` can issue ``bound`` over ``ex``'s group: a group of two or more, and
    a non-empty contiguous wire tensor that the backend sums as it is, on the group's device
    (what :func:`shoot` requires of a request it issues itself)."""
    w = bound.wire
    return (ex.world_size > 1 and w.numel() > 0 and w.is_contiguous()
            and direct_path_applies(w, ex) and (ex.backend != "nccl" or w.is_cuda))


def fire(ex: Exchange, bound: Bound, ctx: CodecContext) -> torch.futures.Future[Any]:
    """Encode ``bound`` (:class:`~commpress.codecs.protocol.Bound`, accepted by
    :func:`bound_applies`) and issue its in-place all-reduce over ``ex``'s group; the future of
    that collective. Once it completed, :func:`land` finishes the reduction.

    The collective goes to the process group's ``allreduce`` with options made once, the
    call ``dist.all_reduce`` makes after its checks: :func:`bound_applies` made them for this
    wire tensor when the reduction was bound, and a lane replays it every step (about 15-35
    us of Python per call saved)."""
    bound.encode(ctx)
    group = ex.group
    if group is None:  # the default group: dist.all_reduce looks it up
        work = dist.all_reduce(bound.wire, _REDUCE_OPS[bound.op], group=None, async_op=True)
    else:
        work = group.allreduce([bound.wire], _allreduce_options(bound.op))
    return work.get_future()


_ALLREDUCE_OPTIONS: dict[str, Any] = {}


def _allreduce_options(op: str) -> Any:
    """The asynchronous all-reduce options of reduce op ``op`` (made once, read-only)."""
    opts = _ALLREDUCE_OPTIONS.get(op)
    if opts is None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(_REDUCE_OPS[op])
        if hasattr(opts, "asyncOp"):  # torch >= 2.8; earlier, always asynchronous
            opts.asyncOp = True
        _ALLREDUCE_OPTIONS[op] = opts
    return opts


def land(ex: Exchange, bound: Bound, fut: torch.futures.Future[Any], ctx: CodecContext) -> int:
    """:func:`fire`'s reduction finished, in its future's completion callback: the
    collective's failure raised as :meth:`Wait.completed` raises it, else the decode into the
    output; returns the wire bytes to count (what :func:`shoot` counts)."""
    start = time.monotonic()
    try:
        fut.value()
    except Exception as exc:  # gloo/NCCL raise RuntimeError or DistBackendError
        raise ex.failure("round 0 (all-reduce)", exc, start) from exc
    bound.decode(ctx)
    return bound.wire_bytes


def _in_place(request: AllReduce, t: torch.Tensor, ex: Exchange) -> bool:
    """Whether request tensor ``t`` may be reduced in its own memory: it is the caller's
    :attr:`Exchange.writable` tensor, or the codec's scratch (:attr:`AllReduce.scratch`),
    contiguous and already on the group's device."""
    if request.scratch:
        return t.is_contiguous() and t.device == ex.comm_device(t.device)
    return ex.may_overwrite(t)


def _fixed_size(payload: Payload) -> bool:
    from commpress.codecs.registry import codec_class

    try:
        return bool(codec_class(payload.codec).fixed_size)
    except CommpressError:
        return False


def all_gather_task(
    payload: Payload, ex: Exchange, *, fixed_size: bool | None = None, what: str = "all-gather",
    last: bool = False, hold: list[torch.Tensor] | None = None,
) -> Generator[Pending, None, list[Payload]]:
    """Task gathering every rank's payload (rank order); returns the list of payloads. With
    ``last`` (the caller issues nothing after it) its payload exchange is marked
    :attr:`Pending.last`.

    Parts travel as one byte buffer per rank. Unless the codec is ``fixed_size`` the part
    shapes are all-gathered first (a small extra exchange) and buffers are padded to the
    largest rank's size. With ``hold`` (a list the caller keeps), large CPU send and receive
    buffers come from :data:`GATHER_BUFFERS` and are appended to it: the other ranks'
    payloads are views of them, which the caller gives back (:func:`give_back`) once it no
    longer uses those payloads.
    """
    if ex.world_size == 1:
        return [payload]
    ex.count(payload.nbytes)
    names = sorted(payload.parts)
    local = [payload.parts[n] for n in names]
    local_specs = [(tuple(t.shape), t.dtype) for t in local]
    device = ex.comm_device(payload.device)
    if fixed_size is None:
        fixed_size = _fixed_size(payload)
    if fixed_size:
        specs_by_rank = [local_specs] * ex.world_size
    else:
        meta = payload_meta(payload).to(device)
        metas = [torch.empty_like(meta) for _ in range(ex.world_size)]
        yield Pending(
            [dist.all_gather(metas, meta, group=ex.group, async_op=True)],
            f"{what} (payload sizes)",
        )
        rows = [m.cpu().tolist() for m in metas]
        for r, row in enumerate(rows):
            if row[:2] != rows[0][:2]:
                raise MismatchError(
                    f"{ex.label}: ranks disagree on the payload's parts (rank {r} differs from "
                    "rank 0); were they configured with the same codec?"
                )
        specs_by_rank = [parse_payload_meta(row) for row in rows]
        for r, specs in enumerate(specs_by_rank):
            if [dt for _, dt in specs] != [dt for _, dt in local_specs]:
                raise MismatchError(
                    f"{ex.label}: rank {r} sends payload parts of dtypes "
                    f"{[str(dt) for _, dt in specs]}, this rank "
                    f"{[str(dt) for _, dt in local_specs]}"
                )
    sizes = [packed_layout(specs)[1] for specs in specs_by_rank]
    size = max(sizes)
    if size == 0:
        bufs = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(ex.world_size)]
    else:
        if hold is not None and GATHER_BUFFERS.wanted(size * ex.world_size, device):
            mine = pack_bytes(local, size, out=GATHER_BUFFERS.take(size))
            received = GATHER_BUFFERS.take(size * ex.world_size)
            hold += (mine, received)
            bufs = list(received.view(ex.world_size, size).unbind(0))
        else:
            mine = pack_bytes(local, size, device=device)
            bufs = [kernels.empty(mine.shape, mine.dtype, mine.device)
                    for _ in range(ex.world_size)]
        yield Pending(
            [dist.all_gather(bufs, mine, group=ex.group, async_op=True)], f"{what} (payloads)",
            last,
        )
    out: list[Payload] = []
    for r, (buf, specs) in enumerate(zip(bufs, specs_by_rank, strict=True)):
        if r == ex.rank:
            out.append(payload)
            continue
        parts = unpack_bytes(buf.to(payload.device), specs)
        out.append(payload.replace(parts=dict(zip(names, parts, strict=True)), summed=1))
    return out


def _advance(protocol: Protocol, reply: Any, *, start: bool = False) -> tuple[str, Any]:
    """Run a codec protocol to its next request: ``("request", r)`` or ``("done", value)``."""
    try:
        return "request", (next(protocol) if start else protocol.send(reply))
    except StopIteration as stop:
        return "done", stop.value


def protocol_task(
    protocol: Protocol,
    ex: Exchange,
    *,
    first: tuple[str, Any] | None = None,
    pool: ThreadPoolExecutor | None = None,
    single_round: bool = False,
    final: bool = True,
) -> Generator[Pending, None, Reduced]:
    """Task driving a codec's :meth:`~commpress.codecs.base.Codec.reduce` generator.

    Algorithm:

    1. Advance ``protocol`` to its first request (the codec encodes its tensor).
    2. Perform the request (:func:`all_reduce_task` or :func:`all_gather_task`) on ``ex``.
    3. Send the reply into ``protocol``, which decodes and returns :class:`Reduced` or asks
       for another round (back to 2).

    Args:
        protocol: the generator of ``codec.reduce(tensor, ctx)`` (or a protocol such as
            :func:`~commpress.collectives.strategies.gather_protocol`).
        ex: where the requests are performed.
        first: the outcome of step 1 when it was done elsewhere: ``("request", request)`` or
            ``("done", reduced)``.
        pool: an offload pool (one worker thread) on which steps 1 and 3 run -- every
            ``next(protocol)`` / ``protocol.send(reply)``, so all of the codec's work -- while
            the scheduler resumes other tasks. The requests themselves are always issued by the
            scheduler's thread, at the same points of the task, so the order of collectives is
            the same with and without a pool (and on every rank). ``None``: everything runs on
            the scheduler's thread.
        single_round: the codec asks for one request only (not ``multi_round``); without a
            pool, that request's last exchange is then marked :attr:`Pending.last`, and a
            second request is refused before anything of it is issued.
        final: with ``single_round``, whether that last exchange may be marked last (its
            wait *final*: a queue may finish the task in the collective's completion
            callback, on the backend's thread); ``False`` keeps the decode on the scheduler's
            thread.
    """
    last = single_round and pool is None
    if first is None:
        step = functools.partial(_advance, protocol, None, start=True)
        first = yield from offloaded(pool, step, "encode")
    kind, value = first
    round_index = 0
    held: list[torch.Tensor] = []  # kept all-gather buffers, given back when done
    while kind != "done":
        request: Request = value
        if last and round_index:
            raise CommpressError(
                f"{ex.label}: a single-round codec's protocol asked for round {round_index}; "
                "a codec with more than one exchange must declare multi_round = True"
            )
        if isinstance(request, AllReduce):
            reply: Any = yield from all_reduce_task(
                request, ex, what=f"round {round_index}", last=last and final
            )
        elif isinstance(request, AllGather):
            reply = yield from all_gather_task(
                request.payload, ex, what=f"round {round_index}", last=last and final,
                hold=held,
            )
        else:
            raise CommpressError(
                f"{ex.label}: the codec's protocol yielded {type(request).__name__}; expected "
                "AllReduce or AllGather"
            )
        step = functools.partial(_advance, protocol, reply)
        kind, value = yield from offloaded(pool, step, f"codec work after round {round_index}")
        round_index += 1
    reduced = _check_reduced(value)
    give_back(held, [reduced])
    return reduced


def give_back(held: Sequence[torch.Tensor], results: Iterable[Any]) -> None:
    """Give the kept all-gather buffers ``held`` back to :data:`GATHER_BUFFERS` once the
    protocols that gathered into them are done, unless one of their ``results`` (a
    :class:`Reduced`, or a tensor) views one of them: a result is normally decoded into new
    memory, but one that views a received payload keeps those buffers (a later all-gather
    would write into it)."""
    if not held:
        return
    spans = [memory_span(b) for b in held]
    for result in results:
        tensors = (result.total, result.local) if isinstance(result, Reduced) else (result,)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                lo, hi = memory_span(t)
                # the memory of t's storage, which a view through numpy (torch.from_numpy
                # of a received part) holds apart from the buffer's own storage
                if any(lo < end and start < hi for start, end in spans):
                    return
    GATHER_BUFFERS.give(held)


def _check_reduced(value: Any) -> Reduced:
    if not isinstance(value, Reduced):
        raise CommpressError(
            f"a codec protocol returned {type(value).__name__}; it must return Reduced"
        )
    return value


# ---------------------------------------------------------------------------- scheduling
class Wait:
    """What :func:`schedule` yields: calling it waits for ``pending`` (:meth:`Exchange.wait`).

    ``final`` marks the job's last wait: every operation of the job has been issued and
    what follows the completion is local work. A queue may then let later jobs issue their
    operations at once and run the rest of this job when the works complete
    (:meth:`futures`, see :meth:`~commpress.collectives.queue.OrderedQueue.submit_steps`).
    It is only set when nothing would be lost by waiting that way: no timeout of ours
    (the process group's own bounds the wait) and only ``torch.distributed`` works.
    """

    __slots__ = ("ex", "pending", "final")

    def __init__(self, ex: Exchange, pending: Pending, final: bool = False) -> None:
        self.ex, self.pending = ex, pending
        if final and ex.timeout is None:
            for work in pending.works:
                if work is not None and not hasattr(work, "get_future"):
                    final = False
        else:
            final = False
        self.final = final

    def __call__(self) -> None:
        self.ex.wait(self.pending)

    def futures(self) -> list[torch.futures.Future[Any]]:
        """The futures of the pending works (completed when the works are)."""
        return [work.get_future() for work in self.pending.works if work is not None]

    def completed(self) -> None:
        """What calling it does, once :meth:`futures` completed: raise the works' failure
        (as :meth:`Exchange.wait` does). For their completion callbacks, where waiting on a
        work would wait for the callback itself (gloo completes a work after its future)."""
        start = time.monotonic()
        for fut in self.futures():
            try:
                fut.value()
            except Exception as exc:  # gloo/NCCL raise RuntimeError or DistBackendError
                raise self.ex.failure(self.pending.what, exc, start) from exc


def run_tasks(
    tasks: Sequence[Task | Callable[[], Task]], ex: Exchange, *, depth: int = 2
) -> list[Any]:
    """Run tasks with up to ``depth`` in flight; returns their results in task order.

    Scheduling is a first-in-first-out rotation that never depends on timing:

    1. Start tasks in order (run each to its first yield, which issues its first operations)
       until ``depth`` are in flight.
    2. Wait for the oldest in-flight task's operations, resume it (it computes on the reply
       and issues its next operations), and put it at the back; a finished task is retired.
    3. Repeat from 1 until every task has finished.

    Every rank therefore issues identical operation sequences, and the computation done when
    starting task ``i + 1`` (encoding its bucket) runs while task ``i``'s data is on the wire.

    Offloaded codec work (:func:`offloaded`) is one more kind of pending work in this rotation:
    while the pool encodes or decodes for task ``i + 1``, this thread waits for task ``i``'s
    transfer and resumes it. Which operation is issued next depends only on the tasks' own
    sequences of yields, never on which work finishes first, so offloading does not change the
    order of collectives; and only this thread issues them (pool work never touches
    ``torch.distributed``). All ranks must make the same offload choice, since the extra
    yields are points of the rotation.

    Args:
        tasks: tasks, or zero-argument factories called when the task is started (so that
            its encoding happens in pipeline order rather than up front).
        ex: supplies the timeout, this rank and labels for errors.
        depth: tasks in flight at once; 1 runs them one after the other. Larger values
            overlap more but hold more buffers; 2 suffices to hide encoding behind transfer.
    """
    return run_steps(schedule(tasks, ex, depth=depth))


def schedule(
    tasks: Sequence[Task | Callable[[], Task]], ex: Exchange, *, depth: int = 2
) -> Steps[list[Any]]:
    """:func:`run_tasks` as steps (:data:`~commpress.collectives.queue.Steps`): it yields the
    waits (``ex.wait`` of each pending operation, in the rotation's order) instead of waiting,
    so a queue may run its first step on another thread than the rest
    (:meth:`~commpress.collectives.queue.OrderedQueue.submit_steps`)."""
    if depth < 1:
        raise CommpressError(f"pipeline depth must be >= 1, got {depth}")
    results: list[Any] = [None] * len(tasks)
    inflight: deque[tuple[int, Task, Pending]] = deque()
    next_task = 0

    def start(i: int) -> None:
        item = tasks[i]
        task: Task = item if isinstance(item, Generator) else item()
        try:
            pending = next(task)
        except StopIteration as stop:
            results[i] = stop.value
            return
        inflight.append((i, task, pending))

    try:
        while next_task < len(tasks) or inflight:
            while next_task < len(tasks) and len(inflight) < depth:
                start(next_task)
                next_task += 1
            if not inflight:
                continue
            i, task, pending = inflight.popleft()
            final = pending.last and next_task == len(tasks) and not inflight
            if len(tasks) > 1:
                pending = Pending(pending.works, f"part {i}: {pending.what}")
            yield Wait(ex, pending, final)
            try:
                pending = task.send(None)
            except StopIteration as stop:
                results[i] = stop.value
                continue
            inflight.append((i, task, pending))
    except BaseException:
        for _, task, _ in inflight:
            task.close()
        raise
    return results


def execute(
    protocol: Protocol,
    *,
    group: ProcessGroup | None = None,
    timeout: float | None = None,
    label: str = "collective",
) -> Reduced:
    """Run one codec protocol over ``group`` with real collectives; returns its :class:`Reduced`.

    Args:
        protocol: the generator returned by ``codec.reduce(tensor, ctx)``; ``ctx.rank`` and
            ``ctx.world_size`` must be this process's rank and the size of ``group``.
        group: the process group (default: the default group). Every member must call
            ``execute`` with protocols of the same codec configuration, in the same order.
        timeout: seconds each exchange may wait for peers before raising
            :class:`CommpressError` (default: the process group's own timeout).
        label: what is being reduced, used in error messages.

    Calls from several threads on one group must be serialized (use
    :func:`commpress.collectives.queue.queue_for`), otherwise ranks may issue collectives in
    different orders.
    """
    ex = Exchange.of(group, timeout=timeout, label=label)
    return run_tasks([protocol_task(protocol, ex)], ex, depth=1)[0]


__all__ = [
    "Exchange",
    "OffloadedWork",
    "Pending",
    "Task",
    "Wait",
    "GATHER_BUFFERS",
    "GatherBuffers",
    "all_gather_task",
    "all_reduce_task",
    "bind_plain",
    "bound_applies",
    "code_dtype",
    "dtype_code",
    "execute",
    "fire",
    "give_back",
    "land",
    "name_hash",
    "offloaded",
    "pack_bytes",
    "packed_layout",
    "plain_sum_task",
    "payload_meta",
    "protocol_task",
    "require_initialized",
    "run_tasks",
    "schedule",
    "submit_offload",
    "sums_plainly",
    "unpack_bytes",
]
