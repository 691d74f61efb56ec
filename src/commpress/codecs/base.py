"""The codec contract: a tensor becomes a :class:`Payload` and a payload becomes a tensor.

A codec is a frozen, slotted, keyword-only dataclass whose fields are its parameters. Its
configuration round-trips through JSON (:meth:`Codec.get_config` /
:func:`commpress.codecs.registry.get_codec`). Codecs are pure functions of their inputs: the
only state they touch is the per-tensor ``state`` dict that the caller owns and hands over in a
:class:`CodecContext`, and they never communicate. Aggregation across workers is described by
:meth:`Codec.reduce`, a generator of requests (see :mod:`commpress.codecs.protocol`).

Writing a codec::

    @register_codec
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Halve(Codec):
        codec_id: ClassVar[str] = "halve"
        summable: ClassVar[bool] = True
        scale: float = param(0.5, "multiplier applied before the cast")

        def validate(self) -> None:
            require(self.scale > 0, "scale must be > 0", self.scale)

        def _encode(self, x, ctx):
            return self.make_payload(x, {"values": (x * self.scale).to(torch.float16)})

        def _decode(self, payload, ctx):
            v = self.part(payload, "values", numel=payload.numel, dtype=torch.float16)
            return (v.float() / self.scale).reshape(payload.shape).to(payload.dtype)
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import math
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from commpress.codecs import kernels
from commpress.codecs.kernels.common import thread_buffer
from commpress.codecs.protocol import AllGather, AllReduce, Bound, Protocol, Reduced
from commpress.errors import CommpressError, ConfigError, PayloadError, error_context

#: How error feedback suits a codec (see :attr:`Codec.feedback_fit`).
FeedbackFit = Literal["needed", "optional", "incompatible"]

#: Input dtypes every codec accepts.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
)


def saturating_cast(
    x: torch.Tensor, dtype: torch.dtype, *, inplace: bool = False
) -> torch.Tensor:
    """``x.to(dtype)`` with finite values beyond ``dtype``'s range clamped to its largest
    finite value (keeping their sign); NaN and +-Inf stay as they are.

    Decoders use it so that a finite estimate never turns into an Inf just because of the
    output cast (bfloat16's 65536, the rounding of fp16's 65504, is clamped back to 65504 for a
    float16 output, for example). A no-op cast when ``dtype`` is at least as wide as ``x``'s.
    With ``inplace`` the clamp may be done in ``x`` (a scratch accumulator the caller drops).
    """
    if x.dtype == dtype:
        return x
    top = torch.finfo(dtype).max
    if torch.finfo(x.dtype).max <= top:
        return x.to(dtype)
    if x.device.type == "cpu" and x.numel() and x.dtype.itemsize > dtype.itemsize:
        # On a CPU, values that are all finite (one ``aminmax``: NaN and +-Inf show in it)
        # need only the clamp, in ``x``'s wider dtype where ``top`` is exact, and the cast:
        # the same values without the ``isinf`` and ``where`` passes below (about half the
        # cast of Random-K's decoded values)
        low, high = (float(t) for t in torch.aminmax(x))
        if math.isfinite(low) and math.isfinite(high):
            return (x.clamp_(-top, top) if inplace else x.clamp(-top, top)).to(dtype)
    return _saturate(x, dtype, top)


def _saturate(x: torch.Tensor, dtype: torch.dtype, top: float) -> torch.Tensor:
    """:func:`saturating_cast`'s general path (any values, any device)."""
    # Clamp in float32/float64, where ``top`` is exact (bfloat16 cannot hold 65504).
    work = torch.float64 if torch.float64 in (x.dtype, dtype) else torch.float32
    wide = x.to(work)
    clamped = wide.clamp(-top, top)  # NaN stays NaN
    return torch.where(torch.isinf(wide), wide, clamped).to(dtype)


def add_into(
    acc: torch.Tensor, values: torch.Tensor, *, first: bool = False, kernel: bool = True
) -> None:
    """``acc += values`` with ``values`` (of ``acc``'s shape) widened exactly to ``acc``'s
    float32 or float64 dtype first, as :meth:`Codec.sum_decoded` adds decodes; with
    ``first``, ``acc`` (its content undefined) becomes ``0.0 + values``, the bits of zeroing
    it and then adding. CPU values into a contiguous float32 ``acc`` on the numba backend:
    one pass (:func:`kernels.add_widened`; float32 values only with ``first``, torch's
    same-dtype add being one pass already); otherwise torch, 16-bit values through a widening
    copy into this thread's kept buffer (torch's mixed-dtype add runs ~3x slower on a CPU
    than that copy and a same-dtype add). Without ``kernel``, torch's passes always (a NaN's
    bits are then torch's)."""
    if (kernel and acc.dtype == torch.float32 and acc.is_contiguous()
            and (values.dtype in (torch.bfloat16, torch.float16)
                 or (first and values.dtype == torch.float32))
            and kernels.use_kernels(values)):
        kernels.add_widened(values, acc, first=first)
        return
    if first:
        acc.zero_()
    if values.dtype == acc.dtype:
        acc.add_(values)
        return
    wide = _decode_buffer(values.shape, acc.dtype, values.device)
    acc.add_(values if wide is None else wide.copy_(values))


def _decode_buffer(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device,
    use: str = "decode",
) -> torch.Tensor | None:
    """A contiguous tensor of ``shape`` and ``dtype`` in this thread's reused buffer for
    ``use`` (one per use and dtype, grown on demand, its content undefined) for
    :meth:`Codec.sum_decoded`: a decode or its widening, added to the accumulator and then no
    longer used (``"decode"``), or the accumulator itself where only its cast to a narrower
    dtype is returned (``"acc"``). A large fresh tensor would be page-faulted anew at every
    call. ``None`` off the CPU (a GPU's caching allocator already reuses memory) or when
    empty."""
    n = shape_numel(tuple(shape))
    if device.type != "cpu" or n == 0:
        return None
    return thread_buffer(n, dtype, f"sum_decoded.{use}").view(shape)


def fits_out(out: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``out`` can receive a reduction of ``tensor``: a contiguous tensor of its
    shape, dtype and device."""
    return (out.is_contiguous() and out.shape == tensor.shape and out.dtype == tensor.dtype
            and out.device == tensor.device)


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[start, end)`` of ``t``'s storage."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the storages of ``a`` and ``b`` overlap (on one device): views of one
    storage, or a view through numpy (``torch.from_numpy`` of a tensor's ``numpy()``), which
    holds a storage of its own inside the other's."""
    (a0, a1), (b0, b1) = memory_span(a), memory_span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


def _may_reduce_into(cls: type[Codec]) -> bool:
    """Whether ``cls.reduce_into`` can serve ``out=``: no class or mixin overrides
    ``reduce`` below the class that defines ``reduce_into`` (a subclass's own ``reduce`` is
    otherwise what both must run), an overridden ``sum_decoded`` takes ``out=`` (one written
    before it had one does not), and the default protocol is not a summable codec's (its
    decode of the all-reduced payload does not use ``out``)."""
    def owner(name: str) -> type:
        return next(k for k in cls.__mro__ if name in k.__dict__)

    reduce_from = owner("reduce")
    if reduce_from is not Codec and not issubclass(owner("reduce_into"), reduce_from):
        return False
    if owner("_one_round") is Codec and cls.summable:
        return False
    if cls.sum_decoded is Codec.sum_decoded:
        return True
    try:
        return "out" in inspect.signature(cls.sum_decoded).parameters
    except (TypeError, ValueError):  # no signature to read: not known to take out=
        return False


def shape_numel(shape: tuple[int, ...] | torch.Size) -> int:
    """Elements of a tensor of ``shape`` (1 for a 0-d shape ``()``)."""
    return math.prod(int(d) for d in shape)


def param(default: Any, doc: str) -> Any:
    """Declare a codec parameter with its default and a one-line description."""
    return field(default=default, metadata={"doc": doc})


def require(condition: bool, message: str, value: Any = dataclasses.MISSING) -> None:
    """Raise :class:`CommpressError` with ``message`` (and the offending value) unless true."""
    if not condition:
        if value is not dataclasses.MISSING:
            message = f"{message}, got {value!r}"
        raise ConfigError(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class Payload:
    """What crosses the network for one tensor: named tensors plus what the receiver knows.

    ``shape``, ``dtype`` and the codec configuration are agreed by all workers beforehand (every
    rank holds the same model), so only ``parts`` are counted as wire bytes.

    Attributes:
        codec: id of the codec that produced it.
        fingerprint: fingerprint of that codec's configuration; decoding with a differently
            configured codec is refused.
        shape: shape of the encoded tensor.
        dtype: dtype of the encoded tensor.
        parts: the wire tensors, by name.
        lane_bits: logical bits per element for parts whose in-memory dtype is wider than what
            is sent (for example 4-bit integer lanes held in ``int8``); other parts count their
            dtype's full width.
        summed: how many workers' payloads were added into this one (1 for a fresh payload).
    """

    codec: str
    fingerprint: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: Mapping[str, torch.Tensor]
    lane_bits: Mapping[str, int] = field(default_factory=dict)
    summed: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact size on the wire in bytes (sum over parts, at their logical lane width)."""
        total = 0
        for name, t in self.parts.items():
            bits = self.lane_bits.get(name, t.element_size() * 8)
            total += math.ceil(t.numel() * bits / 8)
        return total

    @property
    def bits_per_coordinate(self) -> float:
        """Wire bits per element of the original tensor (0 for an empty tensor)."""
        return 8.0 * self.nbytes / self.numel if self.numel else 0.0

    @property
    def device(self) -> torch.device:
        for t in self.parts.values():
            return t.device
        return torch.device("cpu")

    def replace(self, **changes: Any) -> Payload:
        """A copy with some fields changed (for example the summed ``parts``)."""
        unknown = changes.keys() - _PAYLOAD_FIELDS
        if unknown:
            raise TypeError(f"Payload.replace: unknown fields {sorted(unknown)}")
        get = changes.get
        return Payload(
            codec=get("codec", self.codec), fingerprint=get("fingerprint", self.fingerprint),
            shape=get("shape", self.shape), dtype=get("dtype", self.dtype),
            parts=get("parts", self.parts), lane_bits=get("lane_bits", self.lane_bits),
            summed=get("summed", self.summed),
        )


_PAYLOAD_FIELDS = frozenset(f.name for f in dataclasses.fields(Payload))


@dataclass(slots=True, kw_only=True)
class CodecContext:
    """Everything a codec may know besides the tensor: who it is and the caller-owned state.

    Attributes:
        rank: this worker's index in ``[0, world_size)``.
        world_size: number of workers taking part in the reduction.
        step: training step (or any counter the caller advances); seeds depend on it, so two
            encodings with equal ``step``, ``key`` and ``rank`` are identical.
        key: a stable name for the tensor (parameter or bucket name); seeds and state use it.
        state: mutable per-tensor codec state owned by the caller, for example PowerSGD's warm
            start ``Q``. Keep one dict per (codec, key) and pass it again next step. It holds
            only tensors and plain values, so it can be checkpointed.
        need_local: ask :meth:`Codec.reduce` for this worker's decoded contribution (error
            feedback needs it; skipping it saves a decode).
        average: ask :meth:`Codec.reduce` for the mean over workers instead of the sum (codecs
            may then scale before exchanging, as the fp16 cast does to avoid overflow).
    """

    rank: int = 0
    world_size: int = 1
    step: int = 0
    key: str = ""
    state: dict[str, Any] = field(default_factory=dict)
    need_local: bool = False
    average: bool = False

    def __post_init__(self) -> None:
        rank, world, step = self.rank, self.world_size, self.step
        if (type(rank) is int and type(world) is int and type(step) is int
                and type(self.key) is str and 0 <= rank < world and step >= 0):
            return  # the common case, checked in one go (contexts are made for every call)
        for name in ("rank", "world_size", "step"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool),
                f"CodecContext.{name} must be an int",
                value,
            )
        require(isinstance(self.key, str), "CodecContext.key must be a str", self.key)
        require(self.world_size >= 1, "CodecContext.world_size must be >= 1", self.world_size)
        require(
            0 <= self.rank < self.world_size,
            f"CodecContext.rank must be in [0, {self.world_size})",
            self.rank,
        )
        require(self.step >= 0, "CodecContext.step must be >= 0", self.step)

    def generator(self, seed: int, *, shared: bool, device: torch.device) -> torch.Generator:
        """A torch generator seeded from ``(seed, key, step)`` and, unless ``shared``, the rank.

        ``shared=True`` gives every worker the same stream (Random-K's common coordinates,
        THC's common rotation); ``shared=False`` gives independent streams (stochastic rounding).
        """
        who = "shared" if shared else f"rank{self.rank}"
        material = f"{seed}/{self.key}/{self.step}/{who}".encode()
        digest = hashlib.blake2b(material, digest_size=8).digest()
        g = torch.Generator(device=device)
        g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        return g


_HINTS_CACHE: dict[type, dict[str, Any]] = {}


def _type_hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS_CACHE:
        _HINTS_CACHE[cls] = typing.get_type_hints(cls)
    return _HINTS_CACHE[cls]


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits a simple parameter annotation (int, float, bool, str, Literal)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # richer annotations are checked by the codec's own validate()


def _describe_hint(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_describe_hint(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


_FINGERPRINTS: dict[Codec, str] = {}


class Codec(ABC):
    """Base class of all codecs. Subclasses are frozen slotted keyword-only dataclasses.

    Class attributes every codec sets:
        codec_id: registry id (``"topk"``).
        summable: aggregation needs only all-reduces (sums), never an all-gather, so the
            traffic per worker does not grow with the world size. For a single-round codec
            this means its payloads add element-wise and decoding the sum gives the sum of the
            decodings; a multi-round codec (PowerSGD, TopKC, THC) all-reduces the messages of
            each round, but its standalone payloads need not add.
        lossless: ``decode(encode(x))`` is bit-identical to ``x``.
        fixed_size: payload part shapes depend only on the configuration and the input's shape
            and dtype (collectives can then skip exchanging sizes).
        multi_round: :meth:`reduce` needs more than one exchange.

    Traits that decide how a codec may be used (also class attributes; a codec whose trait
    depends on a parameter overrides it with a property, so read them from an instance):
        elementwise: output coordinate ``i`` depends only on input coordinate ``i``, and the
            codec keeps no state and draws no random numbers (identity and the 16-bit casts):
            encoding a concatenation equals concatenating the encodings, so such codecs can
            be applied to any grouping of tensors.
        stateful: the codec may keep per-tensor state in ``ctx.state`` across steps
            (PowerSGD's warm start ``Q``; netzip's previous-step references with
            ``delta="previous"``); the caller must keep that dict per tensor and may need to
            roll it back after a skipped step. A codec that is not stateful never writes it.
        unbiased: ``E[decode(encode(x))] = x`` over the codec's randomness (set automatically,
            with ``contractive``, on classes that declare ``lossless = True``).
        contractive: ``E||C(x) - x||^2 <= (1 - delta) ||x||^2`` for some ``delta > 0`` and
            every ``x`` (inside the dtype's range), with ``C = decode . encode``: the
            condition under which error feedback converges. Top-K (``delta = K/d``), sign,
            unscaled Random-K (``delta = k/d``) and PowerSGD (a projection) are contractive;
            Random-K scaled by ``d/k`` (error ``(d/k - 1) ||x||^2``), TernGrad and
            coarse QSGD are not: their error-feedback residual grows without bound.

    From these, :attr:`feedback_fit` says whether error feedback is ``"needed"``,
    ``"optional"`` or ``"incompatible"``. A codec that declares nothing counts as biased and
    contractive (error feedback on by default, as for every lossy codec before these traits
    existed).
    """

    __slots__ = ()

    codec_id: ClassVar[str]
    summable: ClassVar[bool] = False
    lossless: ClassVar[bool] = False
    fixed_size: ClassVar[bool] = True
    multi_round: ClassVar[bool] = False
    #: One line shown by ``commpress codecs``.
    summary: ClassVar[str] = ""
    #: What the codec does with NaN/Inf inputs (shown in docs, checked by tests).
    nonfinite: ClassVar[str] = "non-finite inputs give non-finite outputs"
    elementwise: ClassVar[bool] = False
    stateful: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = True
    #: ``_decode`` accepts ``out=`` and writes the decoding into it (see :meth:`decode`).
    decodes_into: ClassVar[bool] = False
    #: ``_encode`` accepts ``scratch=`` and writes its large payload parts into buffers kept
    #: there (see :meth:`encode`): the 16-bit casts, and the packed codes of minmax, QSGD,
    #: TernGrad and sign on their kernel paths (numba, Triton).
    encodes_into: ClassVar[bool] = False
    #: :meth:`reduce_into` uses ``out=`` (writes the total into the caller's buffer) and
    #: ``scratch=`` (a dict the caller keeps, to reuse payload buffers across steps): this
    #: class's one-round protocol (the all-gather of minmax, QSGD, TernGrad, sign, Top-K, DGC)
    #: and the 16-bit casts. Set to ``False`` for a class (or mixin) that overrides
    #: :meth:`reduce` without overriding :meth:`reduce_into` below it: its ``reduce_into``
    #: is then its ``reduce``.
    reduces_into: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not _may_reduce_into(cls):
            cls.reduces_into = False
        elif "reduce_into" in cls.__dict__ and "reduces_into" not in cls.__dict__:
            cls.reduces_into = True  # its own reduce_into, below any reduce
        # A lossless codec is exact, hence unbiased and contractive, whatever it declares.
        if cls.__dict__.get("lossless", False):
            cls.unbiased = True
            cls.contractive = True

    @property
    def feedback_fit(self) -> FeedbackFit:
        """How error feedback (EF) suits this codec, as configured:

        * ``"needed"``: biased and contractive (Top-K, sign, PowerSGD, ...). Its error is
          systematic, and EF, which re-sends what was dropped, is what makes training converge
          like uncompressed SGD; ``error_feedback=None`` turns it on.
        * ``"optional"``: EF is harmless but not needed: lossless codecs, the near-exact 16-bit
          casts, and unbiased contractive codecs (their error averages out);
          ``error_feedback=None`` leaves it off.
        * ``"incompatible"``: not contractive (Random-K scaled by ``d/k``, TernGrad, coarse
          QSGD): the EF residual grows without bound, so ``error_feedback=True`` is refused.
        """
        if self.lossless:
            return "optional"
        if not self.contractive:
            return "incompatible"
        if self.unbiased:
            return "optional"
        return "needed"

    # ------------------------------------------------------------------ configuration
    def __post_init__(self) -> None:
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            hint = hints.get(f.name)
            if hint is not None and not _matches(value, hint):
                raise ConfigError(
                    f"{self.codec_id}: parameter {f.name!r} must be {_describe_hint(hint)}, "
                    f"got {value!r}"
                )
            if hint is float and isinstance(value, int):
                object.__setattr__(self, f.name, float(value))
        with error_context(self.codec_id):
            self.validate()

    def validate(self) -> None:  # noqa: B027 - optional hook, empty by default
        """Check parameter values; raise via :func:`require`. Called after construction."""

    @classmethod
    def parameters(cls) -> list[tuple[str, Any, str]]:
        """``(name, default, description)`` for each parameter, in declaration order."""
        return [
            (f.name, f.default, f.metadata.get("doc", ""))
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        ]

    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable configuration: ``{"id": codec_id, **parameters}``."""
        config: dict[str, Any] = {"id": self.codec_id}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            config[f.name] = getattr(self, f.name)
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        """Build a codec from :meth:`get_config` output (the id must match this class)."""
        from commpress.codecs.registry import get_codec

        codec = get_codec(config)
        if not isinstance(codec, cls):
            raise ConfigError(
                f"config id {config.get('id')!r} does not describe a {cls.__name__} codec"
            )
        return codec

    def fingerprint(self) -> str:
        """A short stable hash of the configuration (equal on every rank for equal configs).

        Cached per configuration: codecs are frozen, and equal codecs share a fingerprint.
        """
        cached = _FINGERPRINTS.get(self)
        if cached is None:
            text = json.dumps(self.get_config(), sort_keys=True, separators=(",", ":"))
            cached = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
            if len(_FINGERPRINTS) >= 4096:
                _FINGERPRINTS.clear()
            _FINGERPRINTS[self] = cached
        return cached

    # ------------------------------------------------------------------ public API
    def encode(
        self,
        tensor: torch.Tensor,
        ctx: CodecContext | None = None,
        *,
        scratch: dict[str, torch.Tensor] | None = None,
    ) -> Payload:
        """Encode ``tensor`` into a payload (``ctx`` defaults to a single worker at step 0).

        ``scratch``, when given, is a dict the caller keeps for this tensor from call to
        call: codecs with :attr:`encodes_into` write their large payload parts into buffers
        kept there (made on the first call, replaced when the size, dtype or device no longer
        fit), so a large payload is not page-faulted anew at every call (a fresh block above
        malloc's mmap threshold, 32 MB, always is). The payload is then valid only until the
        next encode with the same dict; its values are bit-identical to a payload encoded
        without ``scratch``. Other codecs ignore it."""
        x = self.check_input(tensor)
        with error_context(f"{self.codec_id}.encode"):
            context = ctx if ctx is not None else CodecContext()
            if scratch is not None and self.encodes_into:
                return self._encode(x, context, scratch=scratch)  # type: ignore[call-arg]
            return self._encode(x, context)

    def decode(
        self,
        payload: Payload,
        ctx: CodecContext | None = None,
        *,
        shape: tuple[int, ...] | torch.Size | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode ``payload`` into a tensor of its original shape, dtype and device.

        ``shape``, when given, is the shape the caller expects; a payload of another shape is
        refused instead of being silently reshaped.

        ``out``, when given, is a contiguous tensor of the payload's shape, dtype and device
        that receives the decoding (and is returned): a caller that reuses one buffer does not
        pay the page faults of freshly allocated memory. The values are bit-identical to a
        decode without ``out``. Codecs with :attr:`decodes_into` write into it directly; the
        others decode as usual and copy. ``out`` must not share memory with the payload.
        """
        self.check_payload(payload, shape)
        if out is not None:
            self.check_out(out, payload)
        context = ctx if ctx is not None else CodecContext()
        with error_context(f"{self.codec_id}.decode", wrap_as=PayloadError):
            result = self._decode_maybe_into(payload, context, out)
        self.check_decoded(result, payload)
        if out is None:
            return result
        if result.data_ptr() != out.data_ptr() or result.numel() != out.numel():
            out.copy_(result)
        return out

    def _decode_maybe_into(
        self, payload: Payload, ctx: CodecContext, out: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`_decode`, into ``out`` when one is given and the codec
        :attr:`decodes_into` (the caller copies otherwise)."""
        if out is not None and self.decodes_into:
            return self._decode(payload, ctx, out=out)  # type: ignore[call-arg]
        return self._decode(payload, ctx)

    def check_decoded(self, result: torch.Tensor, payload: Payload) -> None:
        """Raise :class:`CommpressError` unless ``result``, a decoding of ``payload``, has the
        payload's shape and dtype (another is a bug of the codec, not of the payload)."""
        if tuple(result.shape) != tuple(payload.shape) or result.dtype != payload.dtype:
            raise CommpressError(
                f"{self.codec_id}.decode produced {tuple(result.shape)} {result.dtype}, "
                f"expected {tuple(payload.shape)} {payload.dtype} (codec bug)"
            )

    def check_out(self, out: Any, payload: Payload, what: str = "decode") -> None:
        """Refuse an ``out=`` buffer that cannot hold the decoding of ``payload`` (the error
        names ``what``, the method given it)."""
        if not isinstance(out, torch.Tensor):
            raise ConfigError(
                f"{self.codec_id}.{what}: out must be a torch.Tensor, got {type(out).__name__}"
            )
        if (
            tuple(out.shape) != tuple(payload.shape)
            or out.dtype != payload.dtype
            or out.device != payload.device
            or not out.is_contiguous()
        ):
            raise ConfigError(
                f"{self.codec_id}.{what}: out must be a contiguous {tuple(payload.shape)} "
                f"{payload.dtype} tensor on {payload.device}, got {tuple(out.shape)} "
                f"{out.dtype} on {out.device} (contiguous={out.is_contiguous()})"
            )

    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Protocol:
        """Aggregate ``tensor`` with the other workers: a generator of exchange requests.

        The default protocol has one round: summable codecs all-reduce their payload parts and
        decode the sum; the others all-gather payloads and add the decodings in rank order.
        With ``ctx.average`` the sum is divided by the world size. Multi-round codecs override
        this.
        """
        return self._one_round(tensor, ctx, None, None)

    def reduce_into(
        self, tensor: torch.Tensor, ctx: CodecContext, *, out: torch.Tensor | None = None,
        scratch: dict[str, torch.Tensor] | None = None,
    ) -> Protocol:
        """:meth:`reduce`, with the total written into ``out`` where the codec
        :attr:`reduces_into` (else :meth:`reduce` itself, ``out`` and ``scratch`` unused: a
        ``reduce`` that calls ``reduce_into`` must then come with its own ``reduce_into``).

        ``out``, a contiguous tensor of ``tensor``'s shape, dtype and device (it may be
        ``tensor`` itself, which is read before), receives a gathered total
        (:meth:`sum_decoded`'s ``out``), bit-identical to a new one, and is the returned total;
        another ``out`` is ignored. ``scratch``, a dict the caller keeps for this tensor from
        call to call (with a usable ``out`` only), holds the large payload parts of a codec
        that :attr:`encodes_into` (:meth:`encode`), so that they are not page-faulted anew at
        every step."""
        if not self.reduces_into:
            return self.reduce(tensor, ctx)
        return self._one_round(tensor, ctx, out, scratch)

    def _one_round(
        self, tensor: torch.Tensor, ctx: CodecContext, out: torch.Tensor | None,
        scratch: dict[str, torch.Tensor] | None,
    ) -> Protocol:
        """The default protocol of :meth:`reduce` (see :meth:`reduce_into` for ``out`` and
        ``scratch``)."""
        into = out if out is not None and fits_out(out, tensor) else None
        payload = self.encode(tensor, ctx, scratch=scratch if into is not None else None)
        local = self.decode(payload, ctx) if ctx.need_local else None
        if into is not None and (
            tuple(payload.shape) != tuple(into.shape) or payload.dtype != into.dtype
            or payload.device != into.device
            or (local is not None and _shares_memory(local, into))
        ):
            # a payload of another dtype (a codec encoding a cast of its input), or a local
            # contribution that the total would overwrite: the total in new memory
            into = None
        if self.summable:
            summed = yield AllReduce(tensors=dict(payload.parts), **self.sum_lanes(payload))
            total_payload = payload.replace(parts=dict(summed), summed=ctx.world_size)
            total = self.decode(total_payload, ctx)
        else:
            gathered = yield AllGather(payload)
            # divided in the float32 accumulator: a 16-bit mean that fits never overflows
            # (out= only when there is one: a subclass's sum_decoded may predate it)
            total = (self.sum_decoded(gathered, ctx, average=ctx.average) if into is None
                     else self.sum_decoded(gathered, ctx, average=ctx.average, out=into))
            return Reduced(total=total, local=local)
        return Reduced(total=self.finish_total(total, ctx), local=local)

    def bind(
        self, tensor: torch.Tensor, ctx: CodecContext, *, out: torch.Tensor,
        scratch: dict[str, torch.Tensor],
    ) -> Bound | None:
        """:meth:`reduce_into` of ``tensor`` into ``out`` prepared for repeated calls on the
        same memory (:class:`~commpress.codecs.protocol.Bound`), or ``None`` where the codec
        has no such form (the default) or not for these arguments: the caller then runs
        :meth:`reduce_into`. Only deterministic, stateless, single-round codecs whose one request
        is an in-place all-reduce and whose encoding ignores ``ctx.step`` and ``ctx.key`` may
        return one (the 16-bit casts). ``tensor`` is read and ``out`` written at each call,
        with the values they hold then; ``scratch`` (a dict the caller keeps) holds the wire
        buffer. Nothing is encoded here."""
        return None

    # ------------------------------------------------------------------ hooks to implement
    @abstractmethod
    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        """Encode a checked floating-point tensor (any shape, possibly empty or 0-d).

        A codec that sets ``encodes_into = True`` takes a keyword ``scratch: dict[str,
        torch.Tensor] | None = None`` too (see :meth:`encode`)."""

    @abstractmethod
    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """Decode a payload already checked to come from this codec and configuration.

        A codec that sets ``decodes_into = True`` takes a keyword ``out: torch.Tensor | None =
        None`` too (a checked contiguous buffer of the payload's shape and dtype), writes the
        decoding into it and returns it (or a view of it with the payload's shape)."""

    @staticmethod
    def finish_total(total: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        """Turn an aggregated sum into what ``ctx`` asked for (divide when averaging)."""
        if ctx.average and ctx.world_size > 1:
            return total / ctx.world_size
        return total

    def sum_lanes(self, payload: Payload) -> dict[str, Any]:
        """Extra :class:`AllReduce` arguments for summing this codec's payloads (lane widths)."""
        return {}

    # ------------------------------------------------------------------ wire sizes
    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int | None:
        """``encode(x).nbytes`` for any tensor ``x`` of ``shape`` and ``dtype`` (encoded with
        ``ctx.world_size = world_size``), computed from the configuration alone, without
        encoding anything; ``None`` when the size depends on the values (lossless codecs).

        Codecs with a size formula override it (every built-in lossy codec does;
        ``tests/test_perfmodel_shapes.py`` holds each formula against real payloads). A
        variable-size codec (``fixed_size = False``) returns its nominal size (DGC: the target
        count ``K``). The performance model reads it instead of encoding samples.
        """
        return None

    def wire_rounds(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 2,
    ) -> tuple[tuple[str, int], ...] | None:
        """The exchanges :meth:`reduce` asks for among ``world_size`` ranks, as ``(kind,
        bytes one rank contributes)`` pairs (``kind`` is ``"allreduce"`` or ``"allgather"``),
        from the configuration alone; ``None`` when unknown without the values.

        The default, for single-round codecs that keep :meth:`sum_lanes` as it is: one
        all-reduce (summable) or all-gather of :meth:`wire_bytes`. Multi-round codecs
        override it.
        """
        if self.multi_round or type(self).sum_lanes is not Codec.sum_lanes:
            return None
        nbytes = self.wire_bytes(shape, dtype, world_size=world_size)
        if nbytes is None:
            return None
        return (("allreduce" if self.summable else "allgather", nbytes),)

    # ------------------------------------------------------------------ helpers for codecs
    def make_payload(
        self,
        x: torch.Tensor,
        parts: Mapping[str, torch.Tensor],
        *,
        lane_bits: Mapping[str, int] | None = None,
    ) -> Payload:
        """A payload for input ``x`` with the given wire parts."""
        return Payload(
            codec=self.codec_id,
            fingerprint=self.fingerprint(),
            shape=tuple(x.shape),
            dtype=x.dtype,
            parts=dict(parts),
            lane_bits=dict(lane_bits or {}),
        )

    def part(
        self,
        payload: Payload,
        name: str,
        *,
        numel: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Fetch part ``name`` from a payload, checking its element count and dtype."""
        if name not in payload.parts:
            raise PayloadError(
                f"payload has no part {name!r} (parts: {sorted(payload.parts)}); corrupted?"
            )
        t = payload.parts[name]
        if numel is not None and t.numel() != numel:
            raise PayloadError(
                f"payload part {name!r} has {t.numel()} elements, expected {numel} for a "
                f"tensor of shape {tuple(payload.shape)}"
            )
        if dtype is not None and t.dtype != dtype:
            raise PayloadError(f"payload part {name!r} is {t.dtype}, expected {dtype}")
        return t

    def sum_decoded(
        self, payloads: list[Payload], ctx: CodecContext, *, average: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode payloads and add them in list order, accumulating in float32 (or float64);
        with ``average``, divide by their number in the accumulator, before the cast back to
        the payloads' dtype (which saturates: a finite mean stays finite).

        ``out``, when given, is a contiguous tensor of the payloads' shape, dtype and device
        that receives the total (and is returned), bit-identical to a new one: a collective
        then writes the mean into the caller's buffer without a new tensor of its size (page
        faults) and a copy. A float32/float64 ``out`` is the accumulator itself unless a
        payload shares its memory; what it held before is not read."""
        if not payloads:
            raise ConfigError("nothing to sum: empty list of payloads")
        first = payloads[0]
        target = out
        if out is not None:
            self.check_out(out, first, "sum_decoded")
            if any(_shares_memory(t, out) for p in payloads for t in p.parts.values()):
                target = None  # a payload's memory: the total is copied there at the end
        acc_dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        # a 16-bit result is a cast of the accumulator: then it is this thread's kept one
        kept = (_decode_buffer(first.shape, acc_dtype, first.device, "acc")
                if first.dtype != acc_dtype else None)
        # the default dense decode writes the first payload's values over the accumulator
        # (0.0 + values, add_into's ``first``) instead of zeroing it and adding them
        dense = type(self)._add_decoded is Codec._add_decoded
        # a float32/float64 total is accumulated where it is returned
        into = target if target is not None and target.dtype == acc_dtype else None
        acc: torch.Tensor
        if kept is not None:
            acc = kept if dense else kept.zero_()
        elif into is not None:
            acc = into if dense else into.zero_()
        else:
            acc = (kernels.empty if dense else kernels.zeros)(first.shape, acc_dtype, first.device)
        for i, p in enumerate(payloads):
            self.check_payload(p, first.shape)
            with error_context(f"{self.codec_id}.decode", wrap_as=PayloadError):
                if dense:
                    add_into(acc, self._dense_decode(p, ctx), first=i == 0)
                else:
                    self._add_decoded(p, acc, ctx)
        divisor = len(payloads) if average else 1
        if kept is not None and kernels.use_kernels(kept):
            # numba: the division and the saturating cast in one pass, into ``out`` or fresh
            # memory (the result outlives this thread's kept accumulator); where a quotient is
            # not finite, torch's passes below instead (NaN bits as torch makes them)
            narrow = (target if target is not None
                      else kernels.empty(first.shape, first.dtype))
            if kernels.narrow_sum(acc, narrow, divisor=divisor):
                return narrow if out is None or narrow is out else out.copy_(narrow)
            if dense and bool(torch.isnan(acc).any()):
                # a NaN's bits from the kernel adds need not be torch's (torch widens a float16
                # NaN outside its vector loop to 0x7FFFFFFF; which of two NaN operands an add
                # keeps is the code's choice): add the decodes again with torch's passes
                for i, p in enumerate(payloads):
                    with error_context(f"{self.codec_id}.decode", wrap_as=PayloadError):
                        add_into(acc, self._dense_decode(p, ctx), first=i == 0, kernel=False)
        if divisor > 1:
            acc /= divisor
        total = saturating_cast(acc, first.dtype, inplace=True)
        if out is None or total is out:
            return total
        return out.copy_(total)

    def _add_decoded(self, payload: Payload, acc: torch.Tensor, ctx: CodecContext) -> None:
        """``acc += decode(payload)`` in ``acc``'s (float32 or float64) dtype, for a payload
        already checked. The default decodes densely; sparse codecs override it with a
        scatter-add of the coordinates they sent (the same sums: adding zero changes
        nothing), which is what an all-gather of ``n`` sparse payloads costs: ``n``
        scatter-adds of ``K`` entries instead of ``n`` dense decodes and additions. A codec
        with :attr:`decodes_into` decodes a CPU payload into this thread's reused buffer
        (:func:`_decode_buffer`) instead of new memory, which a large decode would page-fault
        anew at every payload; the values are the same."""
        add_into(acc, self._dense_decode(payload, ctx))

    def _dense_decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """The decode of a checked payload that :meth:`_add_decoded` adds: into this
        thread's reused buffer where the codec :attr:`decodes_into` on a CPU, else fresh."""
        buf = (_decode_buffer(payload.shape, payload.dtype, payload.device)
               if self.decodes_into else None)
        result = self._decode_maybe_into(payload, ctx, buf)
        self.check_decoded(result, payload)
        return result

    def check_input(self, tensor: Any) -> torch.Tensor:
        """Refuse anything but a floating-point tensor of a supported dtype."""
        if not isinstance(tensor, torch.Tensor):
            raise ConfigError(
                f"{self.codec_id}.encode expects a torch.Tensor, got {type(tensor).__name__}"
            )
        if tensor.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            raise ConfigError(
                f"{self.codec_id}.encode expects a floating-point tensor ({names}), "
                f"got {str(tensor.dtype).replace('torch.', '')}; integer and bool tensors "
                "(token ids, labels, masks) are not compressed: send or reduce them with "
                "torch.distributed itself"
            )
        return tensor.detach()

    def check_payload(
        self, payload: Any, shape: tuple[int, ...] | torch.Size | None = None
    ) -> None:
        """Refuse payloads of another codec or configuration, or of an unexpected shape."""
        if not isinstance(payload, Payload):
            raise ConfigError(
                f"{self.codec_id}.decode expects a Payload, got {type(payload).__name__}"
            )
        if payload.codec != self.codec_id:
            raise PayloadError(
                f"payload was produced by codec {payload.codec!r}; cannot decode with "
                f"{self.codec_id!r}"
            )
        if payload.fingerprint != self.fingerprint():
            raise PayloadError(
                f"payload was produced by a {self.codec_id!r} codec with another configuration "
                f"(fingerprint {payload.fingerprint}, this codec {self.fingerprint()}: "
                f"{self.get_config()})"
            )
        if shape is not None and tuple(shape) != tuple(payload.shape):
            raise PayloadError(
                f"payload holds a tensor of shape {tuple(payload.shape)}, expected {tuple(shape)}"
            )
        if payload.summed < 1:
            raise PayloadError(f"payload.summed must be >= 1, got {payload.summed}")

    def spec(self) -> str:
        """Short spec string: the id plus the parameters that differ from their defaults,
        ``"topk:ratio=0.05"`` (``get_codec`` parses it back)."""

        def text(value: Any) -> str:
            if isinstance(value, str) and "," not in value:
                try:
                    json.loads(value)
                except json.JSONDecodeError:
                    return value  # a plain word reads back as a string
            return json.dumps(value)

        changed = [
            f"{f.name}={text(getattr(self, f.name))}"
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != f.default
        ]
        return self.codec_id + (":" + ",".join(changed) if changed else "")

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{self.codec_id}({args})"
