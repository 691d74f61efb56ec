"""Exchanges described as data: the rounds a codec asks the collectives layer to perform.

A codec never calls ``torch.distributed``. When aggregating a tensor across workers needs
communication, :meth:`Codec.reduce` is a *generator* that yields one request per round and is
sent back the round's result. Whoever drives the generator decides how the request crosses the
network: the in-process simulator (:mod:`commpress.codecs.simulate`) sums lists of tensors, the
collectives layer issues real gloo/NCCL calls, a benchmark may only count bytes.

The requests are:

* :class:`AllReduce` -- an element-wise reduction (sum, max or min) of named tensors that every
  worker provides with identical names, shapes and dtypes. The reply is a ``dict`` with the
  same keys holding the reduced tensors. Integer lanes may declare a logical width
  (``int_bits``) narrower than their in-memory dtype, and may ask for saturating addition.
* :class:`AllGather` -- every worker contributes one :class:`Payload`; the reply is the list of
  all workers' payloads in rank order.

Drivers must not modify request tensors in place (codecs may keep references to them), unless
the request says they are the codec's scratch (``AllReduce.scratch``), and must send every
worker the same reply.

The generator finally *returns* a :class:`Reduced` holding the aggregated sum and, when asked
for, this worker's own decoded contribution (needed for error feedback).

Example, a driver for a single worker (world size 1)::

    gen = codec.reduce(x, ctx)
    request = next(gen)
    try:
        while True:
            reply = request.tensors if isinstance(request, AllReduce) else [request.payload]
            request = gen.send(reply)
    except StopIteration as stop:
        reduced = stop.value
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import torch

from commpress.errors import ConfigError

if TYPE_CHECKING:
    from commpress.codecs.base import CodecContext, Payload

ReduceOp: TypeAlias = Literal["sum", "max", "min"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AllReduce:
    """Ask for an element-wise reduction of ``tensors`` across all workers.

    Attributes:
        tensors: named tensors; every worker must send the same names, shapes and dtypes.
        op: ``"sum"``, ``"max"`` or ``"min"``.
        int_bits: for integer tensors, the logical signed width of each lane on the wire
            (for example 4 for THC's 4-bit lanes held in an ``int8`` tensor). ``None`` means the
            dtype's own width. A driver must never let a sum leave this range silently: it
            saturates when ``saturate`` is set and raises :class:`CommpressError` otherwise.
        saturate: add with saturation, ``Sat(x, y) = clamp(x + y, -(2^(b-1) - 1), 2^(b-1) - 1)``
            applied after every pairwise addition (THC's saturation-based aggregation). Only
            valid with ``int_bits``.
        scratch: the tensors are the codec's own scratch, made for this request and read
            afterwards only through the reply: a driver may reduce them in place and reply
            with them (no defensive copy), an exception to the rule that requests are never
            modified.
    """

    tensors: Mapping[str, torch.Tensor]
    op: ReduceOp = "sum"
    int_bits: int | None = None
    saturate: bool = False
    scratch: bool = False

    def __post_init__(self) -> None:
        if self.op not in ("sum", "max", "min"):
            raise ConfigError(f"AllReduce op must be 'sum', 'max' or 'min', got {self.op!r}")
        if self.int_bits is not None:
            if not 1 <= self.int_bits <= 32:
                raise ConfigError(f"AllReduce int_bits must be in [1, 32], got {self.int_bits}")
            for name, t in self.tensors.items():
                if t.is_floating_point() or t.dtype == torch.bool:
                    raise ConfigError(
                        f"AllReduce int_bits needs integer tensors; {name!r} is {t.dtype}"
                    )
        if self.saturate and self.int_bits is None:
            raise ConfigError("AllReduce saturate=True needs int_bits")

    @property
    def wire_bytes(self) -> int:
        """Bytes one worker contributes: logical lane width times element count, per tensor."""
        total = 0
        for t in self.tensors.values():
            bits = self.int_bits if self.int_bits is not None else t.element_size() * 8
            total += math.ceil(t.numel() * bits / 8)
        return total

    @property
    def lane_limit(self) -> int | None:
        """Largest magnitude a lane may hold, ``2^(int_bits-1) - 1``; ``None`` without int_bits."""
        return None if self.int_bits is None else (1 << (self.int_bits - 1)) - 1


@dataclass(frozen=True, slots=True)
class AllGather:
    """Ask for every worker's payload; the reply is a list of payloads in rank order."""

    payload: Payload

    @property
    def wire_bytes(self) -> int:
        return self.payload.nbytes


Request: TypeAlias = AllReduce | AllGather


@dataclass(frozen=True, slots=True, kw_only=True)
class Reduced:
    """What a reduction protocol returns.

    Attributes:
        total: the estimate of the **sum** over workers (the **mean** when the context asked
            for ``average``), in the input's shape, dtype and device. It is identical (bit for
            bit) on every worker.
        local: this worker's own contribution as the others decode it, or ``None`` when the
            context did not ask for it (``CodecContext.need_local``). Error feedback keeps
            ``input - local`` as the residual.
    """

    total: torch.Tensor
    local: torch.Tensor | None = None


#: The type of :meth:`Codec.reduce`: yields requests, is sent replies, returns a ``Reduced``.
Protocol: TypeAlias = Generator[Request, Any, Reduced]


@dataclass(frozen=True, slots=True)
class Bound:
    """A single-round reduction bound to fixed memory: what a codec's :meth:`Codec.reduce`
    protocol does when its one request is one in-place all-reduce, prepared once for a tensor
    reduced again and again in the same memory (a DDP bucket, step after step) by
    :meth:`Codec.bind`.

    A driver calls ``encode(ctx)``, which writes the tensor's encoding (the protocol's
    request) into ``wire``; sums ``wire`` in place over the group with ``op``; then calls
    ``decode(ctx)``, which writes the total (the mean when bound with ``average``) from the
    summed ``wire`` into the output. The bytes sent, the results and ``wire_bytes`` (what one
    worker sends per call, as the protocol's request counts it) are the protocol's, bit for
    bit; nothing is checked or allocated per call. Each call's context must have the rank,
    world size and ``average`` of the context it was bound with.
    """

    wire: torch.Tensor
    wire_bytes: int
    encode: Callable[[CodecContext], object]
    decode: Callable[[CodecContext], object]
    op: ReduceOp = "sum"
