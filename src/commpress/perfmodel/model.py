"""Workloads, platform constants and :func:`predict`: one training step's time with a codec.

A :class:`Workload` is what DDP sees: gradient buckets (each a list of tensor shapes, in the
order they become ready during backward) and the compute times. A :class:`Platform` holds the
constants that are fitted per machine (overlap efficiency, per-collective software overhead,
bandwidth and codec-speed scales). :func:`predict` builds every bucket's exchange
(:mod:`commpress.perfmodel.codec_costs`) and runs the step's timeline
(:mod:`commpress.perfmodel.timeline`); :func:`compare` also predicts the FP16 baseline
(PyTorch's ``fp16_compress_hook``: each bucket cast to float16 and all-reduced as one tensor)
and reports the speedup over it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from commpress.codecs.registry import get_codec
from commpress.collectives.feedback import compression_rate, dense_codec_ids, feedback_applies
from commpress.collectives.strategies import get_strategy
from commpress.errors import CommpressError, error_context, read_json
from commpress.perfmodel.codec_costs import (
    ExchangeConfig,
    Offload,
    SpeedTable,
    exchange_segments,
    exchange_wire_bytes,
    hook_batches,
    local_roundtrip_segments,
    spec_key,
    wire_profile,
)
from commpress.perfmodel.collectives import Cluster
from commpress.perfmodel.ratio import model_codec
from commpress.perfmodel.timeline import MIN_OVERLAP_EFFICIENCY, StepTimeline, simulate_step

#: PyTorch DDP's default bucket cap (``bucket_cap_mb=25``) and first-bucket size (1 MiB).
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
#: Format of the file ``commpress calibrate`` writes (a platform, a cluster, a codec profile).
CALIBRATION_FORMAT = "commpress-calibration/1"
#: The baseline every prediction is compared with.
BASELINE_CODEC = "fp16"

Shape = tuple[int, ...]


def _numel(shape: Shape) -> int:
    return math.prod(shape) if shape else 1


def ddp_bucket_indices(
    shapes: Sequence[Shape],
    *,
    grad_bytes: int = 4,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
) -> list[list[int]]:
    """Group parameters into buckets the way DDP does; returns indices into ``shapes``.

    ``shapes`` are in ``model.parameters()`` order; gradients become ready roughly in reverse
    order, so DDP walks the reversed list, adding tensors to the current bucket and closing it
    once it holds at least the size limit (``first_bucket_bytes`` for the first bucket,
    ``bucket_bytes`` afterwards). The buckets are returned in the order they become ready.
    """
    if bucket_bytes <= 0 or first_bucket_bytes <= 0:
        raise CommpressError("bucket sizes must be > 0 bytes")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    limit = first_bucket_bytes
    for i in reversed(range(len(shapes))):
        current.append(i)
        size += _numel(tuple(int(d) for d in shapes[i])) * grad_bytes
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0.0, bucket_bytes
    if current:
        buckets.append(current)
    return buckets


def ddp_buckets(
    shapes: Sequence[Shape],
    *,
    grad_bytes: int = 4,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
) -> list[list[Shape]]:
    """Group parameter shapes into buckets the way DDP does (:func:`ddp_bucket_indices`),
    in the order the buckets become ready."""
    clean = [tuple(int(d) for d in s) for s in shapes]
    return [
        [clean[i] for i in bucket]
        for bucket in ddp_bucket_indices(
            clean, grad_bytes=grad_bytes, bucket_bytes=bucket_bytes,
            first_bucket_bytes=first_bucket_bytes,
        )
    ]


def estimate_compute_s(
    params: float, *, tokens_per_gpu: float = 16384, flops: float = 4e14
) -> float:
    """Forward + backward time of a transformer step: ``6 * params * tokens / flops``.

    ``flops`` is the *achieved* rate (400 TFLOP/s is ~40% of an H100's dense BF16 peak).
    """
    if params <= 0 or tokens_per_gpu <= 0 or flops <= 0:
        raise CommpressError("params, tokens_per_gpu and flops must be > 0")
    return 6.0 * params * tokens_per_gpu / flops


def transformer_shapes(params: float, *, hidden: int | None = None) -> list[Shape]:
    """Parameter shapes of a GPT-style model of about ``params`` parameters.

    Hidden size ``h`` (default: ``(85 * params / 12) ** (1/3)`` rounded to a multiple of 128,
    i.e. about ``h / 85`` layers of ``12 h^2`` parameters each, as in GPT-3's family); every
    layer holds ``(3h, h)``, ``(h, h)``, ``(4h, h)`` and ``(h, 4h)`` matrices; the remainder
    is one ``(rest / h, h)`` embedding matrix at the front.
    """
    if params <= 0:
        raise CommpressError(f"params must be > 0, got {params!r}")
    if hidden is None:
        h = max(128, int(round((85.0 * params / 12.0) ** (1 / 3) / 128)) * 128)
    else:
        h = int(hidden)
        if h < 1:
            raise CommpressError(f"hidden size must be >= 1, got {hidden!r}")
    per_layer = 12 * h * h
    layers = int(params // per_layer)
    rest = int(params - layers * per_layer)
    shapes: list[Shape] = []
    if rest >= h:
        shapes.append((rest // h, h))
    elif rest > 0:
        shapes.append((rest,))
    for _ in range(layers):
        shapes.extend([(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)])
    return shapes


@dataclass(frozen=True)
class Workload:
    """One data-parallel training step as DDP sees it.

    Attributes:
        buckets: gradient buckets in the order they become ready, each a tuple of tensor
            shapes.
        forward_s: forward time (nothing to overlap with).
        backward_s: backward time; bucket ``i``'s share is proportional to its elements.
        optimizer_s: optimizer step after all gradients are reduced.
        grad_bytes: bytes per gradient element (4 for float32).
        name: free text.
        backward_weights: each bucket's share of the backward time (any positive scale,
            e.g. its layers' flops); ``None``: proportional to its elements. Compute and
            parameters are not proportional in convolutional networks (VGG19's first fully
            connected layer holds 72 % of the parameters and little of the compute).
    """

    buckets: tuple[tuple[Shape, ...], ...]
    forward_s: float
    backward_s: float
    optimizer_s: float = 0.0
    grad_bytes: int = 4
    name: str = ""
    backward_weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for label, v in (("forward_s", self.forward_s), ("backward_s", self.backward_s),
                         ("optimizer_s", self.optimizer_s)):
            if not (math.isfinite(v) and v >= 0):
                raise CommpressError(f"{label} must be finite and >= 0 seconds, got {v!r}")
        if not self.buckets:
            raise CommpressError("a workload needs at least one gradient bucket")
        if self.backward_weights is not None:
            w = self.backward_weights
            if len(w) != len(self.buckets) or not all(
                math.isfinite(x) and x >= 0 for x in w
            ) or not sum(w) > 0:
                raise CommpressError(
                    f"backward_weights needs one finite weight >= 0 per bucket "
                    f"({len(self.buckets)}), not all zero; got {len(w)}"
                )

    @property
    def params(self) -> int:
        return sum(_numel(s) for b in self.buckets for s in b)

    @property
    def bucket_numels(self) -> list[int]:
        return [sum(_numel(s) for s in b) for b in self.buckets]

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def backward_segments(self) -> list[float]:
        sizes: Sequence[float] = self.backward_weights or self.bucket_numels
        total = sum(sizes) or 1
        return [self.backward_s * k / total for k in sizes]

    @classmethod
    def from_shapes(
        cls,
        shapes: Sequence[Shape],
        *,
        compute_s: float,
        backward_fraction: float = 2 / 3,
        optimizer_s: float = 0.0,
        grad_bytes: int = 4,
        bucket_bytes: float = DDP_BUCKET_BYTES,
        first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
        name: str = "",
        compute_weights: Sequence[float] | None = None,
    ) -> Workload:
        """Buckets from parameter shapes (in ``parameters()`` order) as DDP builds them.

        ``compute_s`` is forward + backward; ``backward_fraction`` of it is backward (2/3 for
        transformers: the backward pass does twice the forward's matrix products).
        ``compute_weights`` (one per shape, e.g. the flops of the layer the tensor belongs
        to) spread the backward time over the buckets; by default it follows the elements.
        """
        if not 0 <= backward_fraction <= 1:
            raise CommpressError(f"backward_fraction must be in [0, 1], got {backward_fraction}")
        if not shapes:
            raise CommpressError("no parameter shapes given")
        clean = [tuple(int(d) for d in s) for s in shapes]
        layout = ddp_bucket_indices(clean, grad_bytes=grad_bytes, bucket_bytes=bucket_bytes,
                                    first_bucket_bytes=first_bucket_bytes)
        weights = None
        if compute_weights is not None:
            if len(compute_weights) != len(clean):
                raise CommpressError(f"got {len(compute_weights)} compute weights for "
                                     f"{len(clean)} shapes")
            weights = tuple(float(sum(compute_weights[i] for i in b)) for b in layout)
        return cls(
            buckets=tuple(tuple(clean[i] for i in b) for b in layout),
            backward_weights=weights,
            forward_s=compute_s * (1 - backward_fraction),
            backward_s=compute_s * backward_fraction,
            optimizer_s=optimizer_s,
            grad_bytes=grad_bytes,
            name=name,
        )

    @classmethod
    def from_params(
        cls, params: float, *, compute_s: float | None = None, hidden: int | None = None,
        **kwargs: Any,
    ) -> Workload:
        """A GPT-style model of ``params`` parameters (:func:`transformer_shapes`); compute
        time from :func:`estimate_compute_s` unless given."""
        shapes = transformer_shapes(params, hidden=hidden)
        if compute_s is None:
            compute_s = estimate_compute_s(params)
        from commpress.units import format_count

        kwargs.setdefault("name", f"GPT-style {format_count(params)}")
        return cls.from_shapes(shapes, compute_s=compute_s, **kwargs)

    @classmethod
    def from_bucket_sizes(
        cls, sizes: Sequence[float], *, compute_s: float, backward_fraction: float = 2 / 3,
        **kwargs: Any,
    ) -> Workload:
        """Buckets given as element counts (ready order); each is one flat tensor."""
        if not sizes:
            raise CommpressError("no bucket sizes given")
        buckets = tuple(((int(s),),) for s in sizes)
        if any(s <= 0 for s in sizes):
            raise CommpressError(f"bucket sizes must be > 0 elements, got {list(sizes)}")
        return cls(buckets=buckets, forward_s=compute_s * (1 - backward_fraction),
                   backward_s=compute_s * backward_fraction, **kwargs)

    @classmethod
    def from_module(cls, module: Any, *, compute_s: float, **kwargs: Any) -> Workload:
        """Buckets of an ``nn.Module`` or a ``DistributedDataParallel`` wrapper (its
        ``bucket_bytes_cap`` is used), from the parameters that require gradients."""
        import torch

        bucket_bytes = kwargs.pop("bucket_bytes", None)
        inner = module
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            inner = module.module
            if bucket_bytes is None:
                bucket_bytes = getattr(module, "bucket_bytes_cap", None)
        if not isinstance(inner, torch.nn.Module):
            raise CommpressError(
                f"expected an nn.Module or DistributedDataParallel, got {type(module).__name__}"
            )
        params = [p for p in inner.parameters() if p.requires_grad]
        if not params:
            raise CommpressError("the module has no parameters that require gradients")
        grad_bytes = kwargs.pop("grad_bytes", params[0].element_size())
        kwargs.setdefault("name", type(inner).__name__)
        return cls.from_shapes(
            [tuple(p.shape) for p in params], compute_s=compute_s, grad_bytes=grad_bytes,
            bucket_bytes=bucket_bytes or DDP_BUCKET_BYTES, **kwargs,
        )


@dataclass(frozen=True)
class Platform:
    """Constants of a machine that the alpha-beta model does not know; fitted by
    :func:`commpress.perfmodel.calibration.fit_platform`.

    Attributes:
        overlap_efficiency: ``eta`` in [-4, 1] (see :mod:`commpress.perfmodel.timeline`;
            below 0 overlapped communication slows compute by more than its own time).
        collective_overhead_s: software cost of one collective call beyond the link latency.
        inter_bandwidth_scale: multiplier on the inter-node link's usable bandwidth (what the
            transport really achieves relative to the description).
        codec_time_scale: multiplier on every codec encode/decode time.
        message_latency_s: added to the inter-node link's ``alpha``: paid by every message
            (every hop of a ring), unlike ``collective_overhead_s``, paid once per call.
        compute_time_scale: multiplier on the workload's forward, backward and optimizer
            times (what data-parallel training adds to the single-process compute: DDP's
            autograd hooks, bucket copies, the hook's bookkeeping).
        network_spread: relative uncertainty of the network's time (from the calibration's
            spread); predictions quote a range with it.
        codec_spread: relative uncertainty of codec times (used when larger than the codec
            profile's own spread).
        name: where it comes from.
    """

    overlap_efficiency: float = 1.0
    collective_overhead_s: float = 0.0
    inter_bandwidth_scale: float = 1.0
    codec_time_scale: float = 1.0
    message_latency_s: float = 0.0
    compute_time_scale: float = 1.0
    network_spread: float = 0.0
    codec_spread: float = 0.0
    name: str = "ideal (uncalibrated)"

    def __post_init__(self) -> None:
        if not MIN_OVERLAP_EFFICIENCY <= self.overlap_efficiency <= 1:
            raise CommpressError(
                f"overlap_efficiency must be in [{MIN_OVERLAP_EFFICIENCY:g}, 1], got "
                f"{self.overlap_efficiency!r}"
            )
        for label in ("collective_overhead_s", "message_latency_s"):
            v = getattr(self, label)
            if not (math.isfinite(v) and v >= 0):
                raise CommpressError(f"{label} must be finite and >= 0 seconds, got {v!r}")
        for label in ("network_spread", "codec_spread"):
            v = getattr(self, label)
            if not (math.isfinite(v) and v >= 0):
                raise CommpressError(f"{label} must be finite and >= 0, got {v!r}")
        for label in ("inter_bandwidth_scale", "codec_time_scale", "compute_time_scale"):
            v = getattr(self, label)
            if not (math.isfinite(v) and v > 0):
                raise CommpressError(f"{label} must be finite and > 0, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"format": "commpress-platform/1", **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Platform:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names - {"format"})
        if unknown:
            raise CommpressError(
                f"unknown platform key(s) {', '.join(unknown)}; accepted: "
                f"{', '.join(sorted(names))}"
            )
        return cls(**{k: v for k, v in data.items() if k in names})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Platform:
        """A platform file, or the platform of a ``commpress calibrate`` file."""
        data = read_json(path, f"platform file {path}")
        if isinstance(data, Mapping) and data.get("format") == CALIBRATION_FORMAT:
            data = data.get("platform") or {}
        if not isinstance(data, Mapping):
            raise CommpressError(f"platform file {path} holds no JSON object")
        return cls.from_dict(data)


_BUCKET_JOBS: dict[tuple[Any, str, tuple[Shape, ...]], list[tuple[Any, list[Shape]]]] = {}


@dataclass(frozen=True)
class HookPlan:
    """How commpress's DDP hook (:func:`commpress.ddp.register`) reduces a bucket; pass it to
    :func:`predict` as ``hook=`` to model that hook instead of one exchange per bucket.

    The hook reduces buckets one at a time on a single queue thread. Inside a bucket, every
    tensor gets the codec unless it has fewer than ``min_numel`` elements or the codec would
    shrink it less than ``min_compression_rate`` times (then ``fallback_codec``, as
    :class:`commpress.collectives.feedback.Schedule` decides); tensors with an element-wise
    cast (identity, fp16, bf16) are sent as one flat tensor per cast, first; the other
    tensors, with ``batch_rounds`` and the codec's own protocol (strategies ``auto`` and
    ``allreduce``), are one exchange whose round ``k`` is one all-reduce of all their payloads
    (granularity ``"hook"``, :func:`~commpress.perfmodel.codec_costs.hook_batches`), else
    each its own exchange, ``depth`` of them in flight (one with the hierarchical
    strategies, which the hook runs one at a time). Every exchange uses :func:`predict`'s
    ``strategy``, as ``register(..., strategy=...)`` does.

    Attributes:
        min_numel, min_compression_rate, fallback_codec: as in :func:`commpress.ddp.register`
            (the defaults there are 0, 0 and ``"fp16"``).
        depth: exchanges in flight inside a bucket (the hook pipelines 2).
        error_feedback: as in :func:`commpress.ddp.register` (``None``: automatic, on for
            lossy codecs except the fp16/bf16 casts). With the ring and hierarchical
            strategies feedback costs one more ``decode(encode(x))`` per exchange.
        batch_rounds: as in :func:`commpress.ddp.register` (default ``True``): a bucket's
            non-cast tensors exchanged in lockstep, one all-reduce per round.
    """

    min_numel: int = 0
    min_compression_rate: float = 0.0
    fallback_codec: str = "fp16"
    depth: int = 2
    error_feedback: bool | None = None
    batch_rounds: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.min_numel, bool) or not isinstance(self.min_numel, int) or (
            self.min_numel < 0
        ):
            raise CommpressError(f"min_numel must be an int >= 0, got {self.min_numel!r}")
        rate = self.min_compression_rate
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 0):
            raise CommpressError(f"min_compression_rate must be a number >= 0, got {rate!r}")
        if self.fallback_codec not in dense_codec_ids():
            raise CommpressError(
                f"fallback_codec must be one of {', '.join(dense_codec_ids())}, got "
                f"{self.fallback_codec!r}"
            )
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 1:
            raise CommpressError(f"depth must be an int >= 1, got {self.depth!r}")
        if self.error_feedback not in (None, True, False):
            raise CommpressError(
                f"error_feedback must be True, False or None (automatic), got "
                f"{self.error_feedback!r}"
            )
        if not isinstance(self.batch_rounds, bool):
            raise CommpressError(f"batch_rounds must be a bool, got {self.batch_rounds!r}")

    def feedback(self, codec: Any) -> bool:
        """Whether error feedback applies to the tensors of a bucket whose codec (before any
        fallback) is ``codec``: the hook's rule (:func:`~commpress.collectives.feedback.
        feedback_applies`)."""
        return feedback_applies(codec, self.error_feedback)

    def depth_for(self, strategy: str) -> int:
        """Exchanges in flight inside a bucket with ``strategy``."""
        return get_strategy(strategy).depth(self.depth)

    def choose(self, codec: Any, shape: Shape) -> Any:
        """The codec the hook sends a tensor of ``shape`` with (after any warm-up)."""
        if codec.lossless or codec.elementwise:
            return codec
        if _numel(shape) < self.min_numel:
            return get_codec(self.fallback_codec)
        if self.min_compression_rate > 0 and (
            compression_rate(codec, shape) < self.min_compression_rate
        ):
            return get_codec(self.fallback_codec)
        return codec

    def bucket_jobs(self, codec: Any, bucket: Sequence[Shape]) -> list[tuple[Any, list[Shape]]]:
        """The exchanges of one bucket, in the hook's order: ``(codec, shapes)`` pairs, one
        flat group per element-wise cast first, then one per remaining tensor."""
        key = (self, codec.fingerprint() + codec.codec_id, tuple(tuple(s) for s in bucket))
        cached = _BUCKET_JOBS.get(key)
        if cached is None:
            if len(_BUCKET_JOBS) > 4096:
                _BUCKET_JOBS.clear()
            cached = _BUCKET_JOBS[key] = self._bucket_jobs(codec, bucket)
        return [(c, list(shapes)) for c, shapes in cached]

    def _bucket_jobs(self, codec: Any, bucket: Sequence[Shape]) -> list[tuple[Any, list[Shape]]]:
        groups: dict[str, tuple[Any, list[Shape]]] = {}
        singles: list[tuple[Any, list[Shape]]] = []
        for shape in bucket:
            c = self.choose(codec, shape)
            if c.elementwise:
                groups.setdefault(c.fingerprint() + c.codec_id, (c, []))[1].append(shape)
            else:
                singles.append((c, [shape]))
        return [*groups.values(), *singles]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    """One predicted step.

    Attributes:
        codecs: the codec spec of each bucket.
        strategy: exchange strategy.
        timeline: the simulated step (``timeline.total`` is the prediction).
        wire_bytes: bytes one rank contributes per step (sum over rounds of every tensor).
        bits_per_coordinate: ``8 * wire_bytes / parameters``.
    """

    codecs: tuple[str, ...]
    strategy: str
    timeline: StepTimeline
    wire_bytes: float
    bits_per_coordinate: float

    @property
    def total(self) -> float:
        return self.timeline.total

    @property
    def codec(self) -> str:
        """The codec, or ``"mixed"`` when buckets use different ones."""
        unique = sorted(set(self.codecs))
        return unique[0] if len(unique) == 1 else "mixed"

    def breakdown(self) -> dict[str, float]:
        return self.timeline.breakdown()


@dataclass(frozen=True)
class Comparison:
    """A prediction next to the FP16 baseline's; ``speedup > 1`` means the codec wins."""

    prediction: Prediction
    baseline: Prediction

    @property
    def speedup(self) -> float:
        return self.baseline.total / self.prediction.total if self.prediction.total else math.inf


def _as_cluster(cluster: Cluster | Mapping[str, Any]) -> Cluster:
    if isinstance(cluster, Cluster):
        return cluster
    return Cluster.from_measured(cluster)


def predict(
    workload: Workload,
    cluster: Cluster | Mapping[str, Any],
    codec: str | Any | Sequence[str],
    *,
    strategy: str = "auto",
    algorithm: str = "ring",
    granularity: str = "parameter",
    speeds: SpeedTable | None = None,
    offload: Offload | None = None,
    platform: Platform | None = None,
    hook: HookPlan | None = None,
) -> Prediction:
    """Predict one step of ``workload`` on ``cluster`` with ``codec``.

    Args:
        workload: buckets and compute times.
        cluster: a :class:`Cluster`, or a mapping accepted by :meth:`Cluster.from_measured`.
        codec: a codec (spec string such as ``"powersgd:rank=4"``, config mapping or
            instance) for every bucket, or a list with one spec per bucket.
        strategy: exchange strategy (:data:`commpress.perfmodel.codec_costs.STRATEGIES`).
        algorithm: all-reduce algorithm: ``ring`` (default), ``tree``, ``rhd``.
        granularity: ``"parameter"`` (each tensor reduced on its own, as commpress's DDP hook
            does with ``batch_rounds=False``), ``"bucket"`` (each bucket as one flat tensor),
            ``"batched"`` (each tensor encoded on its own, the bucket's payloads exchanged
            together: PyTorch's PowerSGD hook) or ``"hook"`` (what commpress's DDP hook does
            by default: where it batches a bucket's rounds
            (:func:`~commpress.perfmodel.codec_costs.hook_batches`), one all-reduce per round
            but the codec's fixed costs per tensor; else ``"parameter"``).
        speeds: codec speed table (default: the built-in assumptions).
        offload: run codec work on this device (SqueezeNIC) instead of the GPU.
        platform: fitted platform constants (default: the ideal model).
        hook: model commpress's DDP hook (:class:`HookPlan`: dense fallback for small or
            incompressible tensors, one bucket at a time, tensors pipelined) instead of one
            exchange per bucket issued as soon as the bucket is ready (``None``, PyTorch's
            own hooks). ``granularity="bucket"`` ignores the plan's per-tensor choices; with
            a plan, ``"parameter"`` and ``"hook"`` both model the hook, which batches a
            bucket's rounds as the plan's ``batch_rounds`` says (``HookPlan(batch_rounds=
            False)`` is the hook reducing each tensor on its own).
    """
    platform = platform or Platform()
    cl = _as_cluster(cluster)
    if platform.inter_bandwidth_scale != 1.0 or platform.message_latency_s:
        cl = cl.with_inter(bandwidth=cl.inter.bandwidth * platform.inter_bandwidth_scale,
                           latency=cl.inter.latency + platform.message_latency_s)
    cfg = ExchangeConfig(
        cluster=cl,
        strategy=strategy,
        algorithm=algorithm,
        speeds=speeds or SpeedTable.builtin(),
        offload=offload,
        grad_bytes=workload.grad_bytes,
        collective_overhead_s=platform.collective_overhead_s,
        codec_time_scale=platform.codec_time_scale,
    )
    n_buckets = len(workload.buckets)
    if isinstance(codec, (list, tuple)):
        if len(codec) != n_buckets:
            raise CommpressError(f"got {len(codec)} codecs for {n_buckets} buckets")
        specs = list(codec)
    else:
        specs = [codec] * n_buckets
    built: dict[int, Any] = {}
    codecs = []
    for s in specs:
        if id(s) not in built:
            built[id(s)] = model_codec(s)
        codecs.append(built[id(s)])
    if hook is not None and granularity in ("parameter", "hook"):
        return _predict_hooked(workload, cl, codecs, cfg, platform, hook, strategy)
    jobs = []
    cache: dict[tuple[str, tuple[Shape, ...]], Any] = {}
    wire = 0.0
    for c, bucket in zip(codecs, workload.buckets, strict=True):
        key = (c.fingerprint() + c.codec_id, bucket)
        if key not in cache:
            with error_context(f"planning {spec_key(c)} for a bucket of {len(bucket)} tensors"):
                segs = exchange_segments(c, bucket, cfg, granularity=granularity)
            flat = granularity == "bucket" or c.elementwise
            tensors = [(sum(_numel(s) for s in bucket),)] if flat else list(bucket)
            nbytes = sum(wire_profile(c, t, cl.world_size, cfg.grad_dtype).nbytes
                         for t in tensors)
            cache[key] = (segs, nbytes)
        segs, nbytes = cache[key]
        jobs.append(segs)
        wire += nbytes
    return _simulate(workload, platform, cl, jobs, codecs, strategy, wire)


def _simulate(
    workload: Workload,
    platform: Platform,
    cl: Cluster,
    jobs: list[Any],
    codecs: Sequence[Any],
    strategy: str,
    wire: float,
    **options: Any,
) -> Prediction:
    """The prediction: the step's timeline (the workload's compute, scaled by the platform,
    around ``jobs``) and the ``wire`` bytes one rank sends for ``codecs``."""
    scale = platform.compute_time_scale
    timeline = simulate_step(
        forward_s=workload.forward_s * scale,
        backward_s=[b * scale for b in workload.backward_segments()],
        jobs=jobs,
        optimizer_s=workload.optimizer_s * scale,
        overlap_efficiency=platform.overlap_efficiency,
        token_bucket=_token_bucket(cl),
        **options,
    )
    return Prediction(
        codecs=tuple(spec_key(c) for c in codecs),
        strategy=strategy,
        timeline=timeline,
        wire_bytes=wire,
        bits_per_coordinate=8.0 * wire / max(1, workload.params),
    )


def _token_bucket(cl: Cluster) -> tuple[float, float] | None:
    """The bottleneck link's token bucket in payload terms, if it is rate-limited."""
    link = cl.bottleneck
    if link.burst <= 0 or cl.nodes < 2:
        return None
    return (link.burst * link.efficiency, link.effective_bandwidth)


def _predict_hooked(
    workload: Workload,
    cl: Cluster,
    codecs: Sequence[Any],
    cfg: ExchangeConfig,
    platform: Platform,
    hook: HookPlan,
    strategy: str,
) -> Prediction:
    """:func:`predict` for commpress's DDP hook: one job per exchange of
    :meth:`HookPlan.bucket_jobs`, each exchanged by ``strategy`` as the hook runs it (ring:
    per-hop re-encoding; hierarchical: intra-node reduce-scatter and all-gather around the
    inter-node exchange of one shard, one exchange at a time), plus the ``decode(encode(x))``
    that ring and hierarchical exchanges compute when error feedback applies; buckets in
    queue mode (see :func:`simulate_step`)."""
    jobs: list[list[Any]] = []
    owners: list[int] = []
    wire = 0.0
    cache: dict[tuple[str, bool, tuple[Shape, ...]], Any] = {}
    roundtrip = get_strategy(strategy).local_is_roundtrip
    for b, (codec, bucket) in enumerate(zip(codecs, workload.buckets, strict=True)):
        feedback = roundtrip and hook.feedback(codec)
        exchanges = hook.bucket_jobs(codec, bucket)
        singles = [shapes[0] for c, shapes in exchanges if not c.elementwise]
        if hook.batch_rounds and hook_batches(codec, singles, cfg):
            # the hook's lockstep exchange of every non-cast tensor (all of them ``codec``)
            exchanges = [(c, s) for c, s in exchanges if c.elementwise] + [(codec, singles)]
        for c, shapes in exchanges:
            key = (str(id(c)), feedback, tuple(shapes))
            if key not in cache:
                flat = c.elementwise
                granularity = ("bucket" if flat else "hook" if len(shapes) > 1
                               else "parameter")
                with error_context(f"planning {spec_key(c)} for {len(shapes)} tensor(s) with "
                                   f"strategy {strategy!r}"):
                    segs = exchange_segments(c, shapes, cfg, granularity=granularity)
                tensors = [(sum(_numel(s) for s in shapes),)] if flat else list(shapes)
                if feedback:
                    # the hook's flat group is one exchange: one round trip of its length
                    local = [seg for t in tensors
                             for seg in local_roundtrip_segments(c, _numel(t), cfg)]
                    segs = local + segs
                nbytes = sum(exchange_wire_bytes(c, t, cl, strategy, dtype=cfg.grad_dtype)
                             for t in tensors)
                cache[key] = (segs, nbytes)
            segs, nbytes = cache[key]
            jobs.append(segs)
            owners.append(b)
            wire += nbytes
    return _simulate(
        workload, platform, cl, jobs, codecs, strategy, wire,
        bucket_of=owners, queue_depth=hook.depth_for(strategy),
    )


def predict_baseline(
    workload: Workload,
    cluster: Cluster | Mapping[str, Any],
    *,
    algorithm: str = "ring",
    speeds: SpeedTable | None = None,
    platform: Platform | None = None,
) -> Prediction:
    """The FP16 baseline: every bucket cast to float16 and all-reduced as one flat tensor."""
    return predict(workload, cluster, BASELINE_CODEC, strategy="auto", algorithm=algorithm,
                   granularity="bucket", speeds=speeds, platform=platform)


@dataclass(frozen=True)
class SpeedupRange:
    """A codec's speedup over the baseline, nominal and within the calibration's spread:
    ``low`` with the network faster and the codecs slower than calibrated (the case least
    favourable to compression), ``high`` the reverse."""

    low: float
    nominal: float
    high: float

    def __str__(self) -> str:
        return f"{self.nominal:.3f}x ({self.low:.3f}-{self.high:.3f})"


def speedup_range(
    workload: Workload,
    cluster: Cluster | Mapping[str, Any],
    codec: str | Any | Sequence[str],
    *,
    speeds: SpeedTable | None = None,
    platform: Platform | None = None,
    **kwargs: Any,
) -> SpeedupRange:
    """:func:`predict`'s speedup over the FP16 baseline, and its range: the network's time
    moved by ``platform.network_spread`` and the codecs' by the larger of the profile's
    spread and ``platform.codec_spread``, in the directions that favour compression least
    (``low``) and most (``high``). The baseline is predicted under the same changes."""
    platform = platform or Platform()
    speeds = speeds or SpeedTable.builtin()
    s_net = platform.network_spread
    s_codec = max(speeds.spread, platform.codec_spread)
    base_kwargs = {k: kwargs[k] for k in ("algorithm",) if k in kwargs}

    def at(net: float, codec_f: float) -> float:
        p = replace(platform, inter_bandwidth_scale=platform.inter_bandwidth_scale * net)
        cl = _as_cluster(cluster)
        if net != 1.0:
            cl = replace(cl, intra=replace(cl.intra, bandwidth=cl.intra.bandwidth * net))
        sp = speeds.scaled(codec_f) if codec_f != 1.0 else speeds
        pred = predict(workload, cl, codec, speeds=sp, platform=p, **kwargs).total
        base = predict_baseline(workload, cl, speeds=sp, platform=p, **base_kwargs).total
        return base / pred

    nominal = at(1.0, 1.0)
    if not s_net and not s_codec:
        return SpeedupRange(nominal, nominal, nominal)
    low = at(1.0 + s_net, 1.0 + s_codec)
    high = at(1.0 / (1.0 + s_net), 1.0 / (1.0 + s_codec))
    return SpeedupRange(min(low, nominal), nominal, max(high, nominal))


def compare(
    workload: Workload,
    cluster: Cluster | Mapping[str, Any],
    codec: str | Any | Sequence[str],
    **kwargs: Any,
) -> Comparison:
    """:func:`predict` plus the FP16 baseline on the same workload, cluster and platform."""
    base_kwargs = {k: kwargs[k] for k in ("algorithm", "speeds", "platform") if k in kwargs}
    return Comparison(
        prediction=predict(workload, cluster, codec, **kwargs),
        baseline=predict_baseline(workload, cluster, **base_kwargs),
    )


@dataclass(frozen=True)
class Setup:
    """One configuration to predict (and, for validation, to measure).

    ``label`` names it in tables; ``extra`` carries anything the caller wants to keep with it
    (for example the command that measured it). ``hook`` models commpress's DDP hook
    (:class:`HookPlan`); ``speeds`` is a codec speed table measured for this setup (used
    instead of the one passed to :meth:`predict`).

    ``contention`` is how many runnable threads share each CPU core during the step (1 on a
    GPU machine, where the codec runs on the GPU and the host has cores to spare). The
    platform's CPU-bound software costs - codec time, per-call overhead, per-message latency
    (a message is handled only when its receiver gets a core) - are multiplied by it; the
    workload's compute times must already be measured under the same contention.
    """

    workload: Workload
    cluster: Cluster
    codec: str
    strategy: str = "auto"
    algorithm: str = "ring"
    granularity: str = "parameter"
    offload: Offload | None = None
    label: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    hook: HookPlan | None = None
    speeds: SpeedTable | None = None
    contention: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.contention) and self.contention >= 1.0):
            raise CommpressError(f"contention must be a number >= 1, got {self.contention!r}")

    def platform_for(self, platform: Platform | None = None) -> Platform:
        """``platform`` with its CPU-bound software costs multiplied by :attr:`contention`."""
        p = platform or Platform()
        c = self.contention
        if c == 1.0:
            return p
        return replace(p, codec_time_scale=p.codec_time_scale * c,
                       collective_overhead_s=p.collective_overhead_s * c,
                       message_latency_s=p.message_latency_s * c)

    def predict(self, platform: Platform | None = None,
                speeds: SpeedTable | None = None) -> Prediction:
        """Predict with ``platform`` (see :attr:`contention`); ``speeds`` is used unless the
        setup carries its own table."""
        return predict(
            self.workload, self.cluster, self.codec, strategy=self.strategy,
            algorithm=self.algorithm, granularity=self.granularity, offload=self.offload,
            platform=self.platform_for(platform), speeds=self.speeds or speeds,
            hook=self.hook,
        )

    def with_(self, **changes: Any) -> Setup:
        return replace(self, **changes)


def grid(
    workloads: Iterable[Workload],
    clusters: Iterable[Cluster],
    codecs: Iterable[str],
    **kwargs: Any,
) -> list[Setup]:
    """Every combination, labelled ``"<workload> | <nodes>x<gpus> <bw> | <codec>"``."""
    from commpress.units import format_bandwidth

    out = []
    clusters = list(clusters)
    codecs = list(codecs)
    for w in workloads:
        for cl in clusters:
            for c in codecs:
                label = (f"{w.name} | {cl.nodes}x{cl.gpus_per_node} "
                         f"{format_bandwidth(cl.inter.bandwidth)} | {c}")
                out.append(Setup(w, cl, c, label=label, **kwargs))
    return out


__all__ = [
    "BASELINE_CODEC",
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "Comparison",
    "HookPlan",
    "Platform",
    "Prediction",
    "Setup",
    "SpeedupRange",
    "Workload",
    "compare",
    "ddp_buckets",
    "estimate_compute_s",
    "grid",
    "predict",
    "predict_baseline",
    "speedup_range",
    "transformer_shapes",
]
