"""Error feedback, DGC momentum correction and the schedule that decides when to compress.

Biased compressors (top-k, sign, low rank) drop part of every gradient. *Error feedback*
keeps what was dropped and adds it to the next gradient before compressing, so that nothing is
lost for good: over ``T`` steps the sum of what was sent differs from the sum of the true
gradients by one residual only, whose size does not grow with ``T``.

This module holds the per-tensor memory that does this (:class:`FeedbackMemory`, configured
by :class:`FeedbackConfig`), including Deep Gradient Compression's *momentum correction* and
*momentum factor masking*, and the :class:`Schedule` that sends a tensor in a cheap dense
format instead of the chosen codec during warm-up, when it is too small to be worth
compressing, or when the codec would not shrink it enough.

The memory works on the *local* side of a reduction and never communicates. A step for one
tensor is::

    x = memory.compensate(key, grad)                 # grad plus what was left over
    reduced = <codec.reduce(x, ctx) with ctx.need_local=True, driven by a collective>
    memory.update(key, x, reduced.local)             # keep x minus what was sent

:class:`commpress.collectives.policy.CompressionState` wires this together with the per-layer
codec choice, and :mod:`commpress.ddp` drives it from a DDP communication hook.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from commpress.codecs import kernels
from commpress.codecs.base import Codec, CodecContext, require
from commpress.codecs.registry import codec_class, codec_ids, get_codec
from commpress.errors import CommpressError, error_context


def dense_codec_ids() -> list[str]:
    """Ids of the codecs the schedule may fall back to: the element-wise casts
    (``codec.elementwise``: no state, no sampling, same values whether tensors are sent one by
    one or concatenated), ``identity``, ``fp16`` and ``bf16`` today."""
    return [i for i in codec_ids() if codec_class(i).elementwise]


@dataclass(frozen=True, slots=True, kw_only=True)
class FeedbackConfig:
    """How the per-tensor memory compensates gradients.

    Attributes:
        error_feedback: keep the compression error ``e = x - local`` and add it to the next
            input (Karimireddy et al. 2019, "error feedback fixes SignSGD"). Needed by every
            *biased* codec (top-k, DGC, sign, PowerSGD) to converge like uncompressed SGD;
            harmless but useless for unbiased or lossless ones. Costs one tensor of memory per
            compressed gradient (in float32 for 16-bit gradients).
        momentum: DGC's momentum correction (Lin et al. 2018). With ``m > 0`` the memory keeps
            a velocity ``u`` and an accumulator ``v``: ``u = m*u + g``, ``v = v + u``; ``v``
            is what gets compressed, and after sending, ``v`` keeps only what was not sent.
            Use the momentum you would otherwise give the optimizer (0.9 is usual) and run
            the optimizer *without* momentum, since the momentum is now applied before
            compression. ``0`` (the default) is plain error feedback.
        momentum_masking: DGC's momentum factor masking: after a compressed send, zero ``u``
            at the coordinates that were sent (where the decoded local contribution is
            non-zero), so stale momentum does not push those coordinates again. Meant for
            sparsifiers (top-k, DGC); with a dense codec it zeroes the whole velocity every
            step, which turns momentum off. Dense fallback sends (warm-up, small tensors) are
            never masked: they send the momentum as momentum SGD would.
    """

    error_feedback: bool = True
    momentum: float = 0.0
    momentum_masking: bool = True

    def __post_init__(self) -> None:
        require(isinstance(self.error_feedback, bool), "error_feedback must be a bool",
                self.error_feedback)
        require(isinstance(self.momentum_masking, bool), "momentum_masking must be a bool",
                self.momentum_masking)
        require(
            isinstance(self.momentum, (int, float)) and not isinstance(self.momentum, bool)
            and 0.0 <= float(self.momentum) < 1.0,
            "momentum must be a float in [0, 1)",
            self.momentum,
        )
        require(
            self.error_feedback or self.momentum == 0.0,
            "momentum correction accumulates unsent gradients and needs error_feedback=True",
            self.momentum,
        )


def feedback_applies(codec: Codec, error_feedback: bool | None) -> bool:
    """Whether error feedback applies to tensors sent with ``codec`` under the setting
    ``error_feedback`` (``True``, ``False`` or ``None`` for automatic).

    It never applies to lossless codecs. Automatic turns it on exactly for the codecs that
    need it (``codec.feedback_fit == "needed"``: biased and contractive, such as top-k,
    sign, PowerSGD). ``True`` turns it on for every lossy codec, except that a codec whose
    error is not contractive (``"incompatible"``: TernGrad, Random-K scaled by d/k, coarse
    QSGD) is refused: its residual would grow without bound. Which codecs fit how is a property of
    each codec and of its parameters (``commpress codecs`` lists it).
    """
    if codec.lossless or error_feedback is False:
        return False
    fit = codec.feedback_fit
    if error_feedback is None:
        return fit == "needed"
    if fit == "incompatible":
        raise CommpressError(
            f"error_feedback=True cannot be used with {codec}: its compression error is not "
            "contractive (|C(x) - x| can exceed |x|), so the error-feedback residual would "
            "grow without bound and training diverges. Use error_feedback=None (automatic: "
            "off for this codec) or False, or a contractive codec (see docs/ddp.md, 'Error "
            "feedback and DGC')"
        )
    return True


def _memory_dtype(dtype: torch.dtype) -> torch.dtype:
    """Residuals of 16-bit gradients are kept in float32: they are sums of many small parts."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class FeedbackMemory:
    """Per-tensor error-feedback memory (and DGC momentum), keyed by a stable tensor name.

    Algorithm, for one tensor ``key`` with gradient ``g_t`` at step ``t`` (``m`` = momentum):

    1. ``compensate``: with ``m == 0``: ``x_t = g_t + e_{t-1}``. With ``m > 0`` (DGC momentum
       correction): ``u_t = m * u_{t-1} + g_t`` and ``x_t = e_{t-1} + u_t`` (``e`` plays the
       role of DGC's accumulator ``v``).
    2. The caller reduces ``x_t`` with a codec, asking for its own decoded contribution
       ``local_t`` (``CodecContext.need_local``).
    3. ``update``: ``e_t = x_t - local_t``. For a sparsifier that sends exactly the selected
       values, this is DGC's ``v * (1 - mask)``; with fp16 values the rounding error of the
       sent values stays in ``e`` too. With ``m > 0`` and ``momentum_masking``, ``u_t`` is
       zeroed where ``local_t != 0`` (DGC's momentum factor masking).

    Then ``sum_t local_t = sum_t x_t - sum_t (x_t - local_t)`` telescopes to
    ``sum_t g_t - e_T`` (for ``m == 0``): what was sent over ``T`` steps equals the true
    gradients' sum up to the *last* residual.

    The memory is created lazily at a key's first use, in the gradient's device, with dtype
    float32 (float64 for float64 gradients). It is not thread-safe for concurrent use of the
    *same* key; different keys may be used from different threads.

    Args:
        config: a :class:`FeedbackConfig` (default: plain error feedback).
    """

    __slots__ = ("config", "_residual", "_velocity")

    def __init__(self, config: FeedbackConfig | None = None) -> None:
        self.config = config if config is not None else FeedbackConfig()
        self._residual: dict[str, torch.Tensor] = {}
        self._velocity: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ the two steps
    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """Return the tensor to compress for ``key``: ``grad`` plus the remembered error (and
        DGC momentum). ``grad`` is not modified; the result is a new float32/64 tensor."""
        if not isinstance(grad, torch.Tensor) or not grad.is_floating_point():
            raise CommpressError(
                f"error feedback of {key!r} needs a floating-point tensor, got "
                f"{getattr(grad, 'dtype', type(grad).__name__)}"
            )
        dtype = _memory_dtype(grad.dtype)
        x = kernels.copy_of(grad.detach(), dtype)  # large ones on huge pages
        if not self.config.error_feedback:
            return x
        if self.config.momentum > 0.0:
            u = self._fetch(self._velocity, key, grad, dtype)
            # a new tensor, not an in-place update: the caller may still hold the old velocity
            # to restore it if the step turns out non-finite (CompressionState's rollback)
            u = kernels.copy_of(x) if u is None else u.mul(self.config.momentum).add_(x)
            self._velocity[key] = u
            x = kernels.copy_of(u)
        e = self._fetch(self._residual, key, grad, dtype)
        if e is not None:
            x.add_(e)
        return x

    def update(
        self,
        key: str,
        compensated: torch.Tensor,
        local: torch.Tensor | None,
        *,
        mask_momentum: bool = True,
    ) -> None:
        """Remember ``compensated - local`` for ``key``.

        Args:
            key: the tensor's name, as given to :meth:`compensate`.
            compensated: what :meth:`compensate` returned (and was then encoded).
            local: this worker's decoded contribution (``Reduced.local``).
            mask_momentum: apply DGC's momentum factor masking (when configured). Pass
                ``False`` for a dense send (warm-up, small-tensor fallback), which sends the
                whole momentum as momentum SGD would.
        """
        if not self.config.error_feedback:
            return
        if local is None:
            raise CommpressError(
                f"error feedback of {key!r} needs this worker's decoded contribution: reduce "
                "with CodecContext(need_local=True)"
            )
        if tuple(local.shape) != tuple(compensated.shape):
            raise CommpressError(
                f"error feedback of {key!r}: local contribution has shape "
                f"{tuple(local.shape)}, the compensated input {tuple(compensated.shape)}"
            )
        local = local.detach().to(device=compensated.device, dtype=compensated.dtype)
        self._residual[key] = compensated - local
        if self.config.momentum > 0.0 and self.config.momentum_masking and mask_momentum:
            u = self._velocity.get(key)
            if u is not None:  # this step's velocity, made by compensate: safe to change
                u.masked_fill_(local != 0, 0.0)

    # ------------------------------------------------------------------ rollback
    def snapshot(self, key: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The memory of ``key`` as it is now (references, no copies): :meth:`compensate` and
        :meth:`update` replace these tensors instead of changing them, so a snapshot taken
        before a step can undo it (:meth:`restore`)."""
        return self._residual.get(key), self._velocity.get(key)

    def restore(
        self, key: str, snapshot: tuple[torch.Tensor | None, torch.Tensor | None]
    ) -> None:
        """Put back the memory of ``key`` that :meth:`snapshot` returned."""
        for store, value in zip((self._residual, self._velocity), snapshot, strict=True):
            if value is None:
                store.pop(key, None)
            else:
                store[key] = value

    # ------------------------------------------------------------------ inspection
    def residual(self, key: str) -> torch.Tensor | None:
        """The remembered error for ``key`` (DGC's accumulator ``v``), or ``None``."""
        return self._residual.get(key)

    def velocity(self, key: str) -> torch.Tensor | None:
        """DGC's velocity ``u`` for ``key`` (``None`` without momentum correction)."""
        return self._velocity.get(key)

    def keys(self) -> list[str]:
        """Names of the tensors that have memory, sorted."""
        return sorted(set(self._residual) | set(self._velocity))

    def reset(self, key: str | None = None) -> None:
        """Forget one tensor's memory, or everything when ``key`` is ``None``."""
        if key is None:
            self._residual.clear()
            self._velocity.clear()
        else:
            self._residual.pop(key, None)
            self._velocity.pop(key, None)

    def nbytes(self) -> int:
        """Memory held, in bytes."""
        tensors = [*self._residual.values(), *self._velocity.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The memory as plain data: ``{"residual": {key: cpu tensor}, "velocity": {...}}``."""
        return {
            "residual": {k: v.detach().to("cpu", copy=True) for k, v in self._residual.items()},
            "velocity": {k: v.detach().to("cpu", copy=True) for k, v in self._velocity.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Tensors stay on the CPU until their key is next
        used, then move to that gradient's device."""
        if not isinstance(state, Mapping) or set(state) != {"residual", "velocity"}:
            keys = sorted(state) if isinstance(state, Mapping) else "-"
            raise CommpressError(
                "FeedbackMemory.load_state_dict expects {'residual': {...}, 'velocity': {...}}, "
                f"got {type(state).__name__} with keys {keys}"
            )
        loaded: dict[str, dict[str, torch.Tensor]] = {}
        for part in ("residual", "velocity"):
            entries = state[part]
            if not isinstance(entries, Mapping):
                raise CommpressError(f"state[{part!r}] must map tensor names to tensors")
            for k, v in entries.items():
                if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                    raise CommpressError(
                        f"state[{part!r}] must map str to tensors, got {k!r}: {type(v).__name__}"
                    )
            loaded[part] = {k: v.detach().clone() for k, v in entries.items()}
        self._residual = loaded["residual"]
        self._velocity = loaded["velocity"]

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _fetch(
        store: dict[str, torch.Tensor], key: str, grad: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        t = store.get(key)
        if t is None:
            return None
        if tuple(t.shape) != tuple(grad.shape):
            raise CommpressError(
                f"error-feedback memory of {key!r} has shape {tuple(t.shape)} but the gradient "
                f"has shape {tuple(grad.shape)}; was the model changed? call reset({key!r})"
            )
        if t.device != grad.device or t.dtype != dtype:
            t = t.to(device=grad.device, dtype=dtype)
            store[key] = t
        return t


# ---------------------------------------------------------------------------- schedule

_RATE_CACHE: dict[tuple[str, tuple[int, ...], torch.dtype], float] = {}
_RATE_LOCK = threading.Lock()


def compression_rate(
    codec: Codec,
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Input bytes over wire bytes when ``codec`` encodes a tensor of ``shape`` and ``dtype``.

    From the codec's size formula (:meth:`~commpress.codecs.base.Codec.wire_bytes`) for
    fixed-size codecs: exact, and free for any tensor size. Variable-size codecs are measured
    once per (configuration, shape, dtype) by encoding a fixed pseudo-random tensor with a
    fixed context (rank 0, step 0) on the CPU, then cached: an estimate. Either way the result
    is the same on every rank, which the schedule needs (all ranks must pick the same codec).
    Empty tensors give ``inf``.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if numel == 0:
        return math.inf
    cache_key = (codec.fingerprint(), shape, dtype)
    with _RATE_LOCK:
        cached = _RATE_CACHE.get(cache_key)
    if cached is not None:
        return cached
    formula = codec.wire_bytes(shape, dtype) if codec.fixed_size else None
    if formula is not None:
        return math.inf if formula == 0 else numel * dtype.itemsize / formula
    g = torch.Generator().manual_seed(0x5EED)
    sample = torch.randn(shape, generator=g).to(dtype)
    with error_context(f"measuring the compression rate of {codec} on {shape} {dtype}"):
        payload = codec.encode(sample, CodecContext(key="compression-rate-probe"))
    rate = math.inf if payload.nbytes == 0 else numel * sample.element_size() / payload.nbytes
    with _RATE_LOCK:
        if len(_RATE_CACHE) > 4096:
            _RATE_CACHE.clear()
        _RATE_CACHE[cache_key] = rate
    return rate


@functools.cache
def _dense_codec(codec_id: str) -> Codec:
    return get_codec(codec_id)


ChoiceReason = Literal["codec", "lossless", "warmup", "min_numel", "min_rate", "guard"]

#: Reasons for which a dense codec replaced the policy's codec.
FALLBACK_REASONS: tuple[ChoiceReason, ...] = ("warmup", "min_numel", "min_rate", "guard")


@dataclass(frozen=True, slots=True)
class Choice:
    """What the schedule picked for one tensor at one step.

    Attributes:
        codec: the codec to send the tensor with.
        reason: ``"codec"`` (the policy's codec), ``"lossless"`` (a lossless codec, which the
            schedule never replaces), ``"warmup"``, ``"min_numel"``, ``"min_rate"`` or
            ``"guard"`` (a dense fallback; ``"guard"`` is set by the divergence guard of
            :class:`~commpress.collectives.policy.CompressionState`).
    """

    codec: Codec
    reason: ChoiceReason

    @property
    def fallback(self) -> bool:
        """Whether the schedule replaced the policy's codec by a dense one."""
        return self.reason in FALLBACK_REASONS


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """When a tensor is sent with a dense format instead of its (lossy) codec.

    Algorithm, for a tensor of ``n`` elements at step ``t`` whose policy codec is ``C``:

    1. If ``C`` is lossless, send with ``C`` (lossless codecs are never replaced).
    2. If ``t < warmup_steps``, send with ``warmup_codec`` (warm-up).
    3. If ``n < min_numel``, send with ``fallback_codec``.
    4. If ``C``'s compression rate on this shape (:func:`compression_rate`) is below
       ``min_compression_rate``, send with ``fallback_codec``.
    5. Otherwise send with ``C``.

    Every rule depends only on the configuration, the step and the tensor's shape and dtype,
    so all ranks pick the same codec.

    Attributes:
        warmup_steps: number of initial steps sent with ``warmup_codec``. Early training is the
            most sensitive to compression error; PyTorch's PowerSGD hook defaults to 1000
            steps, DGC ramps sparsity over the first epochs. Start with ~1-10% of training.
        warmup_codec: ``"identity"`` (uncompressed, the default) or ``"fp16"``/``"bf16"``
            (half the bytes, nearly as accurate; the stronger baseline).
        min_numel: tensors with fewer elements are sent with ``fallback_codec``. Compressing
            a bias or LayerNorm vector saves a few bytes but costs a collective's latency and
            a kernel launch; 0 disables the rule. A few thousand is a sensible value.
        min_compression_rate: tensors the codec would shrink by less than this factor
            (input bytes / wire bytes) are sent with ``fallback_codec``. Set it to 2 for fp32
            gradients so that a codec is used only where it beats fp16 (PyTorch's PowerSGD
            default); 0 disables the rule.
        fallback_codec: the dense codec for the two size rules: ``"fp16"`` (default),
            ``"bf16"`` or ``"identity"``.
    """

    warmup_steps: int = 0
    warmup_codec: str = "identity"
    min_numel: int = 0
    min_compression_rate: float = 0.0
    fallback_codec: str = "fp16"

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "min_numel"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                f"{name} must be an int >= 0",
                value,
            )
        rate = self.min_compression_rate
        require(
            isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate >= 0
            and math.isfinite(rate),
            "min_compression_rate must be a finite number >= 0",
            rate,
        )
        dense = dense_codec_ids()
        for name in ("warmup_codec", "fallback_codec"):
            value = getattr(self, name)
            require(
                value in dense,
                f"{name} must be one of {', '.join(map(repr, dense))}",
                value,
            )

    def fallback(self, reason: ChoiceReason) -> Choice:
        """The dense ``fallback_codec`` choice, for ``reason``."""
        return Choice(_dense_codec(self.fallback_codec), reason)

    def choose(
        self,
        codec: Codec,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype = torch.float32,
        *,
        step: int,
    ) -> Choice:
        """Pick the codec for a tensor of ``shape``/``dtype`` at ``step`` (see the class doc)."""
        if codec.lossless:
            return Choice(codec, "lossless")
        if step < self.warmup_steps:
            return Choice(_dense_codec(self.warmup_codec), "warmup")
        if math.prod(shape) < self.min_numel:
            return Choice(_dense_codec(self.fallback_codec), "min_numel")
        if self.min_compression_rate > 0 and (
            compression_rate(codec, shape, dtype) < self.min_compression_rate
        ):
            return Choice(_dense_codec(self.fallback_codec), "min_rate")
        return Choice(codec, "codec")


__all__ = [
    "FALLBACK_REASONS",
    "feedback_applies",
    "Choice",
    "FeedbackConfig",
    "FeedbackMemory",
    "Schedule",
    "compression_rate",
    "dense_codec_ids",
]
