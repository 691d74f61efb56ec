"""Per-layer codec choice and the checkpointable state of compressed gradient reduction.

* :class:`CodecPolicy` maps a tensor's name and shape to a codec: one codec for everything,
  glob rules on parameter names (``{"*.bias": "identity", "embed.*": "fp16"}``), size
  thresholds (``{0: "fp16", 65536: "powersgd:rank=4"}``) and/or a function.
* :class:`CompressionState` is everything that persists between steps: the policy, the
  :class:`~commpress.collectives.feedback.Schedule`, the error-feedback memory, every codec's
  per-tensor state (PowerSGD's ``Q``) and the step counter. It turns one tensor into a
  reduction protocol (:meth:`CompressionState.reduce`) that any driver can run. Like PyTorch's
  ``PowerSGDState`` it pickles without its process group, and :meth:`~CompressionState.
  state_dict` gives plain CPU tensors for checkpoints.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from commpress.codecs.base import Codec, CodecContext, require
from commpress.codecs.protocol import Protocol, Reduced
from commpress.codecs.registry import get_codec
from commpress.collectives import engine
from commpress.collectives.feedback import (
    FALLBACK_REASONS,
    ChoiceReason,
    FeedbackConfig,
    FeedbackMemory,
    Schedule,
    feedback_applies,
)
from commpress.errors import CommpressError, error_context, read_json

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: A codec given as an id/spec string (``"powersgd:rank=4"``), a config mapping or a codec.
CodecSpec: TypeAlias = "str | Mapping[str, Any] | Codec"
#: ``fn(name, shape) -> codec spec`` or ``None`` for "no opinion" (the next rule decides).
PolicyFunction: TypeAlias = "Callable[[str, tuple[int, ...]], CodecSpec | None]"

#: Version of the :meth:`CompressionState.state_dict` layout.
STATE_VERSION = 1

_log = logging.getLogger("commpress")


def _as_codec(spec: Any, what: str) -> Codec:
    with error_context(what):
        if isinstance(spec, (str, Mapping, Codec)):
            return get_codec(spec)
        raise CommpressError(
            f"expected a codec id/spec string, a config mapping or a Codec, got "
            f"{type(spec).__name__}"
        )


#: Version written into policy files (``commpress advise --emit-policy``).
POLICY_FILE_VERSION = 1


def load_policy_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a policy file: JSON ``{"commpress_policy": 1, "rules": {glob: codec spec}}`` (what
    ``commpress advise --emit-policy`` writes) or a plain ``{glob: codec spec}`` object.
    Returns the rules, ``"*"`` being the default, for :meth:`CodecPolicy.build` or
    ``commpress.ddp.register(model, policy=...)``, which also accepts the path itself."""
    data = read_json(path, f"the policy file {str(path)!r}")
    if isinstance(data, dict) and "commpress_policy" in data:
        if data["commpress_policy"] != POLICY_FILE_VERSION:
            raise CommpressError(
                f"policy file {str(path)!r} has version {data['commpress_policy']!r}; this "
                f"commpress reads version {POLICY_FILE_VERSION}"
            )
        data = data.get("rules")
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, (str, dict)) for k, v in data.items()
    ):
        raise CommpressError(
            f"policy file {str(path)!r} must hold a JSON object of name globs to codec specs "
            '(e.g. {"*": "powersgd:rank=4", "*.bias": "fp16"})'
        )
    for pattern, spec in data.items():
        _as_codec(spec, f"policy file {str(path)!r}, rule {pattern!r}")
    return dict(data)


class CodecPolicy:
    """Which codec each tensor is sent with.

    Resolution order for a tensor ``name`` of shape ``shape`` (``n`` elements):

    1. ``function(name, shape)``, when given and it returns a spec (``None``: no opinion);
    2. the first rule in ``rules`` whose glob pattern matches ``name`` (``fnmatch``-style,
       case-sensitive: ``"*.bias"``, ``"blocks.0.*"``, or an exact name);
    3. ``by_size``: the spec of the largest threshold ``<= n``;
    4. ``default``.

    The result is cached per ``(name, shape)``; every rank must resolve to the same codec, so
    the function must be deterministic.

    Args:
        default: codec for tensors no rule matches.
        rules: glob pattern -> codec spec, tried in order (a mapping keeps insertion order;
            a sequence of pairs works too). Use ``"identity"`` to leave a tensor uncompressed.
        by_size: element-count threshold -> codec spec. ``{0: "fp16", 65536: "powersgd"}``
            sends tensors of at least 65536 elements with PowerSGD and smaller ones in fp16.
        function: a deterministic ``fn(name, shape)``; make it a module-level function (not a
            lambda) if the state holding the policy is to be pickled.

    Tuning: compress the big matrices (embeddings, attention/MLP weights) and leave vectors
    (biases, LayerNorm) to a dense format; a lossy codec on a 128-element bias saves nothing
    measurable and costs a collective's latency.
    """

    __slots__ = ("default", "rules", "by_size", "function", "_cache", "_lock")

    def __init__(
        self,
        default: CodecSpec = "identity",
        *,
        rules: Mapping[str, CodecSpec] | Sequence[tuple[str, CodecSpec]] = (),
        by_size: Mapping[int, CodecSpec] | None = None,
        function: PolicyFunction | None = None,
    ) -> None:
        self.default = _as_codec(default, "policy default codec")
        pairs = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
        self.rules: list[tuple[str, Codec]] = []
        for item in pairs:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise CommpressError(
                    f"policy rules must be (glob pattern, codec spec) pairs, got {item!r}"
                )
            self.rules.append((item[0], _as_codec(item[1], f"policy rule {item[0]!r}")))
        self.by_size: list[tuple[int, Codec]] = []
        for threshold, spec in sorted((by_size or {}).items()):
            if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
                raise CommpressError(
                    f"by_size thresholds must be ints >= 0 (element counts), got {threshold!r}"
                )
            self.by_size.append((threshold, _as_codec(spec, f"by_size[{threshold}]")))
        if function is not None and not callable(function):
            raise CommpressError(f"policy function must be callable, got {function!r}")
        self.function = function
        self._cache: dict[tuple[str, tuple[int, ...]], Codec] = {}
        self._lock = threading.Lock()

    @classmethod
    def build(
        cls,
        spec: CodecPolicy | CodecSpec | Callable[..., Any] | None = None,
        **codec_params: Any,
    ) -> CodecPolicy:
        """A policy from whatever the user passed.

        * a :class:`CodecPolicy`: returned as is;
        * a codec (id/spec string, config mapping with an ``"id"`` key, or a ``Codec``), plus
          optional ``codec_params``: that codec for every tensor;
        * a mapping *without* ``"id"``: glob rules, with ``"*"`` (if present) as the default
          and ``identity`` otherwise;
        * a callable: ``fn(name, shape)``, with ``identity`` where it returns ``None``.
        """
        if isinstance(spec, CodecPolicy):
            if codec_params:
                raise CommpressError(
                    f"codec parameters {sorted(codec_params)} given with a ready CodecPolicy; "
                    "put them in the policy's codec specs"
                )
            return spec
        if spec is None:
            spec = "identity"
        if isinstance(spec, (str, Codec)) or (isinstance(spec, Mapping) and "id" in spec):
            return cls(get_codec(spec, **codec_params) if codec_params else spec)
        if codec_params:
            raise CommpressError(
                f"codec parameters {sorted(codec_params)} need a single codec, not a "
                f"{type(spec).__name__} policy"
            )
        if isinstance(spec, Mapping):
            rules = dict(spec)
            default = rules.pop("*", "identity")
            return cls(default, rules=rules)
        if callable(spec):
            return cls("identity", function=spec)
        raise CommpressError(
            "a policy is a codec spec, a mapping of name globs to codec specs, a function "
            f"(name, shape) -> codec spec, or a CodecPolicy; got {type(spec).__name__}"
        )

    def codec_for(self, name: str, shape: tuple[int, ...] | torch.Size) -> Codec:
        """The codec for tensor ``name`` of ``shape`` (see the class doc for the order)."""
        shape = tuple(int(s) for s in shape)
        cache_key = (name, shape)
        with self._lock:
            cached = self._cache.get(cache_key)
        if cached is not None:
            return cached
        codec = self._resolve(name, shape)
        with self._lock:
            self._cache[cache_key] = codec
        return codec

    def _resolve(self, name: str, shape: tuple[int, ...]) -> Codec:
        if self.function is not None:
            with error_context(f"policy function for {name!r} {shape}"):
                spec = self.function(name, shape)
            if spec is not None:
                return _as_codec(spec, f"policy function result for {name!r}")
        for pattern, codec in self.rules:
            if fnmatch.fnmatchcase(name, pattern):
                return codec
        numel = math.prod(shape)
        chosen: Codec | None = None
        for threshold, codec in self.by_size:
            if numel >= threshold:
                chosen = codec
        return chosen if chosen is not None else self.default

    def codecs(self) -> list[tuple[str, Codec]]:
        """The codecs the policy names up front, each with where it comes from (a policy
        function's codecs are only known when it is called)."""
        found = [(f"the default codec {self.default}", self.default)]
        found += [(f"{c} (rule {pattern!r})", c) for pattern, c in self.rules]
        found += [(f"{c} (by_size >= {t})", c) for t, c in self.by_size]
        return found

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly description (configs of the default, rules and size thresholds)."""
        return {
            "default": self.default.get_config(),
            "rules": [[p, c.get_config()] for p, c in self.rules],
            "by_size": [[t, c.get_config()] for t, c in self.by_size],
            "function": None if self.function is None else getattr(
                self.function, "__qualname__", repr(self.function)
            ),
        }

    def __getstate__(self) -> dict[str, Any]:
        return {"default": self.default, "rules": self.rules, "by_size": self.by_size,
                "function": self.function}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.default = state["default"]
        self.rules = state["rules"]
        self.by_size = state["by_size"]
        self.function = state["function"]
        self._cache = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        parts = [f"default={self.default}"]
        if self.rules:
            parts.append(f"rules={[(p, str(c)) for p, c in self.rules]}")
        if self.by_size:
            parts.append(f"by_size={[(t, str(c)) for t, c in self.by_size]}")
        if self.function is not None:
            parts.append(f"function={getattr(self.function, '__qualname__', self.function)}")
        return f"CodecPolicy({', '.join(parts)})"


@dataclass(frozen=True, slots=True)
class Plan:
    """How one tensor is sent at one step.

    Attributes:
        key: the tensor's name.
        codec: the codec that encodes it.
        reason: why (see :class:`~commpress.collectives.feedback.Choice`).
        feedback: whether error feedback (and momentum correction) applies.
        step: the step it was planned for.
    """

    key: str
    codec: Codec
    reason: ChoiceReason
    feedback: bool
    step: int = 0

    @property
    def fallback(self) -> bool:
        """The schedule replaced the policy's codec by a dense one (warm-up, small tensor,
        divergence guard)."""
        return self.reason in FALLBACK_REASONS


@dataclass(frozen=True, slots=True, kw_only=True)
class Guard:
    """When the divergence guard sends lossy tensors with the dense fallback codec instead.

    At the end of every step the state measures the norm of the reduced gradients (the
    totals, identical on every rank, so every rank takes the same decision without another
    collective; a rank that decided otherwise would send another plan, which the DDP hook's
    plan check refuses with a clear error). The guard *trips* when

    * ``on_nonfinite`` and the step was non-finite (a NaN/Inf on any rank reaches every
      rank's totals), or
    * ``spike_factor`` is set and the norm exceeds ``spike_factor`` times the median norm of
      the last ``window`` steps that did not trip (checked once ``window`` such steps were
      seen).

    A tripped guard sends every lossy tensor of the next ``fallback_steps`` steps with the
    schedule's ``fallback_codec`` (plan reason ``"guard"``), logs one warning (on rank 0 of
    the group) and, for a spike with ``reset_feedback``, forgets the error-feedback memory:
    residuals that grew are the usual cause of a spike with compressed gradients. A
    non-finite step is always undone, guard or not (see :meth:`CompressionState.end_step`).

    Attributes:
        spike_factor: norm ratio (> 1) that counts as a spike; ``None`` turns spike detection
            off.
        window: number of recent healthy steps whose median norm is the reference (>= 1).
        fallback_steps: steps sent with the fallback codec after the guard trips (>= 1).
        on_nonfinite: also trip on non-finite steps (AMP overflows).
        reset_feedback: forget the error-feedback memory when a spike trips the guard.
    """

    spike_factor: float | None = 10.0
    window: int = 20
    fallback_steps: int = 10
    on_nonfinite: bool = True
    reset_feedback: bool = True

    def __post_init__(self) -> None:
        factor = self.spike_factor
        require(
            factor is None or (
                isinstance(factor, (int, float)) and not isinstance(factor, bool)
                and math.isfinite(factor) and factor > 1
            ),
            "guard spike_factor must be a finite number > 1 or None",
            factor,
        )
        for name in ("window", "fallback_steps"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"guard {name} must be an int >= 1",
                value,
            )
        for name in ("on_nonfinite", "reset_feedback"):
            require(isinstance(getattr(self, name), bool), f"guard {name} must be a bool",
                    getattr(self, name))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepStats:
    """What one step sent, as recorded by :class:`CompressionState` (``state.stats``).

    Attributes:
        step: the step.
        tensors: tensors reduced.
        codecs: codec spec -> number of tensors sent with it.
        reasons: plan reason (``"codec"``, ``"lossless"``, ``"warmup"``, ``"min_numel"``,
            ``"min_rate"``, ``"guard"``) -> number of tensors.
        wire_bytes: bytes this rank's payloads put on the wire, when the driver counted them
            (the DDP hook does).
        grad_norm: L2 norm of the reduced gradients that were measured (every tensor with
            error feedback or codec state, every tensor when a guard is set); ``None`` if none
            was; ``nan``/``inf`` for a non-finite step.
        residual_norm: L2 norm of this rank's error-feedback residuals after the step
            (``None`` without error feedback).
        nonfinite: the reduced gradients were non-finite; ``None`` when not measured (a state
            with nothing to protect and no guard makes no pass over the totals).
        rolled_back: the step's changes to the error-feedback memory and codec states were
            undone (a non-finite step).
        guard: ``"nonfinite"`` or ``"spike"`` when this step tripped the guard, else ``None``.
        guarded: this step was sent with the fallback codec because of an earlier trip.
        failed: a reduction of this step failed (the step was ended without completing; its
            changes were undone, and the guard did not look at it).
    """

    step: int
    tensors: int
    codecs: dict[str, int]
    reasons: dict[str, int]
    wire_bytes: int
    grad_norm: float | None
    residual_norm: float | None
    nonfinite: bool | None
    rolled_back: bool
    guard: str | None
    guarded: bool
    failed: bool = False


@dataclass(slots=True)
class _OpenStep:
    """The step being reduced: what to undo if it turns out non-finite, and its counters."""

    step: int
    journal: dict[str, tuple[Any, dict[str, Any] | None, dict[str, Any] | None]] = field(
        default_factory=dict
    )
    norms: list[torch.Tensor] = field(default_factory=list)
    residuals: list[torch.Tensor] = field(default_factory=list)
    codecs: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    wire_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Tally:
    """What a group of tensors adds to a step's record (:meth:`CompressionState.tally`): its
    tensors, and their counts per codec spec and per plan reason."""

    tensors: int
    codecs: tuple[tuple[str, int], ...]
    reasons: tuple[tuple[str, int], ...]


def _shallow(value: Any) -> Any:
    """A copy of nested dicts/lists/tuples that shares their tensors (codecs replace state
    tensors instead of changing them, so references are enough to restore a state)."""
    if isinstance(value, dict):
        return {k: _shallow(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shallow(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_shallow(v) for v in value)
    return value


def _to_cpu_floats(values: list[torch.Tensor]) -> list[float]:
    """0-d tensors (possibly on several devices) as floats, with one sync per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        by_device.setdefault(v.device, []).append(i)
    out = [0.0] * len(values)
    for idx in by_device.values():
        for i, f in zip(idx, torch.stack([values[i] for i in idx]).tolist(), strict=True):
            out[i] = float(f)
    return out


_SPECS: dict[Codec, str] = {}


def _spec(codec: Codec) -> str:
    """``codec.spec()``, cached (codecs are frozen)."""
    spec = _SPECS.get(codec)
    if spec is None:
        if len(_SPECS) >= 1024:
            _SPECS.clear()
        spec = _SPECS[codec] = codec.spec()
    return spec


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_device(v, device) for v in value)
    return value


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu(v) for v in value)
    return value


def checked_options(
    *, error_feedback: Any, timeout: Any, guard: Any
) -> Guard | None:
    """Check the ``error_feedback``, ``timeout`` and ``guard`` settings of a
    :class:`CompressionState` (or of a DDP hook's config); returns the guard (``True``:
    ``Guard()``; ``None``/``False``: ``None``)."""
    if error_feedback not in (True, False, None):
        raise CommpressError(
            f"error_feedback must be True, False or None (automatic), got {error_feedback!r}"
        )
    if timeout is not None and not (
        isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
    ):
        raise CommpressError(
            f"timeout must be a number of seconds > 0 or None, got {timeout!r}"
        )
    if guard is True:
        return Guard()
    if guard is not None and guard is not False and not isinstance(guard, Guard):
        raise CommpressError(
            f"guard must be a Guard, True, False or None, got {type(guard).__name__}"
        )
    return guard or None


class CompressionState:
    """What compressed gradient reduction keeps between steps; checkpointable, group-free.

    For each tensor and step, :meth:`reduce` runs this algorithm:

    1. **Choose the codec**: the policy gives the tensor's codec ``C``; the schedule may
       replace it by a dense one (warm-up, tensors below ``min_numel`` or below
       ``min_compression_rate``); lossless codecs are never replaced.
    2. **Compensate** (if error feedback applies to ``C``): add the remembered error (and, with
       DGC momentum correction, the velocity) to the gradient.
    3. **Reduce**: run ``codec.reduce`` with the codec's persistent per-tensor state (PowerSGD's
       ``Q``), asking for the mean over workers and, with feedback, the local contribution.
       Callers that exchange another way (a ring, a hierarchical exchange) run steps 1-2 with
       :meth:`prepare` and step 4 with :meth:`finish` around their own exchange.
    4. **Remember** (with feedback): error = compensated input - local contribution.

    Error feedback applies as :func:`~commpress.collectives.feedback.feedback_applies` says:
    with ``error_feedback=None`` (automatic) exactly for codecs that need it
    (``C.feedback_fit == "needed"``: biased and contractive, such as top-k, sign, PowerSGD;
    not the plain 16-bit casts, whose rounding error is far below gradient noise, which keeps
    the fp16 path identical to PyTorch's ``fp16_compress_hook``); with ``True`` for every
    lossy codec, refusing those whose error is not contractive (TernGrad, Random-K scaled by
    d/k, coarse QSGD), whose residual would grow without bound.

    **Non-finite steps are undone.** Every change a step makes to the error-feedback memory
    and to codec states (PowerSGD's ``Q``, netzip's references) is journaled by reference
    (no copies: the memory and the codecs replace tensors instead of changing them). When the
    step ends (:meth:`end_step`; the DDP hook calls it after a step's last bucket, and a
    reduction at a later step ends any step left open) and its reduced gradients were
    non-finite, which a NaN/Inf on any rank makes them on every rank, every change is undone:
    the state is as before that step, while the non-finite totals still reach the caller so
    that AMP's ``GradScaler`` skips the step. The journal holds the previous residuals until
    the step ends (at most one more residual per tensor). An optional :class:`Guard` also
    reacts to non-finite steps and gradient-norm spikes, and :attr:`stats` records every step
    (:class:`StepStats`).

    The step counter is advanced by the caller (:meth:`advance`; the DDP hook does it after
    each step's last bucket). Keys must be stable across steps and ranks: parameter names.

    Pickling keeps everything but the process group (restored as ``None``, meaning the default
    group), like PyTorch's ``PowerSGDState``; the policy is pickled too, so a policy function
    must be a module-level function. :meth:`state_dict` returns only plain data and CPU tensors
    (step, memory, codec states) for ``torch.save`` checkpoints; :meth:`load_state_dict` puts
    it back into a state built with the same configuration.

    Args:
        policy: anything :meth:`CodecPolicy.build` accepts.
        process_group: the group gradients are reduced over (``None``: the default group).
        schedule: warm-up and size rules (default: none).
        error_feedback: ``True``, ``False`` or ``None`` (automatic, see above).
        momentum: DGC momentum correction (see :class:`FeedbackConfig`); run the optimizer
            without momentum when using it.
        momentum_masking: DGC momentum factor masking.
        timeout: seconds a single collective may take before a peer is declared lost
            (``None``: the process group's own timeout).
        guard: a :class:`Guard` (``True``: ``Guard()``; ``None``/``False``: no guard).
    """

    __slots__ = (
        "process_group",
        "policy",
        "schedule",
        "error_feedback",
        "memory",
        "codec_states",
        "step",
        "timeout",
        "guard",
        "stats",
        "_guard_until",
        "_norms",
        "_open",
        "_rank",
        "_protects",
        "_lock",
        "_epoch",
    )
    #: Slots left out of pickles: the process group cannot be pickled, the lock is rebuilt,
    #: an open step's journal is dropped.
    _TRANSIENT: tuple[str, ...] = ("process_group", "_lock", "_open", "_protects", "_epoch")
    #: Per-step records kept in :attr:`stats`.
    STATS_LIMIT = 1000
    #: Settings a plan depends on: assigning one (``state.policy = ...``, ``state.guard =
    #: ...``) is checked as the constructor checks it and starts a new :meth:`plan_epoch`,
    #: so that plans cached by callers (the DDP hook's) are made anew.
    _PLAN_SETTINGS: frozenset[str] = frozenset({"policy", "schedule", "error_feedback", "guard"})
    #: How many times a plan setting was assigned (see :meth:`plan_epoch`).
    _epoch: int

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._PLAN_SETTINGS:
            value = self._checked_setting(name, value)
            object.__setattr__(self, name, value)
            self._settings_changed()
            return
        object.__setattr__(self, name, value)

    def _checked_setting(self, name: str, value: Any) -> Any:
        """``value`` for plan setting ``name``, checked (and built) as the constructor does."""
        if name == "policy":
            policy = CodecPolicy.build(value)
            for what, codec in policy.codecs():
                with error_context(f"{what}"):
                    feedback_applies(codec, getattr(self, "error_feedback", None))
            return policy
        if name == "schedule":
            if not isinstance(value, Schedule):
                raise CommpressError(f"schedule must be a Schedule, got {type(value).__name__}")
            return value
        if name == "error_feedback":
            checked_options(error_feedback=value, timeout=None, guard=None)
            return value
        guard = checked_options(error_feedback=None, timeout=None, guard=value)
        norms = getattr(self, "_norms", ())
        # the spike reference keeps the recent healthy norms, as many as the new window takes
        object.__setattr__(self, "_norms", deque(norms, maxlen=guard.window if guard else 1))
        return guard

    def _settings_changed(self) -> None:
        """A plan setting was assigned: new plan epoch, derived settings forgotten."""
        object.__setattr__(self, "_epoch", getattr(self, "_epoch", 0) + 1)
        object.__setattr__(self, "_protects", None)

    def __init__(
        self,
        policy: Any = "identity",
        *,
        process_group: ProcessGroup | None = None,
        schedule: Schedule | None = None,
        error_feedback: bool | None = None,
        momentum: float = 0.0,
        momentum_masking: bool = True,
        timeout: float | None = None,
        guard: Guard | bool | None = None,
    ) -> None:
        guard = checked_options(error_feedback=error_feedback, timeout=timeout, guard=guard)
        if schedule is not None and not isinstance(schedule, Schedule):
            raise CommpressError(f"schedule must be a Schedule, got {type(schedule).__name__}")
        self.process_group = process_group
        self.policy = CodecPolicy.build(policy)
        self.schedule = schedule if schedule is not None else Schedule()
        self.error_feedback = error_feedback
        self.memory = FeedbackMemory(
            FeedbackConfig(
                error_feedback=error_feedback is not False,
                momentum=momentum,
                momentum_masking=momentum_masking,
            )
        )
        self.codec_states: dict[str, dict[str, Any]] = {}
        self.step = 0
        self.timeout = timeout
        #: The divergence guard (``None``: off).
        self.guard: Guard | None = guard or None
        #: One :class:`StepStats` per ended step, the most recent :attr:`STATS_LIMIT`.
        self.stats: deque[StepStats] = deque(maxlen=self.STATS_LIMIT)
        self._guard_until = 0
        self._norms: deque[float] = deque(maxlen=self.guard.window if self.guard else 1)
        self._open: _OpenStep | None = None
        self._rank = 0
        self._protects: bool | None = None
        self._lock = threading.RLock()
        for what, codec in self.policy.codecs():
            with error_context(f"{what}"):
                self.uses_feedback(codec)  # refuses error_feedback=True with a misfit codec

    # ------------------------------------------------------------------ planning
    def uses_feedback(self, codec: Codec) -> bool:
        """Whether error feedback applies to tensors whose policy codec is ``codec`` (see
        :func:`~commpress.collectives.feedback.feedback_applies`; raises for
        ``error_feedback=True`` with a codec whose error is not contractive)."""
        return feedback_applies(codec, self.error_feedback)

    def guarded(self, step: int) -> bool:
        """Whether ``step`` is sent with the fallback codec because the guard tripped."""
        return step < self._guard_until

    def plan(
        self,
        key: str,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype = torch.float32,
        *,
        step: int | None = None,
    ) -> Plan:
        """Decide how tensor ``key`` is sent at ``step`` (default: the current step)."""
        step = self.step if step is None else step
        policy_codec = self.policy.codec_for(key, shape)
        if step < self._guard_until and not policy_codec.lossless:
            choice = self.schedule.fallback("guard")
        else:
            choice = self.schedule.choose(policy_codec, shape, dtype, step=step)
        return Plan(key, choice.codec, choice.reason, self.uses_feedback(policy_codec), step)

    def plan_epoch(self, step: int) -> tuple[bool, bool, int]:
        """What :meth:`plan` reads of ``step`` and of the settings: whether it is a warm-up
        step, whether the guard sends it with the fallback codec, and how many times a plan
        setting (policy, schedule, error feedback, guard) was assigned. Everything else a plan
        depends on is the tensor's name, shape and dtype, so two steps of the same epoch give
        a tensor the same codec, reason and feedback (callers such as the DDP hook reuse plans
        while the epoch and the tensors stay the same)."""
        return step < self.schedule.warmup_steps, step < self._guard_until, self._epoch

    def codec_state(self, plan: Plan, device: torch.device) -> dict[str, Any]:
        """The persistent codec state dict for ``plan`` (fresh for dense fallbacks).

        It is reset when the codec's configuration changed since it was stored (for example
        a checkpoint resumed with another rank).
        """
        if plan.fallback:
            return {}
        fingerprint = plan.codec.fingerprint()
        with self._lock:
            entry = self.codec_states.get(plan.key)
            if entry is None or entry.get("fingerprint") != fingerprint:
                entry = {"fingerprint": fingerprint, "codec": plan.codec.get_config(), "state": {}}
                self.codec_states[plan.key] = entry
            elif entry.get("device") != str(device):
                entry["state"] = _to_device(entry["state"], device)
            entry["device"] = str(device)
        state: dict[str, Any] = entry["state"]
        return state

    # ------------------------------------------------------------------ reduction
    def prepare(
        self,
        key: str,
        tensor: torch.Tensor,
        *,
        rank: int,
        world_size: int,
        step: int | None = None,
        average: bool = True,
        plan: Plan | None = None,
    ) -> tuple[Plan, torch.Tensor, CodecContext]:
        """Steps 1-2 of the algorithm for one tensor: its plan, its compensated input and the
        codec context to reduce it with.

        Returns ``(plan, x, ctx)``: ``x`` is ``tensor`` plus the remembered error (and DGC
        velocity) when feedback applies, else ``tensor`` itself; ``ctx`` carries the codec's
        persistent per-tensor state and asks for the local contribution exactly when
        feedback applies. Hand ``x`` to any exchange that returns a
        :class:`~commpress.codecs.protocol.Reduced` honouring ``ctx.need_local`` (the codec's
        own protocol, a ring, a hierarchical exchange), then call :meth:`finish`.
        """
        step = self.step if step is None else step
        if plan is None:
            plan = self.plan(key, tensor.shape, tensor.dtype, step=step)
        elif plan.step != step:
            raise CommpressError(
                f"the plan of {key!r} was made for step {plan.step}, but step={step} was given; "
                "plan and reduce the same step"
            )
        self._rank = rank
        codec_state = self.codec_state(plan, tensor.device)
        x = self.compensate(plan, tensor, codec_state=codec_state)
        ctx = CodecContext(
            rank=rank,
            world_size=world_size,
            step=step,
            key=key,
            state=codec_state,
            need_local=plan.feedback,
            average=average,
        )
        return plan, x, ctx

    def compensate(
        self,
        plan: Plan,
        tensor: torch.Tensor,
        *,
        codec_state: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Step 2 for one tensor: journal what the step may change (so :meth:`end_step` can
        undo it) and return ``tensor`` plus the remembered error when feedback applies (else
        ``tensor`` itself). ``codec_state`` is the dict :meth:`codec_state` gave for
        ``plan`` (the codec will change it)."""
        self._journal(plan, codec_state)
        return self.memory.compensate(plan.key, tensor) if plan.feedback else tensor

    def compensate_group(
        self, plans: Sequence[Plan], tensors: Sequence[torch.Tensor]
    ) -> Sequence[torch.Tensor]:
        """:meth:`compensate` for each of a group of tensors sharing a dense codec and
        feedback setting (no codec state); without feedback and without a guard, nothing
        is journaled or added, and ``tensors`` come back as they are."""
        if not plans[0].feedback and self.guard is None:
            return tensors
        return [self.compensate(plan, t) for plan, t in zip(plans, tensors, strict=True)]

    def record_group(self, plans: Sequence[Plan], total: torch.Tensor,
                     tensors: Sequence[torch.Tensor]) -> None:
        """:meth:`finish` for a group of ``tensors`` without error feedback whose totals lie
        back to back in the flat ``total`` (in their dtype): each is counted in its step's
        record, as :meth:`finish` counts it, in one pass."""
        record = self._step_record(plans[0].step)
        measure = self.protects_state()
        with self._lock:
            counted_only = not measure and not record.journal  # no norm of this group
            offset = 0
            for plan, t in zip(plans, tensors, strict=True):
                spec = _spec(plan.codec)
                record.tensors += 1
                record.codecs[spec] = record.codecs.get(spec, 0) + 1
                record.reasons[plan.reason] = record.reasons.get(plan.reason, 0) + 1
                if counted_only:
                    continue
                n = t.numel()
                if measure or plan.key in record.journal:
                    piece = total[offset : offset + n]
                    record.norms.append(torch.linalg.vector_norm(piece, dtype=torch.float64))
                offset += n

    def tally(self, plans: Sequence[Plan]) -> Tally:
        """What :meth:`record_group` counts for ``plans`` when it has no norm to measure, as
        one tally to add at every step that reduces the same group (:meth:`count_tally`)."""
        codecs: dict[str, int] = {}
        reasons: dict[str, int] = {}
        for plan in plans:
            spec = _spec(plan.codec)
            codecs[spec] = codecs.get(spec, 0) + 1
            reasons[plan.reason] = reasons.get(plan.reason, 0) + 1
        return Tally(len(plans), tuple(codecs.items()), tuple(reasons.items()))

    def count_tally(self, step: int, tally: Tally, wire_bytes: int) -> None:
        """:meth:`record_group` of a group without a norm to measure (no error feedback,
        stateful codec or guard in the policy: not :meth:`protects_state`), by its
        :meth:`tally`, and :meth:`note_wire_bytes`, in one update of the step's record."""
        record = self._step_record(step)
        with self._lock:
            record.tensors += tally.tensors
            for spec, n in tally.codecs:
                record.codecs[spec] = record.codecs.get(spec, 0) + n
            for reason, n in tally.reasons:
                record.reasons[reason] = record.reasons.get(reason, 0) + n
            record.wire_bytes += int(wire_bytes)

    # ------------------------------------------------------------------ steps and rollback
    def _step_record(self, step: int) -> _OpenStep:
        """The open step's record, ending an open earlier (or other) step first."""
        with self._lock:
            current = self._open
            if current is not None and current.step == step:
                return current
            self._open = _OpenStep(step)
            opened = self._open
        if current is not None:
            self._settle(current)
        return opened

    def _journal(self, plan: Plan, codec_state: dict[str, Any] | None) -> None:
        """Remember, by reference, the memory and codec state ``plan`` is about to change."""
        stateful = not plan.fallback and plan.codec.stateful and codec_state is not None
        if not (plan.feedback or stateful or self.guard is not None):
            return
        record = self._step_record(plan.step)
        with self._lock:
            if plan.key in record.journal:
                return
            record.journal[plan.key] = (
                self.memory.snapshot(plan.key) if plan.feedback else None,
                codec_state if stateful else None,
                _shallow(codec_state) if stateful else None,
            )

    def protects_state(self) -> bool:
        """Whether a step may change state worth undoing (error feedback or a stateful codec
        somewhere in the policy, or a policy function, which may name one) or a guard is set:
        then every reduced tensor of a step is checked, so that a NaN in a tensor without
        state of its own (a bias sent uncompressed) still undoes the step."""
        if self._protects is None:
            self._protects = self.guard is not None or self.policy.function is not None or any(
                codec.stateful or self.uses_feedback(codec) for _, codec in self.policy.codecs()
            )
        return self._protects

    def note_wire_bytes(self, step: int, nbytes: int) -> None:
        """Add ``nbytes`` sent at ``step`` to that step's :class:`StepStats`."""
        record = self._step_record(step)
        with self._lock:
            record.wire_bytes += int(nbytes)

    def _record(self, plan: Plan, total: torch.Tensor) -> None:
        """Count ``plan``'s tensor in its step's record and queue the norms to measure."""
        record = self._step_record(plan.step)
        spec = _spec(plan.codec)
        with self._lock:
            record.tensors += 1
            record.codecs[spec] = record.codecs.get(spec, 0) + 1
            record.reasons[plan.reason] = record.reasons.get(plan.reason, 0) + 1
            if plan.key in record.journal or self.protects_state():
                # one reduction, no sync here: read at the end of the step
                record.norms.append(torch.linalg.vector_norm(total, dtype=torch.float64))
            if plan.feedback:
                residual = self.memory.residual(plan.key)
                if residual is not None:
                    record.residuals.append(
                        torch.linalg.vector_norm(residual, dtype=torch.float64)
                    )

    def end_step(
        self, step: int | None = None, *, rank: int | None = None, failed: bool = False
    ) -> StepStats | None:
        """End ``step`` (default: whichever step is open): undo its changes to the
        error-feedback memory and codec states if its reduced gradients were non-finite, run
        the guard, and record its :class:`StepStats` (also returned; ``None`` when that step
        is not open). The DDP hook calls it after each step's last bucket; drive it yourself
        after a step's last :meth:`reduce` (a reduction at a later step ends it otherwise).
        ``rank`` is this process's rank, for the guard's log line (rank 0 logs). ``failed``:
        a reduction of the step failed; its changes are undone whatever its gradients, the
        guard skips it, and its stats say ``failed``."""
        if rank is not None:
            self._rank = rank
        with self._lock:
            record = self._open
            if record is None or (step is not None and record.step != step):
                if failed and record is None and step is not None:
                    record = _OpenStep(step)  # failed before it changed or counted anything
                else:
                    return None
            self._open = None
        return self._settle(record, failed=failed)

    def _settle(self, record: _OpenStep, *, failed: bool = False) -> StepStats:
        norms = _to_cpu_floats(record.norms)
        grad_norm = math.sqrt(math.fsum(n * n for n in norms)) if norms else None
        nonfinite = grad_norm is not None and not math.isfinite(grad_norm)
        if nonfinite or failed:
            for key, (memory, codec_state, snapshot) in record.journal.items():
                if memory is not None:
                    self.memory.restore(key, memory)
                if codec_state is not None and snapshot is not None:
                    codec_state.clear()
                    codec_state.update(snapshot)
        residual_norm = None
        if record.residuals and not (nonfinite or failed):
            residual_norm = math.sqrt(math.fsum(r * r for r in _to_cpu_floats(record.residuals)))
        guarded = "guard" in record.reasons
        tripped = None if failed else self._check_guard(
            record.step, grad_norm, nonfinite, guarded=guarded
        )
        stats = StepStats(
            step=record.step,
            tensors=record.tensors,
            codecs=dict(record.codecs),
            reasons=dict(record.reasons),
            wire_bytes=record.wire_bytes,
            grad_norm=grad_norm,
            residual_norm=residual_norm,
            nonfinite=nonfinite if norms else None,
            rolled_back=(nonfinite or failed) and bool(record.journal),
            guard=tripped,
            guarded=guarded,
            failed=failed,
        )
        with self._lock:
            self.stats.append(stats)
        if nonfinite and tripped is None:
            _log.debug("commpress: step %d was non-finite; its codec state changes were undone",
                       record.step)
        return stats

    def _check_guard(
        self, step: int, grad_norm: float | None, nonfinite: bool, *, guarded: bool
    ) -> str | None:
        """Trip the guard for ``step`` when it applies; returns why (or ``None``). Steps sent
        with the fallback because of the guard are neither checked for spikes nor counted in
        the reference: their dense sends flush the accumulated error-feedback residual, so
        their norm is not comparable with compressed steps'."""
        guard = self.guard
        if guard is None or grad_norm is None:
            return None
        if guarded and not nonfinite:
            return None
        tripped: str | None = None
        detail = ""
        if nonfinite:
            if guard.on_nonfinite:
                tripped, detail = "nonfinite", "its reduced gradients were non-finite"
        elif guard.spike_factor is not None and len(self._norms) >= guard.window:
            reference = sorted(self._norms)[len(self._norms) // 2]
            if reference > 0 and grad_norm > guard.spike_factor * reference:
                tripped = "spike"
                detail = (
                    f"its gradient norm {grad_norm:.4g} is {grad_norm / reference:.1f}x the "
                    f"median of the last {guard.window} steps"
                )
        if tripped is None:
            if not nonfinite:
                self._norms.append(grad_norm)
            return None
        self._guard_until = max(self._guard_until, step + 1 + guard.fallback_steps)
        reset = tripped == "spike" and guard.reset_feedback
        if reset:
            self.memory.reset()
        if self._rank == 0:
            _log.warning(
                "commpress guard: step %d tripped (%s); lossy tensors go with %s for steps "
                "%d-%d%s",
                step, detail, self.schedule.fallback_codec, step + 1, self._guard_until - 1,
                "; error-feedback memory reset" if reset else "",
            )
        return tripped

    def finish(
        self, key: str, tensor: torch.Tensor, x: torch.Tensor, plan: Plan, result: Reduced
    ) -> Reduced:
        """Step 4 for one tensor: remember ``x - result.local`` when feedback applies and give
        the total ``tensor``'s dtype. ``x`` and ``plan`` are what :meth:`prepare` returned."""
        if plan.feedback:
            if result.local is None:
                raise CommpressError(
                    f"the exchange of {key!r} with {plan.codec.codec_id!r} returned no local "
                    "contribution, which error feedback needs (it must honour ctx.need_local)"
                )
            self.memory.update(key, x, result.local, mask_momentum=not plan.fallback)
        total = result.total
        if total.dtype != tensor.dtype:
            total = total.to(tensor.dtype)
        self._record(plan, total)
        return Reduced(total=total, local=result.local)

    def reduce(
        self,
        key: str,
        tensor: torch.Tensor,
        *,
        rank: int,
        world_size: int,
        step: int | None = None,
        average: bool = True,
        plan: Plan | None = None,
    ) -> Protocol:
        """The reduction protocol of ``tensor`` (named ``key``) with compensation and memory.

        A generator like :meth:`Codec.reduce`, to be driven by
        :func:`commpress.collectives.driver.execute` (or any driver). Its ``Reduced.total`` is
        the mean over workers (sum when ``average=False``) in ``tensor``'s dtype; its
        ``local`` is this worker's decoded contribution when feedback applied. It is
        :meth:`prepare`, the codec's own protocol and :meth:`finish`.
        """
        return (
            yield from engine.with_feedback(
                self, key, tensor, engine.codec_protocol, rank=rank, world_size=world_size,
                step=step, average=average, plan=plan,
            )
        )

    def advance(self) -> int:
        """Move to the next step; returns the step that just ended."""
        with self._lock:
            done = self.step
            self.step += 1
        return done

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data for a checkpoint: step, error-feedback memory and codec states, with
        every tensor copied to the CPU. The process group and the policy are not included
        (rebuild them from your configuration)."""
        with self._lock:
            codec_states = {
                key: {"fingerprint": e["fingerprint"], "codec": dict(e["codec"]),
                      "state": _to_cpu(e["state"])}
                for key, e in self.codec_states.items()
            }
            step = self.step
        return {
            "version": STATE_VERSION,
            "step": step,
            "memory": self.memory.state_dict(),
            "codec_states": codec_states,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (tensors move to the device at their next use)."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            version = state.get("version") if isinstance(state, Mapping) else None
            raise CommpressError(
                f"CompressionState.load_state_dict expects a state_dict of version "
                f"{STATE_VERSION}, got {type(state).__name__} with version {version!r}"
            )
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CommpressError(f"state_dict['step'] must be an int >= 0, got {step!r}")
        codec_states = state.get("codec_states")
        if not isinstance(codec_states, Mapping):
            raise CommpressError("state_dict['codec_states'] must be a mapping of tensor names")
        loaded: dict[str, dict[str, Any]] = {}
        for key, entry in codec_states.items():
            if not isinstance(entry, Mapping) or not {"fingerprint", "codec", "state"} <= set(
                entry
            ):
                raise CommpressError(
                    f"state_dict['codec_states'][{key!r}] needs fingerprint, codec and state"
                )
            loaded[key] = {
                "fingerprint": entry["fingerprint"],
                "codec": dict(entry["codec"]),
                "state": _to_cpu(entry["state"]),
                "device": "cpu",
            }
        self.memory.load_state_dict(state.get("memory", {}))
        with self._lock:
            self.codec_states = loaded
            self.step = step

    def __getstate__(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for cls in type(self).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if slot not in self._TRANSIENT and hasattr(self, slot):
                    out[slot] = getattr(self, slot)
        return out

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.process_group = None
        self._lock = threading.RLock()
        self._open = None
        self._protects = None
        # states pickled before the guard and stats existed
        self.guard = None
        self.stats = deque(maxlen=self.STATS_LIMIT)
        self._guard_until = 0
        self._norms = deque(maxlen=1)
        self._rank = 0
        for slot, value in state.items():
            setattr(self, slot, value)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(policy={self.policy!r}, schedule={self.schedule}, "
            f"error_feedback={self.error_feedback}, momentum={self.memory.config.momentum}, "
            f"step={self.step})"
        )


__all__ = [
    "STATE_VERSION",
    "CodecPolicy",
    "CodecSpec",
    "CompressionState",
    "Guard",
    "POLICY_FILE_VERSION",
    "Plan",
    "StepStats",
    "checked_options",
    "load_policy_file",
]
