"""Baselines: send the tensor as it is, or cast to a 16-bit float format.

* ``identity``: the tensor itself (lossless, summable; 8x the element size in bits).
* ``fp16``: IEEE half precision, 16 bits per coordinate. Values beyond +-65504 become +-Inf,
  tiny values flush towards zero, exactly as ``tensor.half()`` does. With ``average`` the
  half-precision payload is divided by the world size *before* the all-reduce (the order of
  PyTorch's ``fp16_compress_hook``), which keeps sums of large gradients finite.
* ``bf16``: bfloat16, 16 bits per coordinate, fp32's range with 8 mantissa bits. Decoding
  saturates: a finite value the output dtype cannot hold (bfloat16 rounds fp16's 65504 up to
  65536) becomes that dtype's largest finite value, never Inf. Like ``tensor.bfloat16()``,
  encoding turns float32 values beyond bfloat16's largest (about 3.39e38, the top 0.4% of
  float32's range) into +-Inf.

All three are element-wise (``elementwise = True``): no state, no randomness, coordinate ``i``
of the output depends on coordinate ``i`` of the input only. Error feedback is never needed
(``feedback_fit == "optional"``): identity is exact and the casts' relative error (``2^-11``,
``2^-8``) is far below what error feedback corrects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from commpress.codecs import kernels
from commpress.codecs.base import (
    Codec,
    CodecContext,
    FeedbackFit,
    Payload,
    saturating_cast,
    shape_numel,
)
from commpress.codecs.common import kept_buffer
from commpress.codecs.protocol import AllReduce, Bound, Protocol, Reduced
from commpress.codecs.registry import register_codec
from commpress.errors import error_context


@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class Identity(Codec):
    """No compression: the payload is the tensor (shares its memory)."""

    codec_id: ClassVar[str] = "identity"
    summable: ClassVar[bool] = True
    lossless: ClassVar[bool] = True
    elementwise: ClassVar[bool] = True
    unbiased: ClassVar[bool] = True
    contractive: ClassVar[bool] = True
    summary: ClassVar[str] = "no compression (reference)"
    nonfinite: ClassVar[str] = "passed through unchanged"

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        return self.make_payload(x, {"values": x.reshape(-1)})

    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        v = self.part(payload, "values", numel=payload.numel, dtype=payload.dtype)
        return v.reshape(payload.shape)

    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int:
        """The tensor's own bytes: ``numel * itemsize``."""
        return shape_numel(shape) * dtype.itemsize

    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Protocol:
        """The default one-round all-reduce, except that a float16 mean divides before the
        sum (as PyTorch's DDP does), so a mean that fits float16 never overflows; other dtypes
        sum first and divide after."""
        if not (ctx.average and ctx.world_size > 1 and tensor.dtype == torch.float16):
            return (yield from Codec.reduce(self, tensor, ctx))
        payload = self.encode(tensor, ctx)
        local = self.decode(payload, ctx) if ctx.need_local else None
        values = payload.parts["values"] / ctx.world_size
        summed = yield AllReduce(tensors={"values": values}, scratch=True)
        total = self.decode(payload.replace(parts=dict(summed), summed=ctx.world_size), ctx)
        return Reduced(total=total, local=local)


_HALF = (torch.float16, torch.bfloat16)


def _cast_into(src: torch.Tensor, dst: torch.Tensor, *, saturate: bool) -> torch.Tensor:
    """``dst`` (contiguous) = ``src`` converted to ``dst``'s dtype, as ``dst.copy_(src)`` or,
    with ``saturate``, :func:`saturating_cast` converts. Between float16 and bfloat16
    (saturating or not) the numba kernel converts in one pass on a CPU: torch's copy between
    the two formats was 2x (bfloat16 to float16) and 4x (float16 to bfloat16) slower on one
    thread, and its saturation takes four passes. torch's float32 conversions run at copy
    speed, so they stay. On a GPU torch's copy stays too: the Triton conversion ran no faster
    on an H100 (64 MB: 0.43-0.47 of a device copy either way, a call's fixed cost dominating;
    docs/kernels.md)."""
    if (src.dtype in _HALF and dst.dtype in _HALF and src.dtype != dst.dtype
            and kernels.backend_for(src) == "numba"):
        kernels.convert(src.reshape(-1), dst.view(-1), saturate=saturate)
        return dst
    return dst.view(-1).copy_(saturating_cast(src, dst.dtype) if saturate else src.reshape(-1))


class _FloatCast(Codec):
    """Shared behaviour of the 16-bit casts."""

    __slots__ = ()
    summable: ClassVar[bool] = True
    elementwise: ClassVar[bool] = True
    # Round to nearest: deterministic, hence (very slightly) biased; within the dtype's range
    # the relative error is at most 2^-11 (fp16) or 2^-8 (bf16), so contractive.
    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = True
    wire_dtype: ClassVar[torch.dtype]

    @property
    def feedback_fit(self) -> FeedbackFit:
        """``"optional"``: the cast is near-exact; error feedback would only cost memory."""
        return "optional"

    encodes_into: ClassVar[bool] = True

    def _encode(
        self, x: torch.Tensor, ctx: CodecContext,
        scratch: dict[str, torch.Tensor] | None = None,
    ) -> Payload:
        flat = x.reshape(-1)
        if scratch is not None and x.dtype != self.wire_dtype:
            # the cast into the buffer kept in ``scratch`` (the same values as a new one)
            return self.make_payload(x, {"values": self._scratch(scratch, x)})
        if x.dtype == self.wire_dtype:
            return self.make_payload(x, {"values": flat})
        # into a new tensor on huge pages (kernels.empty; the same values as ``flat.to``)
        values = kernels.empty(flat.numel(), self.wire_dtype, x.device)
        return self.make_payload(x, {"values": _cast_into(flat, values, saturate=False)})

    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int:
        """Two bytes per element, whatever the input dtype."""
        return shape_numel(shape) * self.wire_dtype.itemsize

    decodes_into: ClassVar[bool] = True

    def _decode(
        self, payload: Payload, ctx: CodecContext, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        v = self.part(payload, "values", numel=payload.numel, dtype=self.wire_dtype)
        # a widening cast is exact: nothing to saturate
        saturate = torch.finfo(payload.dtype).max < torch.finfo(self.wire_dtype).max
        if out is None:
            if payload.dtype == self.wire_dtype:
                return saturating_cast(v, payload.dtype).reshape(payload.shape)
            # a new tensor on huge pages (kernels.empty): the widening copy into 4 KiB pages
            # faulted one by one ran at a quarter of that speed (64 MB)
            out = kernels.empty(payload.shape, payload.dtype, v.device)
        _cast_into(v, out, saturate=saturate)
        return out

    def _one_round(
        self, tensor: torch.Tensor, ctx: CodecContext, out: torch.Tensor | None,
        scratch: dict[str, torch.Tensor] | None,
    ) -> Protocol:
        """:meth:`reduce` and :meth:`reduce_into`: one all-reduce of the cast values (divided
        by the world size first for a mean, as PyTorch's ``fp16_compress_hook`` does), decoded
        into ``out`` when given.

        The cast makes a new tensor (unless ``tensor`` already has the wire dtype): it is the
        codec's scratch, so the mean divides it in place (the same values as dividing into a
        new tensor) and the request lets the driver reduce it in place (``scratch``).
        ``out``, a contiguous tensor of ``tensor``'s shape and dtype (it may be ``tensor``
        itself, which is read before), receives the total, bit-identical to a decode into a
        new tensor, and is the returned total; it is ignored when the reply may alias it.

        ``scratch``, a dict the caller keeps for this tensor from call to call (with ``out``),
        holds the payload's memory: the cast is written into the tensor kept there (the same
        values as a new one), so a large bucket's payload is not page-faulted anew at every
        step (a fresh buffer above malloc's mmap threshold, 32 MB, always is).
        """
        fresh = tensor.dtype != self.wire_dtype  # the cast's new tensor, aliased by nothing
        payload = self.encode(
            tensor, ctx, scratch=scratch if fresh and out is not None else None
        )
        local = self.decode(payload, ctx) if ctx.need_local else None
        values = payload.parts["values"]
        own = fresh
        if ctx.average and ctx.world_size > 1:
            if fresh:
                values.div_(ctx.world_size)
            else:
                values, own = values / ctx.world_size, True
        summed = yield AllReduce(tensors={"values": values}, scratch=own)
        # Not into ``out`` when the reply may be the input's memory, or ``local`` may be.
        into = out if own and (fresh or local is None) else None
        reply = summed.get("values")
        summed_payload = payload.replace(parts=dict(summed), summed=ctx.world_size)
        if (into is not None and isinstance(reply, torch.Tensor) and reply.dtype == self.wire_dtype
                and reply.numel() == into.numel() and reply.device == into.device
                and into.dtype == payload.dtype and into.shape == payload.shape
                and into.is_contiguous()):
            # what the checked decode below does with this reply (the driver's sum of the
            # request above, of the right type and size, into a valid ``out``), without its
            # checks of the payload and of out= (a DDP bucket's callback runs this per step)
            return Reduced(total=self._decode(summed_payload, ctx, out=into), local=local)
        total = self.decode(summed_payload, ctx, out=into)
        return Reduced(total=total, local=local)

    def bind(
        self, tensor: torch.Tensor, ctx: CodecContext, *, out: torch.Tensor,
        scratch: dict[str, torch.Tensor],
    ) -> Bound | None:
        """:meth:`reduce`'s path that casts into ``scratch`` and decodes into ``out``, bound
        (:class:`~commpress.codecs.protocol.Bound`): for a ``tensor`` that is not already of
        the wire dtype and a contiguous ``out`` of its shape, dtype and device (it may be
        ``tensor``), without ``ctx.need_local``; ``None`` otherwise. ``encode`` casts into the
        kept wire buffer and divides it for a mean, ``decode`` is :meth:`_decode` of the summed
        wire buffer into ``out``: the same calls as :meth:`reduce`. A subclass that changes
        the encoding or the reduction (:data:`_BIND_REPLAYS`) gets ``None``."""
        if (ctx.need_local or tensor.dtype == self.wire_dtype or not out.is_contiguous()
                or out.shape != tensor.shape or out.dtype != tensor.dtype
                or out.device != tensor.device or not _binds_as_cast(type(self))):
            return None
        x = self.check_input(tensor)
        wire = self._scratch_buffer(scratch, x)
        divide = ctx.world_size if ctx.average and ctx.world_size > 1 else 0
        # the cast and the division in one pass where a kernel does it faster (the same
        # bits: kernels.convert_divide); a DDP bucket's mean is a float32 buffer into float16
        fused = (kernels.prepare_convert_divide(x, wire, divide)
                 if divide and x.is_contiguous() and kernels.convert_divide_pays(x, wire)
                 else None)
        # the payload of the summed reply, which the in-place sum leaves in ``wire``
        summed = self.make_payload(x, {"values": wire}).replace(summed=ctx.world_size)
        # the cast fails as :meth:`encode` reports it (named after the codec's encode)
        encoding = error_context(f"{self.codec_id}.encode")

        def encode(_: CodecContext) -> None:
            with encoding:
                # the backend read per call, as _cast_into reads it (under use_backend("torch")
                # around a later step the cast is torch's)
                if fused is not None and kernels.backend_for(x) == "numba":
                    fused()
                    return
                _cast_into(x, wire, saturate=False)
            if divide:
                wire.div_(divide)

        def decode(c: CodecContext) -> None:
            self._decode(summed, c, out=out)

        return Bound(wire, wire.numel() * wire.element_size(), encode, decode)

    def _scratch_buffer(self, scratch: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The flat wire-dtype buffer for ``x`` kept in ``scratch`` (replaced when its size,
        dtype or device no longer fit)."""
        return kept_buffer(scratch, "values", x.numel(), self.wire_dtype, x.device)

    def _scratch(self, scratch: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``x`` cast to the wire dtype, flat, in the buffer kept in ``scratch``."""
        return _cast_into(x, self._scratch_buffer(scratch, x), saturate=False)


#: What :meth:`_FloatCast.bind` replays in place of the encode of its protocol
#: (:meth:`_FloatCast._one_round`, run by ``reduce`` and ``reduce_into``).
_BIND_REPLAYS = ("encode", "_encode", "_scratch", "_scratch_buffer", "reduce", "reduce_into",
                 "_one_round")


def _binds_as_cast(cls: type[_FloatCast]) -> bool:
    """Whether ``cls`` encodes and reduces as :class:`_FloatCast` does (a subclass that
    changes the encoding or the protocol, a scaled cast say, has no bound form: its own
    :meth:`reduce` / :meth:`reduce_into` runs)."""
    return all(getattr(cls, name) is getattr(_FloatCast, name) for name in _BIND_REPLAYS)


@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class Fp16(_FloatCast):
    """Cast to IEEE float16."""

    codec_id: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16
    summary: ClassVar[str] = "cast to float16 (the usual baseline)"
    nonfinite: ClassVar[str] = "NaN/Inf kept; finite values beyond +-65504 become +-Inf"


@register_codec
@dataclass(frozen=True, slots=True, kw_only=True)
class Bf16(_FloatCast):
    """Cast to bfloat16."""

    codec_id: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
    summary: ClassVar[str] = "cast to bfloat16"
    nonfinite: ClassVar[str] = (
        "NaN/Inf kept; decoding saturates finite values at the output dtype's largest (fp16's "
        "65504 stays finite); float32/float64 values beyond bfloat16's largest (~3.39e38, "
        "float32's range) become +-Inf on encoding"
    )
