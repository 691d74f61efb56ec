"""What a codec costs: wire bytes and rounds (from the codec itself), encode/decode time (from
a throughput table), and the exchange of one tensor as timeline segments.

Wire bytes come from each codec's size formula (:meth:`~commpress.codecs.base.Codec.wire_rounds`:
the bytes one rank contributes to every round of its protocol, exact for any shape, dtype and
world size, held against real payloads by ``tests/test_perfmodel_shapes.py``), so a 70B
model's tensors cost nothing to price. Only codecs without a formula (``netzip``, whose size
depends on the values) are measured on a Gaussian sample and scaled by its compression ratio
(:func:`wire_profile`).

Encode/decode time is ``max(c0, n / throughput)`` with a per-codec fixed cost ``c0`` (kernel
launches, host synchronisation) and a throughput in elements per second, looked up in a
:class:`SpeedTable`: the built-in table of assumed datacenter-GPU figures, or one measured on
the target machine by :func:`calibrate_speeds` (``commpress predict --calibrate-codecs``) and
stored as JSON.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from commpress.codecs.base import Codec, CodecContext
from commpress.codecs.protocol import AllGather, AllReduce
from commpress.codecs.registry import get_codec
from commpress.codecs.simulate import single_worker
from commpress.codecs.thc import FUSED_BLOCK_LOG2, Thc
from commpress.collectives.policy import CompressionState
from commpress.collectives.strategies import get_strategy, strategy_names
from commpress.errors import CommpressError, error_context, read_json
from commpress.metrics import gaussian, heavy_tailed, nmse
from commpress.perfmodel import collectives as coll
from commpress.perfmodel.collectives import Cluster
from commpress.perfmodel.ratio import RatioCodec, model_codec
from commpress.perfmodel.timeline import Segment
from commpress.units import usable_device

#: Largest sample (elements) encoded to measure wire bytes; larger tensors are extrapolated.
SAMPLE_MAX = 1 << 16
#: The gradient dtype priced for each ``grad_bytes`` (2 bytes: bfloat16, the usual 16-bit
#: training type; float16 gradients differ only in Top-K's one exponent byte per tensor).
GRAD_DTYPES: dict[int, torch.dtype] = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
#: Format of a device profile (``commpress bench codecs --profile``); the older
#: ``commpress-codec-speeds/1`` tables load too.
PROFILE_FORMAT = "commpress-device-profile/1"
SPEED_FORMATS: tuple[str, ...] = (PROFILE_FORMAT, "commpress-codec-speeds/1")
#: The registered strategies (:mod:`commpress.collectives.strategies`).
STRATEGIES: tuple[str, ...] = strategy_names()
#: How a bucket's tensors are reduced (:func:`exchange_segments`).
GRANULARITIES: tuple[str, ...] = ("parameter", "bucket", "batched", "hook")


# ---------------------------------------------------------------------------- throughput
@dataclass(frozen=True, slots=True, kw_only=True)
class RotationCost:
    """What a Hadamard rotation (THC) of a block too large for the codec's fused kernel costs
    on top of the measured encode or decode (whose kernel rotates blocks of up to
    ``2^fused_log2`` coordinates in fast on-chip memory, in the same pass as the
    quantisation).

    A block of ``2^L`` coordinates with ``L > fused_log2`` (THC's ``block_log2="full"``) is
    rotated in passes over global memory, each reading and writing the padded tensor once
    and doing ``radix_log2`` butterfly stages: ``restart=True``, the implementation then
    leaves its fused kernel and runs all ``L`` stages that way (commpress's torch fallback:
    one stage per pass); ``restart=False``, the fused pass still does ``fused_log2`` stages
    and ``ceil((L - fused_log2) / radix_log2)`` more passes do the rest (a kernel that
    rotates across blocks with the on-chip block as its radix).

    Attributes:
        fused_log2: largest block (log2) the fused kernel rotates.
        radix_log2: butterfly stages per pass over global memory beyond it.
        restart: whether all ``L`` stages run in such passes (see above).
        pass_eps: padded elements per second of one pass.
    """

    fused_log2: int
    radix_log2: int
    restart: bool
    pass_eps: float

    def __post_init__(self) -> None:
        if self.fused_log2 < 0 or self.radix_log2 < 1:
            raise CommpressError(f"rotation needs fused_log2 >= 0 and radix_log2 >= 1, got "
                                 f"{self.fused_log2!r} and {self.radix_log2!r}")
        if not self.pass_eps > 0:
            raise CommpressError(f"rotation pass_eps must be > 0, got {self.pass_eps!r}")

    def passes(self, block: int) -> int:
        """Passes over global memory to rotate blocks of ``block`` coordinates."""
        log2 = max(0, int(block).bit_length() - 1)
        if log2 <= self.fused_log2:
            return 0
        todo = log2 if self.restart else log2 - self.fused_log2
        return -(-todo // self.radix_log2)

    def time(self, padded: float, block: int) -> float:
        """Extra seconds to rotate ``padded`` coordinates in blocks of ``block``."""
        return self.passes(block) * padded / self.pass_eps

    def to_dict(self) -> dict[str, Any]:
        return {"fused_log2": self.fused_log2, "radix_log2": self.radix_log2,
                "restart": self.restart, "pass_eps": self.pass_eps}

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> RotationCost:
        return cls(fused_log2=int(entry["fused_log2"]), radix_log2=int(entry["radix_log2"]),
                   restart=bool(entry["restart"]), pass_eps=float(entry["pass_eps"]))


@dataclass(frozen=True, slots=True)
class CodecSpeed:
    """Encode/decode time model of one codec.

    ``max(c0, n / throughput)`` (a table measured at two sizes, where the small one is
    overhead-bound), or, for a profile fitted by ``commpress bench codecs --profile``
    (``additive=True``), ``c0 + n / throughput + flops / flop_rate``: a fixed cost per call,
    a memory-bound pass over the ``n`` elements and, for codecs built on matrix products
    (PowerSGD), their arithmetic at the device's measured matmul rate.

    Attributes:
        overhead_s: ``c0``, the fixed cost of one call (seconds).
        encode_eps: encode throughput, elements per second (``inf``: free).
        decode_eps: decode throughput, elements per second.
        additive: ``c0 + n / eps`` instead of ``max(c0, n / eps)``.
        flops: matrix-product rate (flop/s) for the codec's products (PowerSGD: ``4 n m r``
            flops to encode an ``n x m`` matrix at rank ``r``, ``2 n m r`` to decode).
        orth_flops: rate (flop/s) of the encode's orthogonalisation (PowerSGD: ``2 n r^2``
            flops per power iteration to orthonormalise the ``n x r`` factor, see
            :func:`codec_orth_flops`), a column-by-column factorisation that runs far below
            the matrix-product rate; ``inf``: not charged apart (a profile fitted without
            it, whose ``flops`` rate then absorbs it linearly in ``r``).
        accumulate_eps: entries per second that a sparse codec scatter-adds when it sums
            all-gathered payloads (``inf``: not measured; the sum then costs dense decodes).
        accumulate_s: fixed cost of one payload's scatter-add.
        decode_overhead_s: ``c0`` of a decode when it differs from the encode's (``None``:
            ``overhead_s``).
        spread: relative uncertainty of the times (from the profile's fit and repeats).
    """

    overhead_s: float
    encode_eps: float
    decode_eps: float
    additive: bool = False
    flops: float = math.inf
    accumulate_eps: float = math.inf
    accumulate_s: float = 0.0
    decode_overhead_s: float | None = None
    spread: float = 0.0
    orth_flops: float = math.inf
    rotation: RotationCost | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.overhead_s) and self.overhead_s >= 0):
            raise CommpressError(f"codec overhead must be finite and >= 0 s, got "
                                 f"{self.overhead_s!r}")
        for name in ("encode_eps", "decode_eps", "flops", "accumulate_eps", "orth_flops"):
            v = getattr(self, name)
            if not v > 0:
                raise CommpressError(f"{name} must be > 0 per second, got {v!r}")
        for name in ("accumulate_s", "decode_overhead_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise CommpressError(f"{name} must be finite and >= 0 s, got {v!r}")
        if not (math.isfinite(self.spread) and self.spread >= 0):
            raise CommpressError(f"speed spread must be finite and >= 0, got {self.spread!r}")

    def _time(self, numel: float, eps: float, flops: float, c0: float,
              orth: float = 0.0) -> float:
        if numel <= 0:
            return 0.0
        work = numel / eps + flops / self.flops + orth / self.orth_flops
        return c0 + work if self.additive else max(c0, work)

    def encode_time(self, numel: float, flops: float = 0.0, orth: float = 0.0) -> float:
        """``orth``: flops of the encode's orthogonalisation (:func:`codec_orth_flops`)."""
        return self._time(numel, self.encode_eps, flops, self.overhead_s, orth)

    def decode_time(self, numel: float, flops: float = 0.0) -> float:
        c0 = self.overhead_s if self.decode_overhead_s is None else self.decode_overhead_s
        return self._time(numel, self.decode_eps, flops, c0)

    def encode_work(self, numel: float, flops: float = 0.0, orth: float = 0.0) -> float:
        """:meth:`encode_time` without the fixed cost of the call."""
        return self._time(numel, self.encode_eps, flops, 0.0, orth)

    def decode_work(self, numel: float, flops: float = 0.0) -> float:
        """:meth:`decode_time` without the fixed cost of the call."""
        return self._time(numel, self.decode_eps, flops, 0.0)

    @property
    def accumulates(self) -> bool:
        """Whether a scatter-add rate was measured."""
        return not math.isinf(self.accumulate_eps) or self.accumulate_s > 0

    def accumulate_time(self, entries: float) -> float:
        """Scatter-adding one payload of ``entries`` (value, index) pairs into an accumulator."""
        if entries <= 0 or not self.accumulates:
            return 0.0
        return self.accumulate_s + entries / self.accumulate_eps

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"overhead_s": self.overhead_s, "encode_eps": self.encode_eps,
                               "decode_eps": self.decode_eps}
        if self.additive:
            out["additive"] = True
        for name in ("flops", "accumulate_eps", "orth_flops"):
            if not math.isinf(getattr(self, name)):
                out[name] = getattr(self, name)
        if self.accumulate_s:
            out["accumulate_s"] = self.accumulate_s
        if self.decode_overhead_s is not None:
            out["decode_overhead_s"] = self.decode_overhead_s
        if self.spread:
            out["spread"] = self.spread
        if self.rotation is not None:
            out["rotation"] = self.rotation.to_dict()
        return out

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> CodecSpeed:
        return cls(
            float(entry["overhead_s"]), float(entry["encode_eps"]), float(entry["decode_eps"]),
            additive=bool(entry.get("additive", False)),
            flops=float(entry.get("flops", math.inf)),
            accumulate_eps=float(entry.get("accumulate_eps", math.inf)),
            accumulate_s=float(entry.get("accumulate_s", 0.0)),
            decode_overhead_s=(None if entry.get("decode_overhead_s") is None
                               else float(entry["decode_overhead_s"])),
            spread=float(entry.get("spread", 0.0)),
            orth_flops=float(entry.get("orth_flops", math.inf)),
            rotation=(None if entry.get("rotation") is None
                      else RotationCost.from_dict(entry["rotation"])),
        )


#: Where the built-in device profiles live (``commpress bench codecs --profile`` output).
PROFILE_DIR = Path(__file__).with_name("data")
#: The built-in profile of each device kind.
BUILTIN_PROFILES: dict[str, str] = {"gpu": "speeds-h100.json", "cpu": "speeds-cpu.json"}
#: Used for a codec a profile does not list.
FALLBACK_SPEED = CodecSpeed(100e-6, 5e9, 1e10)
#: Passes over memory of one butterfly stage of :func:`commpress.codecs.thc.hadamard_transform`
#: relative to a copy: each stage reads every element twice (the sum and the difference)
#: and writes it once, 12 bytes per float32 where a copy moves 8.
BUTTERFLY_STAGE_COPIES = 1.5


def code_rotation(table: SpeedTable) -> RotationCost:
    """How commpress's own THC rotates a block larger than its fused kernel holds
    (:data:`commpress.codecs.thc.FUSED_BLOCK_LOG2`: 2^12 for the Triton kernel of a GPU
    profile, 2^15 for the numba kernel of a CPU one): the torch fallback runs all ``log2 B``
    butterfly stages, one pass each, at the table's measured copy rate (the identity's
    decode) divided by :data:`BUTTERFLY_STAGE_COPIES`."""
    device = "cpu" if str(table.provenance.get("device", "")).startswith("cpu") else "gpu"
    copy = table.lookup(get_codec("identity"))
    return RotationCost(fused_log2=FUSED_BLOCK_LOG2[device], radix_log2=1, restart=True,
                        pass_eps=copy.decode_eps / BUTTERFLY_STAGE_COPIES)


def _builtin_table(device: str) -> SpeedTable:
    if device not in BUILTIN_PROFILES:
        raise CommpressError(f"no built-in codec profile for {device!r}; built-in: "
                             f"{', '.join(BUILTIN_PROFILES)}")
    return _load_builtin(device)


@functools.cache
def _load_builtin(device: str) -> SpeedTable:
    return shipped_profile(PROFILE_DIR / BUILTIN_PROFILES[device], f"built-in {device} profile")


def shipped_profile(path: Path, label: str) -> SpeedTable:
    """A profile shipped with the package (:data:`PROFILE_DIR`), its source prefixed with
    ``label``, with :data:`FALLBACK_SPEED` for codecs it does not list."""
    table = SpeedTable.from_dict(json.loads(path.read_text()))
    speeds = dict(table.speeds)
    speeds.setdefault("*", FALLBACK_SPEED)
    return SpeedTable(speeds, f"{label}: {table.source}", table.provenance)


def spec_key(codec: Codec) -> str:
    """The key of a codec in a :class:`SpeedTable`: :meth:`Codec.spec` (``"topk"`` for a
    default-configured codec, else ``"topk:ratio=0.001"``, the parameters that differ from
    their defaults), the one spec string of the library."""
    return codec.spec()


@dataclass(frozen=True)
class SpeedTable:
    """Codec speeds by key: exact spec (:func:`spec_key`), then codec id, then ``"*"``."""

    speeds: Mapping[str, CodecSpeed]
    source: str = "built-in"
    provenance: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def builtin(cls, device: str = "gpu") -> SpeedTable:
        """The shipped profile measured on ``device`` (``"gpu"``: an H100, ``"cpu"``); see
        :data:`BUILTIN_PROFILES` and the ``provenance`` of the returned table."""
        return _builtin_table(device)

    def lookup(self, codec: Codec) -> CodecSpeed:
        for key in (spec_key(codec), codec.codec_id, "*"):
            if key in self.speeds:
                return self.speeds[key]
        return FALLBACK_SPEED

    @property
    def spread(self) -> float:
        """The largest relative spread of any entry (0 when the table records none)."""
        return max((v.spread for v in self.speeds.values()), default=0.0)

    def scaled(self, factor: float, *, fixed_costs: bool = True) -> SpeedTable:
        """Every codec ``factor`` times slower: throughputs divided by ``factor`` and, with
        ``fixed_costs``, every fixed cost (the encode's, the decode's and the scatter-add's)
        times ``factor``; for example the share of a core a process gets when several share
        it. ``fixed_costs=False`` slows only the work that spreads over threads (the
        per-element passes and matrix products), not the per-call dispatch."""
        if not (math.isfinite(factor) and factor > 0):
            raise CommpressError(f"speed scale factor must be finite and > 0, got {factor!r}")
        c = factor if fixed_costs else 1.0
        return SpeedTable(
            {k: replace(v, overhead_s=v.overhead_s * c, encode_eps=v.encode_eps / factor,
                        decode_eps=v.decode_eps / factor, flops=v.flops / factor,
                        orth_flops=v.orth_flops / factor,
                        rotation=None if v.rotation is None else replace(
                            v.rotation, pass_eps=v.rotation.pass_eps / factor),
                        accumulate_eps=v.accumulate_eps / factor,
                        accumulate_s=v.accumulate_s * c,
                        decode_overhead_s=None if v.decode_overhead_s is None
                        else v.decode_overhead_s * c)
             for k, v in self.speeds.items()},
            self.source if factor == 1 else f"{self.source}, x{factor:g} slower",
            self.provenance,
        )

    def at_spread(self, direction: int) -> SpeedTable:
        """Every codec moved by its own spread: slower for ``direction=1``, faster for
        ``-1`` (an entry without a spread stays as it is)."""
        if direction not in (1, -1):
            raise CommpressError(f"direction must be 1 or -1, got {direction!r}")
        moved = {k: SpeedTable({k: v}).scaled((1 + v.spread) ** direction).speeds[k]
                 for k, v in self.speeds.items()}
        return SpeedTable(moved, f"{self.source}, {'slow' if direction > 0 else 'fast'} end "
                          "of each spread", self.provenance)

    def for_threads(self, threads: int) -> SpeedTable:
        """This profile for a process that runs its codecs on ``threads`` threads: a profile
        measured with more threads (its provenance's ``threads``) has its throughputs divided
        by the ratio (the work spreads over the threads; per-call costs do not), so a CPU
        profile measured on 16 threads describes a rank that gets one core. Unchanged when
        the profile records no thread count or was measured with no more threads."""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise CommpressError(f"threads must be an int >= 1, got {threads!r}")
        measured = self.provenance.get("threads")
        if isinstance(measured, bool) or not isinstance(measured, int) or measured <= threads:
            return self
        return self.scaled(measured / threads, fixed_costs=False)

    def merged(self, other: SpeedTable) -> SpeedTable:
        """This table with ``other``'s entries on top."""
        return SpeedTable({**self.speeds, **other.speeds}, f"{other.source}; else {self.source}",
                          other.provenance or self.provenance)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": PROFILE_FORMAT if self.provenance else "commpress-codec-speeds/1",
            "source": self.source,
        }
        if self.provenance:
            out["provenance"] = dict(self.provenance)
        out["speeds"] = {k: v.to_dict() for k, v in self.speeds.items()}
        return out

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, default=_json_float)
        Path(path).write_text(text + "\n")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SpeedTable:
        if data.get("format") not in SPEED_FORMATS or "speeds" not in data:
            raise CommpressError(
                "not a codec speed table: expected {'format': 'commpress-device-profile/1' or "
                "'commpress-codec-speeds/1', 'speeds': {...}} as written by `commpress bench "
                "codecs --profile` or `commpress predict --calibrate-codecs`"
            )
        speeds = {}
        for key, entry in data["speeds"].items():
            with error_context(f"codec speed entry {key!r}"):
                try:
                    speeds[key] = CodecSpeed.from_dict(entry)
                except (KeyError, TypeError, ValueError) as exc:
                    if isinstance(exc, CommpressError):
                        raise
                    raise CommpressError(f"bad codec speed entry {key!r}: {exc!r}") from exc
        return cls(speeds, str(data.get("source", "file")), dict(data.get("provenance") or {}))

    @classmethod
    def load(cls, path: str | Path) -> SpeedTable:
        """A stored table, with the built-in entries under it for codecs it does not list."""
        data = read_json(path, f"codec speed table {path}")
        table = cls.from_dict(data)
        device = "cpu" if str(table.provenance.get("device", "")).startswith("cpu") else "gpu"
        return cls.builtin(device).merged(
            SpeedTable(table.speeds, f"{table.source} ({path})", table.provenance))


def _json_float(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    raise TypeError(f"not JSON serialisable: {value!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (allocations, kernel compilation)
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _min_time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Fastest of ``repeats`` timed runs after a warm-up."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate_speeds(
    specs: Sequence[str | Codec],
    *,
    device: str | torch.device = "cpu",
    small: int = 1 << 10,
    large: int = 1 << 20,
    repeats: int = 5,
    progress: bool = False,
) -> SpeedTable:
    """Measure ``c0`` and throughputs of ``specs`` on ``device`` (a micro-benchmark).

    Algorithm, per codec:

    1. Build square-ish float32 matrices of about ``small`` and ``large`` elements on
       ``device`` (matrices, so shape-aware codecs such as PowerSGD compress them).
    2. Time ``encode`` and ``decode`` of each (median of ``repeats`` runs after a warm-up,
       synchronising the device around each run).
    3. ``c0`` is the smaller of the small-tensor encode and decode times; each throughput is
       ``large / t_large`` (so ``max(c0, n / throughput)`` reproduces both measurements when
       the small size is overhead-bound).

    Tuning: ``large`` should be the size of your gradient buckets' tensors or at least a few
    million elements on a GPU, so that launch overheads do not hide the throughput; more
    ``repeats`` on a busy machine.
    """
    dev = usable_device(device, "device")
    speeds: dict[str, CodecSpeed] = {}
    iterator: Any = list(specs)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc="calibrating codecs", unit="codec")
    for spec in iterator:
        codec = get_codec(spec)
        with error_context(f"calibrating {spec_key(codec)}"):
            timings = {}
            for label, n in (("small", small), ("large", large)):
                rows = max(1, int(math.sqrt(n)))
                x = torch.randn(rows, max(1, n // rows), generator=torch.Generator().manual_seed(0))
                x = x.to(dev)
                ctx = CodecContext()
                payload = codec.encode(x, ctx)
                t_enc = _median_time(functools.partial(codec.encode, x, ctx), dev, repeats)
                t_dec = _median_time(functools.partial(codec.decode, payload, ctx), dev, repeats)
                timings[label] = (x.numel(), t_enc, t_dec)
            n_large, enc_l, dec_l = timings["large"]
            _, enc_s, dec_s = timings["small"]
            c0 = min(enc_s, dec_s)
            speeds[spec_key(codec)] = CodecSpeed(
                c0, n_large / max(enc_l, 1e-12), n_large / max(dec_l, 1e-12)
            )
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type} ({cpu_name()})"
    source = f"calibrated on {name}, {time.strftime('%Y-%m-%d')}, sizes {small}/{large}"
    return SpeedTable(speeds, source)


def _drive_protocol(codec: Codec, x: torch.Tensor, ctx: CodecContext, world_size: int) -> Any:
    """Run ``codec.reduce`` for one rank, answering every round as if the other ranks had sent
    the same thing (all-reduce: the request's tensors; all-gather: ``world_size`` copies of
    the payload). Returns the protocol's result; all its codec work is done on this thread."""
    return _drive_protocol_gen(codec.reduce(x, ctx), world_size)


def _drive_protocol_gen(gen: Any, world_size: int) -> Any:
    """Drive a reduction protocol generator as :func:`_drive_protocol` does."""
    codec_id = "protocol"
    try:
        req: Any = next(gen)
        while True:
            if isinstance(req, AllReduce):
                reply: Any = {k: v.clone() for k, v in req.tensors.items()}
            elif isinstance(req, AllGather):
                reply = [req.payload] * world_size
            else:
                raise CommpressError(f"{codec_id} yielded {type(req).__name__}")
            req = gen.send(reply)
    except StopIteration as stop:
        return stop.value


def calibrate_protocol_speeds(
    specs: Sequence[str | Codec],
    *,
    world_size: int = 2,
    matrix_shapes: tuple[tuple[int, ...], tuple[int, ...]] = ((128, 128), (512, 128)),
    flat_sizes: tuple[int, int] = (1 << 13, 1 << 19),
    feedback: bool = True,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    statistic: str = "median",
) -> SpeedTable:
    """Measure what one rank's codec work costs inside a real reduction (a micro-benchmark).

    :func:`calibrate_speeds` times ``encode`` and ``decode`` alone; a data-parallel step also
    runs a multi-round codec's work between its rounds, decodes every gathered payload, and
    with error feedback decodes its own contribution and updates the residual. This times the
    whole codec path of one tensor, without the network:

    1. For each codec, a small and a large tensor (``matrix_shapes``; element-wise casts, which
       the DDP hook sends as one flat bucket, use 1-D tensors of ``flat_sizes``).
    2. Time ``T``: the DDP hook's per-tensor path
       (:meth:`~commpress.collectives.policy.CompressionState.reduce`: compensation by the
       error-feedback residual when ``feedback`` and the codec is lossy and not a cast, the
       codec's protocol, the residual update) for rank 0 of ``world_size``, with the rounds
       answered locally (all-reduce: its own tensors; all-gather: ``world_size`` copies of its
       payload); the median (``statistic="median"``) or the fastest (``"min"``) of
       ``repeats`` after a warm-up.
    3. Split ``T`` into encode (before the exchange) and decode (after): a single-round codec's
       decode is its measured ``decode`` time, once per payload it decodes (``world_size`` for
       an all-gather); a multi-round codec's work is split in halves.
    4. ``c0`` and the throughputs come from the small and large sizes as in
       :func:`calibrate_speeds`.

    Tuning: the median includes what the machine's other work costs the codec at the time; on
    a shared, noisy machine take ``"min"`` (every disturbance only adds time) and account for
    contention separately. Use the training run's threads per process; ``matrix_shapes``
    should bracket the model's weight matrices.
    """
    if statistic not in ("median", "min"):
        raise CommpressError(f"statistic must be 'median' or 'min', got {statistic!r}")
    timer = _median_time if statistic == "median" else _min_time
    dev = torch.device(device)
    speeds: dict[str, CodecSpeed] = {}
    for spec in specs:
        codec = get_codec(spec)
        casts = codec.elementwise
        sizes: list[tuple[int, ...]] = (
            [(flat_sizes[0],), (flat_sizes[1],)] if casts else [tuple(s) for s in matrix_shapes]
        )
        with error_context(f"calibrating the protocol of {spec_key(codec)}"):
            measured = []
            for shape in sizes:
                x = _sample(shape).to(dev)
                # The DDP hook's per-tensor path: plan, compensation, the codec's protocol,
                # residual update (automatic error feedback unless feedback=False).
                state = CompressionState(codec, error_feedback=None if feedback else False)
                ctx = CodecContext(rank=0, world_size=world_size, key="calibrate")

                def run(x: torch.Tensor = x, state: CompressionState = state) -> None:
                    _drive_protocol_gen(state.reduce("calibrate", x, rank=0,
                                                     world_size=world_size), world_size)

                total = timer(run, dev, repeats)
                decodes = 0.0
                if not codec.multi_round:
                    payload = codec.encode(x, CodecContext(rank=0, world_size=world_size))
                    one = timer(functools.partial(codec.decode, payload, ctx), dev, repeats)
                    k = 1 if codec.summable else world_size
                    decodes = min(k * one, 0.9 * total)
                    measured.append((math.prod(shape), total - decodes, decodes / k))
                else:
                    measured.append((math.prod(shape), total / 2, total / 2))
            (_, enc_s, dec_s), (n_l, enc_l, dec_l) = measured
            speeds[spec_key(codec)] = CodecSpeed(
                max(0.0, min(enc_s, dec_s)), n_l / max(enc_l, 1e-12), n_l / max(dec_l, 1e-12)
            )
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{dev.type} ({cpu_name()})"
    source = (f"protocol calibrated on {name}, {time.strftime('%Y-%m-%d')}, world size "
              f"{world_size}, {torch.get_num_threads()} thread(s)")
    return SpeedTable(speeds, source)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


# ---------------------------------------------------------------------------- wire bytes
@dataclass(frozen=True, slots=True)
class Round:
    """One exchange: ``kind`` is ``"allreduce"`` or ``"allgather"``; ``nbytes`` is what one
    rank contributes (for an all-gather, its payload)."""

    kind: str
    nbytes: float


@dataclass(frozen=True, slots=True)
class WireProfile:
    """Rounds of one tensor's reduction, for one world size."""

    numel: int
    rounds: tuple[Round, ...]

    @property
    def nbytes(self) -> float:
        return sum(r.nbytes for r in self.rounds)

    @property
    def bits_per_coordinate(self) -> float:
        return 8.0 * self.nbytes / self.numel if self.numel else 0.0

    @property
    def gathers(self) -> bool:
        return any(r.kind == "allgather" for r in self.rounds)


def _record_rounds(codec: Codec, x: torch.Tensor, world_size: int) -> tuple[Round, ...]:
    """Rounds rank 0 asks for, answered as if the other ranks contributed nothing."""
    ctx = CodecContext(rank=0, world_size=world_size, key="perfmodel", state={})
    if not codec.multi_round:
        payload = codec.encode(x, ctx)
        if codec.summable:
            summed = AllReduce(tensors=dict(payload.parts), **codec.sum_lanes(payload))
            return (Round("allreduce", float(summed.wire_bytes)),)
        return (Round("allgather", float(payload.nbytes)),)
    gen = codec.reduce(x, ctx)
    rounds: list[Round] = []
    try:
        req: Any = next(gen)
        while True:
            if len(rounds) >= 64:
                raise CommpressError(f"{codec.codec_id} asked for more than 64 rounds")
            if isinstance(req, AllReduce):
                rounds.append(Round("allreduce", float(req.wire_bytes)))
                reply: Any = {k: v.clone() for k, v in req.tensors.items()}
            elif isinstance(req, AllGather):
                rounds.append(Round("allgather", float(req.wire_bytes)))
                reply = [req.payload] * world_size
            else:
                raise CommpressError(f"{codec.codec_id} yielded {type(req).__name__}")
            req = gen.send(reply)
    except StopIteration:
        pass
    return tuple(rounds)


def _sample_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` scaled in every dimension to at most :data:`SAMPLE_MAX` elements, keeping its
    aspect; dimensions of 64 or more are rounded down to multiples of 64 (a 1-D tensor to a
    multiple of 4096) so that codecs working in blocks pad the sample no more than the
    (large) real tensor."""
    n = math.prod(shape)
    f = (SAMPLE_MAX / n) ** (1.0 / len(shape))
    if len(shape) == 1:
        return (max(4096, int(shape[0] * f) // 4096 * 4096),)
    dims = [int(d * f) // 64 * 64 if d * f >= 64 else max(1, round(d * f)) for d in shape]
    while math.prod(dims) > SAMPLE_MAX:  # rounding small dimensions up can overshoot
        i = max(range(len(dims)), key=lambda j: dims[j])
        dims[i] = max(1, dims[i] - (64 if dims[i] > 64 else 1))
    return tuple(dims)


_PROFILES: dict[tuple[str, tuple[int, ...], int, torch.dtype], WireProfile] = {}


def _sample(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def wire_profile(
    codec: Codec, shape: Sequence[int], world_size: int = 2, dtype: torch.dtype = torch.float32
) -> WireProfile:
    """Rounds and bytes of reducing a tensor of ``shape`` and ``dtype`` among ``world_size``
    ranks (cached per codec configuration, shape, world size and dtype).

    From the codec's size formula (:meth:`~commpress.codecs.base.Codec.wire_rounds`): exact
    for every shape, nothing is sampled. A codec without one (``netzip``, whose size depends
    on the values, or a codec of your own) is measured on a Gaussian tensor: of the real shape
    up to :data:`SAMPLE_MAX` elements, else of the shape scaled down (same aspect,
    block-aligned dimensions, see :func:`_sample_shape`), and each round's bytes are scaled by
    the element counts: the sample's compression ratio applied to the whole tensor.
    """
    shape = tuple(int(d) for d in shape) or (1,)
    world_size = max(1, int(world_size))
    key = (codec.fingerprint() + codec.codec_id, shape, world_size, dtype)
    if key in _PROFILES:
        return _PROFILES[key]
    numel = math.prod(shape)
    with error_context(f"wire bytes of {spec_key(codec)} for shape {shape}"):
        rounds = codec.wire_rounds(shape, dtype, world_size=world_size) if numel else ()
        if rounds is not None:
            prof = WireProfile(numel, tuple(Round(k, float(b)) for k, b in rounds))
        else:
            sample = shape if numel <= SAMPLE_MAX else _sample_shape(shape)
            scale = numel / math.prod(sample)
            measured = _record_rounds(codec, _sample(sample).to(dtype), world_size)
            prof = WireProfile(numel, tuple(Round(r.kind, r.nbytes * scale) for r in measured))
    if len(_PROFILES) > 65536:
        _PROFILES.clear()
    _PROFILES[key] = prof
    return prof


# ---------------------------------------------------------------------------- offload
@dataclass(frozen=True, slots=True)
class Offload:
    """A device that runs codec work off the GPU (SqueezeNIC's FPGA NIC, a DPU, a CPU thread).

    Its compress time is ``max(latency, dense_bytes / bandwidth)`` and its decompress time
    ``max(latency, dense_bytes / decompress_bandwidth)``: both rates count the
    **uncompressed** bytes (what is compressed, what is restored), as codec speeds count
    elements of the uncompressed tensor. ``bandwidth`` is the compress rate (SqueezeNIC
    compresses at line rate, so at least the intra-node rate); ``decompress_bandwidth``
    defaults to it. ``latency`` is the pipeline depth of one call.
    """

    bandwidth: float
    latency: float = 0.0
    decompress_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for label, v in (("bandwidth", self.bandwidth),
                         ("decompress bandwidth", self.decompress_rate)):
            if not v > 0:
                raise CommpressError(f"offload {label} must be > 0 bytes/s, got {v!r}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise CommpressError(f"offload latency must be finite and >= 0, got {self.latency!r}")

    @property
    def decompress_rate(self) -> float:
        """Uncompressed bytes restored per second."""
        return self.bandwidth if self.decompress_bandwidth is None else self.decompress_bandwidth

    def time(self, nbytes: float) -> float:
        """Compress time of ``nbytes`` uncompressed bytes."""
        return 0.0 if nbytes <= 0 else max(self.latency, nbytes / self.bandwidth)

    def decompress_time(self, nbytes: float) -> float:
        """Decompress time restoring ``nbytes`` uncompressed bytes."""
        return 0.0 if nbytes <= 0 else max(self.latency, nbytes / self.decompress_rate)


# ---------------------------------------------------------------------------- exchange plans
@dataclass(frozen=True)
class ExchangeConfig:
    """Everything about *how* tensors are exchanged, besides the codec.

    Attributes:
        cluster: topology and links.
        strategy: one of :data:`STRATEGIES` (as in :func:`commpress.all_reduce`):
            ``auto`` the codec's own protocol (summable: all-reduce of payload parts; otherwise
            all-gather of payloads; multi-round: its rounds); ``allreduce`` the same, refused
            for non-summable codecs; ``allgather`` always gather payloads; ``ring`` a ring with
            the codec in the wire (re-encoding at every reduce-scatter hop); ``hierarchical``
            SqueezeNIC's approach 1 (intra-node reduce-scatter uncompressed, compressed
            exchange of shards between nodes, intra-node all-gather);
            ``hierarchical-compress-first`` approach 2 (the intra-node reduce-scatter is a ring
            with the codec in the wire).
        algorithm: all-reduce algorithm for payload all-reduces: ``ring``, ``tree``, ``rhd``.
        speeds: codec speed table.
        offload: run codec work on this device instead of the GPU (``None``: on the GPU).
        grad_bytes: bytes per gradient element before compression (4 for float32).
        collective_overhead_s: fixed software cost added to every collective call (a
            calibrated platform constant; 0 in the pure alpha-beta model).
        codec_time_scale: multiplier on every codec time (a calibrated platform constant).
    """

    cluster: Cluster
    strategy: str = "auto"
    algorithm: str = "ring"
    speeds: SpeedTable = field(default_factory=SpeedTable.builtin)
    offload: Offload | None = None
    grad_bytes: int = 4
    collective_overhead_s: float = 0.0
    codec_time_scale: float = 1.0

    def __post_init__(self) -> None:
        get_strategy(self.strategy)  # an unknown one is refused with the accepted ones
        if self.algorithm not in coll.ALLREDUCE_ALGORITHMS:
            raise CommpressError(
                f"unknown all-reduce algorithm {self.algorithm!r}; accepted: "
                f"{', '.join(coll.ALLREDUCE_ALGORITHMS)}"
            )
        if self.grad_bytes not in (2, 4, 8):
            raise CommpressError(f"grad_bytes must be 2, 4 or 8, got {self.grad_bytes!r}")

    @property
    def grad_dtype(self) -> torch.dtype:
        """The gradients' dtype for wire sizes: float32, float64, or bfloat16 for 2 bytes."""
        return GRAD_DTYPES[self.grad_bytes]


class _Planner:
    """Turns one tensor's reduction into segments for :func:`simulate_step`."""

    def __init__(self, codec: Codec, cfg: ExchangeConfig) -> None:
        self.codec = codec
        self.cfg = cfg
        self.speed = cfg.speeds.lookup(codec)
        self.where = "offload" if cfg.offload is not None else "gpu"

    # codec times ------------------------------------------------------------
    def enc(self, numel: float, shape: tuple[int, ...] | None = None) -> float:
        if self.cfg.offload is not None:
            return self.cfg.offload.time(numel * self.cfg.grad_bytes)
        return self.gpu_enc(numel, shape)

    def dec(self, numel: float, shape: tuple[int, ...] | None = None) -> float:
        if self.cfg.offload is not None:
            return self.cfg.offload.decompress_time(numel * self.cfg.grad_bytes)
        return self.gpu_dec(numel, shape)

    def _speed_for(self, shape: tuple[int, ...] | None) -> CodecSpeed:
        """The codec's speed, or the identity's for a tensor it sends exactly (PowerSGD's
        vectors and small matrices: a copy, not a factorisation)."""
        plan = getattr(self.codec, "plan", None)
        if shape and callable(plan) and plan(shape) is None:
            return self.cfg.speeds.lookup(get_codec("identity"))
        return self.speed

    def gpu_enc(self, numel: float, shape: tuple[int, ...] | None = None) -> float:
        flops = codec_flops(self.codec, shape)[0] if shape else 0.0
        orth = codec_orth_flops(self.codec, shape)
        speed = self._speed_for(shape)
        t = speed.encode_time(numel, flops, orth) + self.rotation_time(numel, speed)
        return t * self.cfg.codec_time_scale

    def gpu_dec(self, numel: float, shape: tuple[int, ...] | None = None) -> float:
        flops = codec_flops(self.codec, shape)[1] if shape else 0.0
        speed = self._speed_for(shape)
        t = speed.decode_time(numel, flops) + self.rotation_time(numel, speed)
        return t * self.cfg.codec_time_scale

    def rotation_time(self, numel: float, speed: CodecSpeed) -> float:
        """THC's rotation of blocks larger than the measured kernel's (``block_log2="full"``:
        the whole tensor, padded to a power of two), on top of the measured speed; the same
        for the encode's rotation and the decode's inverse (:class:`RotationCost`)."""
        if not isinstance(self.codec, Thc) or numel < 1:
            return 0.0
        lay = self.codec.layout(int(numel))
        cost = speed.rotation or code_rotation(self.cfg.speeds)
        return cost.time(lay.padded, lay.block)

    def gathered_sum(self, numel: int, ranks: int) -> float:
        """Summing ``ranks`` all-gathered payloads of a ``numel``-element tensor, as
        :meth:`~commpress.codecs.base.Codec.sum_decoded` does: a sparse codec
        (:func:`sparse_entries`) zeroes the accumulator and scatter-adds ``K`` entries per
        payload (one decode's time plus ``ranks`` scatter-adds at the profile's rate, when
        the profile measured one); any other codec decodes every payload densely."""
        entries = sparse_entries(self.codec, int(numel))
        if self.cfg.offload is None and entries is not None and self.speed.accumulates:
            return self.dec(numel) + ranks * self.speed.accumulate_time(entries) * (
                self.cfg.codec_time_scale)
        return ranks * self.dec(numel)

    # pieces -----------------------------------------------------------------
    @staticmethod
    def _add(segs: list[Segment], resource: str, seconds: float, kind: str, label: str,
             nbytes: float = 0.0) -> None:
        if seconds > 0:
            segs.append(Segment(resource, seconds, kind, label, nbytes))

    def collective(self, seconds: float) -> float:
        return seconds + self.cfg.collective_overhead_s

    def protocol(
        self, shape: tuple[int, ...], ranks: int, link: coll.Link, share: int = 1,
        label: str = "",
    ) -> list[Segment]:
        """The codec's own protocol among ``ranks`` over ``link``; ``share`` ranks send
        through the same link concurrently (their bytes add up on it)."""
        segs: list[Segment] = []
        numel = math.prod(shape)
        prof = wire_profile(self.codec, shape, ranks, self.cfg.grad_dtype)
        self._add(segs, self.where, self.enc(numel, shape), "codec", f"{label}encode")
        if ranks > 1:
            for k, r in enumerate(prof.rounds):
                if r.kind == "allreduce":
                    t = coll.allreduce(r.nbytes * share, ranks, link, self.cfg.algorithm)
                else:
                    t = coll.allgather(r.nbytes * share, ranks, link)
                moved = coll.link_bytes(r.kind, r.nbytes * share, ranks, self.cfg.algorithm)
                self._add(segs, "net", self.collective(t), "comm", f"{label}{r.kind}[{k}]",
                          moved)
        decode = self.gathered_sum(numel, ranks) if prof.gathers else self.dec(numel, shape)
        self._add(segs, self.where, decode, "codec", f"{label}decode")
        return segs

    def gather(self, shape: tuple[int, ...], ranks: int, link: coll.Link) -> list[Segment]:
        segs: list[Segment] = []
        numel = math.prod(shape)
        payload = wire_profile(self.codec, shape, 1, self.cfg.grad_dtype).nbytes
        self._add(segs, self.where, self.enc(numel, shape), "codec", "encode")
        if ranks > 1:
            t = coll.allgather(payload, ranks, link)
            self._add(segs, "net", self.collective(t), "comm", "allgather",
                      coll.link_bytes("allgather", payload, ranks))
        self._add(segs, self.where, self.gathered_sum(numel, ranks), "codec", "decode")
        return segs

    def ring(self, numel: int, ranks: int, link: coll.Link) -> list[Segment]:
        """All-reduce ring with the codec in the wire; codec work sits on the communicator.

        As :func:`commpress.collectives.strategies.ring_task` runs it: ``2 (n-1)`` hops, each
        a point-to-point exchange of one chunk's payload (a software ring pays the per-call
        overhead at every hop; codecs whose payload size varies send a size header first,
        one more message latency per hop); ``n`` encodes (``n-1`` partial sums and the final
        chunk) and ``2n-1`` decodes (``n-1`` partial sums, then the ``n`` gathered chunks).
        """
        segs: list[Segment] = []
        if ranks == 1:
            self._add(segs, self.where, self.enc(numel) + self.dec(numel), "codec", "encode")
            return segs
        chunk = -(-numel // ranks)
        q = wire_profile(self.codec, (chunk,), 1, self.cfg.grad_dtype).nbytes
        n_hops = 2 * (ranks - 1)
        hops = n_hops * link.time(q)
        if self.cfg.offload is None:
            hops += (n_hops - 1) * self.cfg.collective_overhead_s
            if not self.codec.fixed_size:
                hops += n_hops * link.latency
        # Software rings decode the n gathered chunks after the all-gather (2n-1 decodes on the
        # path); an offload device decodes them as they stream by (n decodes).
        decodes = ranks if self.cfg.offload is not None else 2 * ranks - 1
        codec_s = ranks * self.enc(chunk) + decodes * self.dec(chunk)
        self._add(segs, "net", self.collective(hops), "comm", "ring", n_hops * q)
        self._add(segs, "net", codec_s, "codec", "ring codec")
        return segs

    def hierarchical(self, shape: tuple[int, ...], compress_first: bool) -> list[Segment]:
        """As :func:`commpress.collectives.strategies.hierarchical_task` runs it, on ``m``
        ranks per node and ``n`` nodes: an uncompressed intra-node reduce-scatter (a ring
        with the codec in the wire for ``compress_first``); the codec's own protocol on one
        shard among the ``n`` nodes, the ``m`` local ranks sharing the node's link (a matrix
        is sharded by whole rows, padded to a multiple of ``m`` rows, so low-rank codecs see
        ``ceil(rows/m) x cols``); an uncompressed intra-node all-gather."""
        cl = self.cfg.cluster
        m, n = cl.gpus_per_node, cl.nodes
        segs: list[Segment] = []
        numel = math.prod(shape)
        if len(shape) >= 2 and not compress_first:
            unit = math.prod(shape[1:])
            rows = -(-shape[0] // m)
            shard_shape: tuple[int, ...] = (rows, *shape[1:])
            shard = rows * unit
        else:
            shard = -(-numel // m)
            shard_shape = (shard,)
        gb = self.cfg.grad_bytes
        if m > 1:
            if compress_first:
                q = wire_profile(self.codec, (shard,), 1, self.cfg.grad_dtype).nbytes
                rs = coll.ring_reduce_scatter_codec(
                    m, cl.intra.time(q), self.gpu_enc(shard), self.gpu_dec(shard)
                )
                hop_part = (m - 1) * cl.intra.time(q)
                self._add(segs, "net", self.collective(hop_part), "comm", "intra reduce-scatter")
                self._add(segs, "net", rs - hop_part, "codec", "intra ring codec")
            else:
                rs = coll.ring_reduce_scatter(shard * m * gb, m, cl.intra)
                self._add(segs, "net", self.collective(rs), "comm", "intra reduce-scatter")
        if n > 1:
            if self.cfg.offload is not None and not self.codec.multi_round:
                # SqueezeNIC: the NIC compresses each hop of the inter-node ring at line rate;
                # per hop it carries the node's chunk of the whole vector.
                chunk = -(-numel // n)
                q = wire_profile(self.codec, (chunk,), 1, self.cfg.grad_dtype).nbytes
                hop = cl.inter.time(q)
                t = coll.ring_allreduce_codec(n, hop, self.enc(chunk), self.dec(chunk))
                comm = 2 * (n - 1) * hop
                self._add(segs, "net", self.collective(comm), "comm", "inter ring")
                self._add(segs, "net", t - comm, "codec", "inter ring codec (offload)")
            else:
                segs.extend(self.protocol(shard_shape, n, cl.inter, share=m, label="inter "))
        elif m == 1:
            self._add(segs, self.where, self.enc(numel) + self.dec(numel), "codec", "encode")
        if m > 1:
            ag = coll.ring_allgather(shard * m * gb, m, cl.intra)
            self._add(segs, "net", self.collective(ag), "comm", "intra all-gather")
        return segs

    def tensor(self, shape: tuple[int, ...]) -> list[Segment]:
        cfg, codec = self.cfg, self.codec
        numel = math.prod(shape) if shape else 1
        if numel == 0:
            return []
        ranks = cfg.cluster.world_size
        link = cfg.cluster.bottleneck
        strategy = get_strategy(cfg.strategy)
        why = strategy.refusal(codec)
        if why is not None:
            raise CommpressError(why)
        # The strategy's cost description (data from the registry), priced here.
        cost = strategy.cost
        if cost.pattern == "protocol":
            return self.protocol(shape, ranks, link)
        if cost.pattern == "allgather":
            return self.gather(shape, ranks, link)
        if cost.pattern == "ring":
            return self.ring(numel, ranks, link)
        return self.hierarchical(shape if shape else (1,), cost.compress_first)

    def batched(
        self, shapes: Sequence[tuple[int, ...]], *, fixed_per_tensor: bool = False
    ) -> list[Segment]:
        """A bucket reduced as PyTorch's PowerSGD DDP hook (``powerSGD_hook``) does it: every
        tensor is encoded on its own (each pays its per-element pass and its matrix products)
        but the bucket's tensors are batched, so the codec's fixed cost is paid once per
        bucket for the encode and once for the decode, and round ``k`` of every tensor is one
        all-reduce of their summed payloads (the tensors the codec sends exactly join the
        first round). Only the codec's own protocol (``auto``/``allreduce``) on the GPU.

        ``fixed_per_tensor``: every tensor's codec work costs what it costs reduced on its own
        (commpress's DDP hook, whose lockstep protocols are one codec call per tensor: each
        pays its own speed's fixed cost, the identity's for a tensor the codec sends exactly;
        only the collectives are merged)."""
        cfg = self.cfg
        if cfg.offload is not None or get_strategy(cfg.strategy).cost.pattern != "protocol":
            raise CommpressError("granularity 'batched' models the codec's own protocol on "
                                 "the GPU; use 'parameter' with offload or other strategies")
        ranks = cfg.cluster.world_size
        link = cfg.cluster.bottleneck
        enc = dec = 0.0
        rounds: dict[int, list[Any]] = {}
        for shape in shapes:
            numel = math.prod(shape)
            if numel == 0:
                continue
            speed = self._speed_for(shape)
            f_enc, f_dec = codec_flops(self.codec, shape)
            orth = codec_orth_flops(self.codec, shape)
            if fixed_per_tensor:
                enc += speed.encode_time(numel, f_enc, orth)
                dec += speed.decode_time(numel, f_dec)
            else:
                enc += speed.encode_work(numel, f_enc, orth)
                dec += speed.decode_work(numel, f_dec)
            rotation = self.rotation_time(numel, speed)  # THC's full rotation, each way
            enc += rotation
            dec += rotation
            if ranks > 1:
                prof = wire_profile(self.codec, shape, ranks, cfg.grad_dtype)
                if prof.gathers:
                    raise CommpressError(f"granularity 'batched' needs all-reduce rounds; "
                                         f"{spec_key(self.codec)} all-gathers")
                for k, r in enumerate(prof.rounds):
                    rounds.setdefault(k, [r.kind, 0.0])[1] += r.nbytes
        segs: list[Segment] = []
        scale = cfg.codec_time_scale
        c0_enc = c0_dec = 0.0
        if not fixed_per_tensor:  # one batched codec call for the bucket
            speed = self.speed
            c0_enc = speed.overhead_s
            c0_dec = (speed.overhead_s if speed.decode_overhead_s is None
                      else speed.decode_overhead_s)
        self._add(segs, "gpu", (c0_enc + enc) * scale, "codec", "encode")
        for k in sorted(rounds):
            kind, nbytes = rounds[k]
            t = coll.allreduce(nbytes, ranks, link, cfg.algorithm)
            self._add(segs, "net", self.collective(t), "comm", f"{kind}[{k}]",
                      coll.link_bytes(kind, nbytes, ranks, cfg.algorithm))
        self._add(segs, "gpu", (c0_dec + dec) * scale, "codec", "decode")
        return segs

    def local_roundtrip(self, numel: int) -> list[Segment]:
        """``decode(encode(x))`` of the whole tensor: the error-feedback residual's reference
        that the ring and hierarchical strategies compute besides the exchange."""
        segs: list[Segment] = []
        self._add(segs, self.where, self.enc(numel) + self.dec(numel), "codec", "local")
        return segs


def sparse_entries(codec: Codec, numel: int) -> float | None:
    """Entries one payload of a sparse codec carries for a ``numel``-element tensor (``K``:
    its ``count``, or ``ratio * numel`` for a varying count), ``None`` for codecs whose sum
    of gathered payloads is not a scatter-add (see ``Codec._add_decoded``)."""
    if type(codec)._add_decoded is Codec._add_decoded:
        return None
    count = getattr(codec, "count", None)
    if callable(count):
        return float(count(int(numel)))
    ratio = getattr(codec, "ratio", None)
    return float(math.ceil(ratio * numel)) if isinstance(ratio, float) else None


def codec_flops(codec: Codec, shape: Sequence[int] | None) -> tuple[float, float]:
    """Matrix-product flops of encoding and decoding a tensor of ``shape``: PowerSGD's
    ``P = M Q`` and ``Q = M^T P`` (``4 n m r``, plus ``power_iterations - 1`` more pairs) and
    ``P Q^T`` (``2 n m r``); ``(0, 0)`` for codecs without products or tensors sent exactly."""
    plan = getattr(codec, "plan", None)
    if not shape or not callable(plan):
        return 0.0, 0.0
    planned = plan(tuple(int(d) for d in shape))
    if planned is None:
        return 0.0, 0.0
    n, m, r = planned
    iters = int(getattr(codec, "power_iterations", 1) or 1)
    return 4.0 * n * m * r * iters, 2.0 * n * m * r


def codec_orth_flops(codec: Codec, shape: Sequence[int] | None) -> float:
    """Flops of the orthogonalisations in encoding a tensor of ``shape``: PowerSGD
    orthonormalises its ``n x r`` factor ``P`` once per power iteration, ``2 n r^2`` flops
    each (Gram-Schmidt: every column projected out of the later ones; Householder QR has the
    same leading term). Quadratic in the rank where the products are linear: at rank 64 on a
    ``4096 x 4096`` matrix it is 1/32 of the products' flops, but it runs column by column
    far below the matrix-product rate (:attr:`CodecSpeed.orth_flops`). 0 for codecs without
    one and for tensors sent exactly."""
    plan = getattr(codec, "plan", None)
    if not shape or not callable(plan):
        return 0.0
    planned = plan(tuple(int(d) for d in shape))
    if planned is None:
        return 0.0
    n, _, r = planned
    iters = int(getattr(codec, "power_iterations", 1) or 1)
    return 2.0 * n * r * r * iters


def hook_batches(codec: Codec, shapes: Sequence[Sequence[int]], cfg: ExchangeConfig) -> bool:
    """Whether commpress's DDP hook (``register(batch_rounds=True)``, its default) reduces a
    bucket's tensors of ``shapes`` sent with ``codec`` in lockstep, round ``k`` of all of them
    one all-reduce (:mod:`commpress.collectives.batched`), as granularity ``"batched"``
    models: the codec's own protocol (a strategy whose cost pattern is ``"protocol"``), no
    offload, more than one tensor, a codec that is not an element-wise cast (those go as one
    flat tensor anyway) and whose rounds are all all-reduces (the hook issues all-gathers of
    a round together, but does not merge them: modelled one tensor at a time)."""
    if codec.elementwise or cfg.offload is not None or len(shapes) < 2:
        return False
    if get_strategy(cfg.strategy).cost.pattern != "protocol":
        return False
    ranks = cfg.cluster.world_size
    return not any(wire_profile(codec, s, ranks, cfg.grad_dtype).gathers for s in shapes)


def exchange_segments(
    codec: Codec | str,
    shapes: Sequence[Sequence[int]],
    cfg: ExchangeConfig,
    *,
    granularity: str = "parameter",
) -> list[Segment]:
    """Segments of one DDP bucket holding tensors of ``shapes``, reduced with ``codec``.

    With ``granularity="bucket"``, or for element-wise casts (``codec.elementwise``),
    the bucket is one flat tensor (one collective per round); with ``"parameter"`` every
    tensor is reduced on its own, one after the other (as commpress's DDP hook does), so
    shape-aware codecs see matrices and every tensor pays its own latencies; with
    ``"batched"`` every tensor is encoded on its own but the bucket pays one fixed codec cost
    and one collective per round (PyTorch's PowerSGD hook, :meth:`_Planner.batched`);
    ``"hook"`` is what commpress's DDP hook does: where it batches the bucket's rounds
    (:func:`hook_batches`) ``"batched"``'s collectives with ``"parameter"``'s codec work (one
    codec call per tensor, each costed as reduced on its own), ``"parameter"`` elsewhere.
    """
    c = model_codec(codec)
    if granularity not in GRANULARITIES:
        raise CommpressError(f"granularity must be one of {', '.join(GRANULARITIES)}, got "
                             f"{granularity!r}")
    planner = _Planner(c, cfg)
    norm = [tuple(int(d) for d in s) for s in shapes]
    if granularity == "hook":
        if hook_batches(c, norm, cfg):
            return planner.batched(norm, fixed_per_tensor=True)
        granularity = "parameter"
    if granularity == "batched" and not c.elementwise:
        return planner.batched(norm)
    if granularity == "bucket" or c.elementwise:
        total = sum(math.prod(s) for s in norm)
        return planner.tensor((total,)) if total else []
    segs: list[Segment] = []
    for s in norm:
        segs.extend(planner.tensor(s))
    return segs


def local_roundtrip_segments(codec: Codec | str, numel: int, cfg: ExchangeConfig) -> list[Segment]:
    """The codec work of one ``decode(encode(x))`` of ``numel`` elements (what the ring and
    hierarchical strategies add per tensor when error feedback needs the local contribution,
    which the codec's own protocol yields for free)."""
    return _Planner(model_codec(codec), cfg).local_roundtrip(numel) if numel else []


def exchange_wire_bytes(codec: Codec | str, shape: Sequence[int], cluster: Cluster,
                        strategy: str = "auto", *, dtype: torch.dtype = torch.float32) -> float:
    """Payload bytes one rank sends to exchange a tensor of ``shape`` by ``strategy``
    (every round and hop; uncompressed intra-node traffic of the hierarchical strategies not
    counted): the codec's rounds for ``auto``/``allreduce``, one payload for ``allgather``,
    ``2 (n-1)`` chunk payloads for ``ring``, the shard's rounds among the nodes for
    ``hierarchical`` (the intra-node ring's chunk payloads too with compress-first)."""
    c = model_codec(codec)
    dims = tuple(int(d) for d in shape)
    numel = math.prod(dims)
    n = cluster.world_size
    if numel == 0:
        return 0.0
    if strategy in ("auto", "allreduce"):
        return wire_profile(c, dims, n, dtype).nbytes
    if strategy == "allgather":
        return wire_profile(c, dims, 1, dtype).nbytes
    if strategy == "ring":
        if n == 1:
            return 0.0
        return 2 * (n - 1) * wire_profile(c, (-(-numel // n),), 1, dtype).nbytes
    m, nodes = cluster.gpus_per_node, cluster.nodes
    total = 0.0
    if strategy == "hierarchical-compress-first" and m > 1:
        total += (m - 1) * wire_profile(c, (-(-numel // m),), 1, dtype).nbytes
        shard_shape: tuple[int, ...] = (-(-numel // m),)
    elif len(dims) >= 2:
        shard_shape = (-(-dims[0] // m), *dims[1:])
    else:
        shard_shape = (-(-numel // m),)
    if nodes > 1:
        total += wire_profile(c, shard_shape, nodes, dtype).nbytes
    return total


# ---------------------------------------------------------------------------- accuracy
_NMSE: dict[str, float] = {}


def measure_nmse(
    codec: Codec | str, *, shape: tuple[int, int] = (256, 256), seed: int = 0
) -> float:
    """Quick error estimate: the worse NMSE of one worker's ``reduce`` on a Gaussian and on a
    heavy-tailed (Student-t, 2 dof) matrix of ``shape`` (cached per configuration).

    It is a proxy: real gradients have structure (low rank, outliers) that these samples lack,
    so PowerSGD looks worse here than on a real model. Pass a table to the advisor when you
    have measured errors (for example on tensors saved by ``commpress capture``).
    """

    c = model_codec(codec)
    if isinstance(c, RatioCodec):
        return 0.0  # a model-only pseudo-codec has no error model
    key = f"{spec_key(c)}|{shape}|{seed}"
    if key not in _NMSE:
        n = math.prod(shape)
        worst = 0.0
        with error_context(f"measuring the error of {spec_key(c)}"):
            for make in (gaussian, heavy_tailed):
                x = make(n, seed=seed).reshape(shape)
                out = single_worker(c, x).total
                worst = max(worst, nmse(out, x))
        _NMSE[key] = worst
    return _NMSE[key]


__all__ = [
    "BUILTIN_PROFILES",
    "BUTTERFLY_STAGE_COPIES",
    "FALLBACK_SPEED",
    "GRANULARITIES",
    "PROFILE_FORMAT",
    "SAMPLE_MAX",
    "STRATEGIES",
    "CodecSpeed",
    "ExchangeConfig",
    "Offload",
    "RotationCost",
    "Round",
    "SpeedTable",
    "WireProfile",
    "calibrate_protocol_speeds",
    "codec_flops",
    "code_rotation",
    "codec_orth_flops",
    "sparse_entries",
    "calibrate_speeds",
    "exchange_segments",
    "hook_batches",
    "exchange_wire_bytes",
    "local_roundtrip_segments",
    "measure_nmse",
    "spec_key",
    "wire_profile",
]
