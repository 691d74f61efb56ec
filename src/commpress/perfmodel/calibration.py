"""Fitting the platform constants to measured runs, and checking predictions against others.

The model's physics (alpha-beta costs, codec bytes, the overlap timeline) is fixed; what varies
between platforms is collected in :class:`~commpress.perfmodel.model.Platform`: the overlap
efficiency, a per-collective software overhead, how much of the described inter-node bandwidth
the transport achieves, and a scale on codec speed. Calibration and validation never use the
same runs:

1. :func:`split_half` sorts the measured setups by label and deals them alternately into a
   *fit* half and a *holdout* half, so both halves cover the whole grid.
2. :func:`fit_platform` chooses the constants that minimise the mean squared log-ratio
   ``mean((log(predicted / measured))^2)`` over the fit half (a relative error, so fast and
   slow setups count alike), by Nelder-Mead in unconstrained coordinates (logit for the
   efficiency, log for the others).
3. :func:`validate` predicts the holdout half with the fitted constants and reports the
   signed relative error of every setup, with the median and worst absolute errors.

:func:`calibrate_and_validate` does all three. Measurements come from real runs (``commpress
validate`` on the emulated cluster feeds :class:`Measurement` objects to it); the functions
know nothing about how they were taken.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from commpress.errors import CommpressError
from commpress.perfmodel.codec_costs import SpeedTable
from commpress.perfmodel.model import Platform, Setup
from commpress.report import render_table
from commpress.units import format_seconds

#: Constants :func:`fit_platform` fits by default.
FITTABLE: tuple[str, ...] = (
    "overlap_efficiency", "collective_overhead_s", "inter_bandwidth_scale", "codec_time_scale",
)
#: Every constant :func:`fit_platform` can fit (``fit=``): the defaults plus the per-message
#: latency and the compute-time scale, which need a grid with several node counts and a
#: measured compute time to be identifiable.
ALL_FITTABLE: tuple[str, ...] = (*FITTABLE, "message_latency_s", "compute_time_scale")
_OVERHEAD_FLOOR = 1e-7


@dataclass(frozen=True)
class Measurement:
    """A setup and its measured step time (seconds, e.g. the median over steps)."""

    setup: Setup
    measured_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.measured_s) and self.measured_s > 0):
            raise CommpressError(
                f"measured time of {self.setup.label or 'a setup'} must be finite and > 0 s, "
                f"got {self.measured_s!r}"
            )


@dataclass(frozen=True)
class ValidationRow:
    label: str
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        """Signed relative error ``(predicted - measured) / measured``."""
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass(frozen=True)
class ValidationReport:
    """Predicted against measured, setup by setup."""

    rows: tuple[ValidationRow, ...]
    platform: Platform

    @property
    def median_abs_error(self) -> float:
        return statistics.median(abs(r.error) for r in self.rows) if self.rows else math.nan

    @property
    def worst_abs_error(self) -> float:
        return max((abs(r.error) for r in self.rows), default=math.nan)

    def passes(self, median: float = 0.10, worst: float = 0.25) -> bool:
        """Whether the errors are within the goals (issue 6: 10% median, 25% worst)."""
        return self.median_abs_error <= median and self.worst_abs_error <= worst

    def table(self) -> str:

        rows = [
            [r.label, format_seconds(r.predicted_s), format_seconds(r.measured_s),
             f"{r.error:+.1%}"]
            for r in self.rows
        ]
        summary = (
            f"\nmedian |error| {self.median_abs_error:.1%}, worst |error| "
            f"{self.worst_abs_error:.1%} over {len(self.rows)} setups"
        )
        return render_table(["setup", "predicted", "measured", "error"], rows) + summary

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform.to_dict(),
            "median_abs_error": self.median_abs_error,
            "worst_abs_error": self.worst_abs_error,
            "rows": [
                {"label": r.label, "predicted_s": r.predicted_s, "measured_s": r.measured_s,
                 "error": r.error}
                for r in self.rows
            ],
        }


def validate(
    measurements: Sequence[Measurement],
    platform: Platform | None = None,
    *,
    speeds: SpeedTable | None = None,
) -> ValidationReport:
    """Predict every measured setup with ``platform`` and compare."""
    platform = platform or Platform()
    rows = tuple(
        ValidationRow(m.setup.label, m.setup.predict(platform, speeds).total, m.measured_s)
        for m in measurements
    )
    return ValidationReport(rows, platform)


def split_half(
    measurements: Sequence[Measurement], *, key: Callable[[Measurement], Any] | None = None
) -> tuple[list[Measurement], list[Measurement]]:
    """Deal measurements alternately (after sorting by ``key``, default the label) into a fit
    half and a holdout half; both then span the grid. Needs at least two measurements."""
    if len(measurements) < 2:
        raise CommpressError(f"need at least 2 measurements to split, got {len(measurements)}")
    ordered = sorted(measurements, key=key or (lambda m: m.setup.label))
    return ordered[0::2], ordered[1::2]


# ---------------------------------------------------------------------------- transforms
def _to_free(name: str, value: float) -> float:
    if name == "overlap_efficiency":
        v = min(max(value, 1e-6), 1 - 1e-6)
        return math.log(v / (1 - v))
    if name in ("collective_overhead_s", "message_latency_s"):
        return math.log(max(value, _OVERHEAD_FLOOR))
    return math.log(value)


def _from_free(name: str, x: float) -> float:
    if name == "overlap_efficiency":
        return 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, x))))
    if name in ("collective_overhead_s", "message_latency_s"):
        v = math.exp(max(-60.0, min(10.0, x)))
        return 0.0 if v <= _OVERHEAD_FLOOR else v
    return math.exp(max(-20.0, min(20.0, x)))


def nelder_mead(
    f: Callable[[list[float]], float],
    x0: Sequence[float],
    *,
    step: float = 0.5,
    max_iter: int = 300,
    tol: float = 1e-10,
) -> tuple[list[float], float]:
    """Minimise ``f`` from ``x0`` (standard coefficients: reflect 1, expand 2, contract 1/2,
    shrink 1/2). Returns the best point and value. Deterministic."""
    n = len(x0)
    simplex = [list(map(float, x0))]
    for i in range(n):
        x = list(map(float, x0))
        x[i] += step
        simplex.append(x)
    values = [f(x) for x in simplex]
    for _ in range(max_iter):
        order = sorted(range(n + 1), key=lambda i: values[i])
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if abs(values[-1] - values[0]) <= tol * (1 + abs(values[0])):
            break
        centroid = [sum(p[j] for p in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centroid, worst, strict=True)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centroid, worst, strict=True)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centroid, worst, strict=True)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [
                    [b + 0.5 * (p - b) for b, p in zip(best, pt, strict=True)]
                    for pt in simplex[1:]
                ]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    i = min(range(n + 1), key=lambda k: values[k])
    return simplex[i], values[i]


@dataclass(frozen=True)
class FitResult:
    platform: Platform
    loss: float
    fitted: tuple[str, ...]
    count: int


def fit_platform(
    measurements: Sequence[Measurement],
    *,
    fit: Sequence[str] = FITTABLE,
    start: Platform | None = None,
    speeds: SpeedTable | None = None,
    max_iter: int = 300,
    restarts: int = 2,
    name: str = "calibrated",
) -> FitResult:
    """Fit the platform constants named in ``fit`` to ``measurements`` (see the module doc).

    Args:
        fit: which of :data:`ALL_FITTABLE` to fit (default :data:`FITTABLE`); the others
            keep ``start``'s values.
        start: initial constants (default the ideal platform, efficiency set to 0.8 so the
            search can move both ways).
        max_iter: Nelder-Mead iterations per run.
        restarts: extra runs from the best point found (Nelder-Mead can stall on a face of
            the simplex; restarting rebuilds the simplex around the best point).

    Tuning: fit only what the grid can identify. Overlap efficiency needs setups where
    communication overlaps compute; the collective overhead needs small messages or many
    buckets; bandwidth needs large messages; the codec scale needs codecs with visible codec
    time. Fit with at least twice as many measurements as constants.
    """
    unknown = [p for p in fit if p not in ALL_FITTABLE]
    if unknown or not fit:
        raise CommpressError(
            f"cannot fit {unknown or 'nothing'}; fittable constants: {', '.join(ALL_FITTABLE)}"
        )
    if len(measurements) < len(fit):
        raise CommpressError(
            f"{len(measurements)} measurements cannot determine {len(fit)} constants"
        )
    base = start or Platform(overlap_efficiency=0.8)

    def platform_at(x: Sequence[float]) -> Platform:
        values: dict[str, Any] = {
            name: _from_free(name, v) for name, v in zip(fit, x, strict=True)
        }
        return replace(base, **values)

    def loss(x: list[float]) -> float:
        p = platform_at(x)
        total = 0.0
        for m in measurements:
            pred = m.setup.predict(p, speeds).total
            total += math.log(pred / m.measured_s) ** 2
        return total / len(measurements)

    x0 = [_to_free(name, getattr(base, name)) for name in fit]
    x, best_val = nelder_mead(loss, x0, max_iter=max_iter)
    for _ in range(max(0, restarts)):
        x2, val = nelder_mead(loss, x, max_iter=max_iter, step=0.25)
        improved = best_val - val
        if val < best_val:
            x, best_val = x2, val
        if improved < 1e-12:
            break
    return FitResult(replace(platform_at(x), name=name), best_val, tuple(fit), len(measurements))


@dataclass(frozen=True)
class CalibrationResult:
    fit: FitResult
    fit_report: ValidationReport
    holdout_report: ValidationReport


def calibrate_and_validate(
    measurements: Sequence[Measurement],
    *,
    fit: Sequence[str] = FITTABLE,
    speeds: SpeedTable | None = None,
    **kwargs: Any,
) -> CalibrationResult:
    """Split the measurements in halves, fit on one, report errors on both (the holdout
    report is the one to quote)."""
    fit_half, holdout = split_half(measurements)
    result = fit_platform(fit_half, fit=fit, speeds=speeds, **kwargs)
    return CalibrationResult(
        fit=result,
        fit_report=validate(fit_half, result.platform, speeds=speeds),
        holdout_report=validate(holdout, result.platform, speeds=speeds),
    )


__all__ = [
    "ALL_FITTABLE",
    "FITTABLE",
    "CalibrationResult",
    "FitResult",
    "Measurement",
    "NetworkFit",
    "ValidationReport",
    "ValidationRow",
    "calibrate_and_validate",
    "FlatTimes",
    "fit_network",
    "fit_platform",
    "JobNetwork",
    "job_environment",
    "measure_job_network",
    "measure_network",
    "nelder_mead",
    "split_half",
    "validate",
]


# ---------------------------------------------------------------------------- network
class FlatTimes(CommpressError):
    """The median all-reduce time of the largest size was no longer than the others': the
    timings cannot give a bandwidth (noise larger than the sizes' difference)."""


@dataclass(frozen=True)
class NetworkFit:
    """Alpha-beta fit of measured all-reduces among ``processes`` ranks.

    ``t(z) = 2 (n-1) alpha + 2 (n-1)/n z / bandwidth`` (a ring all-reduce of ``z`` bytes) is
    fitted to the median time of each size: the bandwidth from the two largest sizes (where
    the link, not the per-message cost, sets the time; small messages may also ride a shaper's
    burst or a NIC's buffers at line rate), the latency from the smallest; ``spread`` is the largest
    relative deviation of a median from the fit or of a repeat's time from its median
    (interquartile half-range), the uncertainty predictions quote.
    """

    processes: int
    backend: str
    alpha_s: float
    bandwidth: float  # bytes/s
    spread: float
    samples: tuple[tuple[int, tuple[float, ...]], ...]  # (bytes, times) per size

    def predicted(self, nbytes: float) -> float:
        n = self.processes
        return 2 * (n - 1) * self.alpha_s + 2 * (n - 1) / n * nbytes / self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {"processes": self.processes, "backend": self.backend, "alpha_s": self.alpha_s,
                "bandwidth_Bps": self.bandwidth, "spread": self.spread,
                "samples": [{"bytes": b, "seconds": list(t)} for b, t in self.samples]}


def fit_network(samples: Sequence[tuple[int, Sequence[float]]], processes: int,
                backend: str = "gloo") -> NetworkFit:
    """Fit :class:`NetworkFit` to ``(bytes, [seconds, ...])`` samples of ``processes`` ranks
    (at least two sizes)."""
    if processes < 2:
        raise CommpressError(f"a network fit needs at least 2 processes, got {processes}")
    if len({int(b) for b, _ in samples}) < 2 or any(not t for _, t in samples):
        raise CommpressError("a network fit needs timings at two or more sizes")
    ys = [statistics.median(t) for _, t in samples]
    by_size: dict[float, list[float]] = {}
    for (b, _), y in zip(samples, ys, strict=True):
        by_size.setdefault(float(b), []).append(y)
    points = sorted((x, statistics.median(v)) for x, v in by_size.items())
    (x0, y0), (x1, y1), (x2, y2) = points[0], points[-2], points[-1]
    # seconds per byte from the two largest sizes, or from the largest and the smallest when
    # that is steeper; the latency from the smallest, >= 0
    # (the larger of the two slopes: two largest sizes timed alike by noise would otherwise
    # give an absurd bandwidth)
    slope = max((y2 - y1) / (x2 - x1), (y2 - y0) / (x2 - x0))
    intercept = max(0.0, y0 - slope * x0)
    if intercept == 0.0 and slope > 0:  # the smallest size is faster than the line: through 0
        slope = y2 / x2
    if slope <= 0:
        raise FlatTimes("the measured all-reduce time does not grow with the size; "
                        "measure larger sizes")
    n = processes
    fit = NetworkFit(n, backend, intercept / (2 * (n - 1)), 2 * (n - 1) / n / slope, 0.0,
                     tuple((int(b), tuple(float(x) for x in t)) for b, t in samples))
    spread = 0.0
    for (b, t), y in zip(samples, ys, strict=True):
        q = sorted(t)
        iqr = (q[(3 * len(q)) // 4] - q[len(q) // 4]) / 2 / y if len(q) >= 4 else 0.0
        spread = max(spread, abs(fit.predicted(b) - y) / y, iqr)
    return replace(fit, spread=spread)


def _time_all_reduces(sizes: Sequence[int], repeats: int, device: str, group: Any = None,
                      member: bool = True) -> list[tuple[int, list[float]]]:
    """Time ``repeats`` all-reduces of each size on ``group`` (every rank of the default
    group calls this; ranks that are not ``member`` of ``group`` only keep step). Each repeat
    starts at a barrier of the default group; a repeat's time is the slowest rank's, the same
    list on every rank."""
    import torch
    import torch.distributed as dist

    results = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), device=device)
        if member:
            dist.all_reduce(x, group=group)  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if member:
                dist.all_reduce(x, group=group)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        # every rank's time counts: the slowest rank ends the collective
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        results.append((x.numel() * 4, t.tolist()))
    return results


#: rounds of timings :func:`_measure_fit` takes at most before giving up on flat timings
FIT_ROUNDS = 4


def _measure_fit(sizes: Sequence[int], repeats: int, device: str, processes: int,
                 backend: str, group: Any = None, member: bool = True) -> NetworkFit:
    """Time all-reduces (:func:`_time_all_reduces`) and fit them (:func:`fit_network`).

    When the medians do not grow with the size (:class:`FlatTimes`: a busy machine's noise
    larger than the sizes' difference, as on a loopback shared by other jobs), another round
    of ``repeats`` timings per size joins the samples and the fit is tried again, at most
    :data:`FIT_ROUNDS` rounds in all. The samples are the same on every rank, so every rank
    takes the same decision and issues the same collectives."""
    samples = _time_all_reduces(sizes, repeats, device, group, member)
    for taken in range(1, FIT_ROUNDS + 1):
        try:
            return fit_network(samples, processes, backend)
        except FlatTimes as exc:
            if taken == FIT_ROUNDS:
                raise FlatTimes(
                    f"{exc} (after {taken * repeats} repeats of each size; times in ms: "
                    + ", ".join(f"{b} B: {1e3 * statistics.median(t):.3g}" for b, t in samples)
                    + ")"
                ) from None
        more = _time_all_reduces(sizes, repeats, device, group, member)
        samples = [(b, t + u) for (b, t), (_, u) in zip(samples, more, strict=True)]
    raise AssertionError("unreachable")


def _network_worker(rank: int, world: int, store_path: str, backend: str,
                    sizes: Sequence[int], repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from commpress.procs import exit_when_orphaned

    exit_when_orphaned()
    try:
        dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world)
        device = "cuda" if backend == "nccl" else "cpu"
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        fit = _measure_fit(sizes, repeats, device, world, backend)
    except FlatTimes as exc:  # every rank takes it; the parent raises the same class
        out.put(("flat", f"rank {rank}: {exc}"))
    except BaseException as exc:  # reported to the parent first (the root cause), never a hang
        out.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
    else:
        if rank == 0:
            out.put(("ok", fit))
    finally:
        # after the report, so a peer's error from the teardown never comes first, and a
        # teardown error never replaces the report
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _worker_result(status: str, value: Any) -> NetworkFit:
    """The fit a :func:`_network_worker` sent, or its failure raised in the parent: times
    that stayed flat as :class:`FlatTimes` (the caller may measure larger sizes), anything
    else as :class:`CommpressError`."""
    if status == "ok":
        return value
    if status == "flat":
        raise FlatTimes(f"network calibration failed: {value}")
    raise CommpressError(f"network calibration failed: {value}")


def measure_network(processes: int = 2, *, backend: str = "gloo",
                    sizes: Sequence[int] = (1 << 12, 1 << 18, 1 << 22), repeats: int = 7,
                    timeout_s: float = 300.0) -> NetworkFit:
    """Time real all-reduces among ``processes`` local processes (``backend`` gloo or nccl,
    the job's own process count) at ``sizes`` bytes and fit :class:`NetworkFit`.
    ``timeout_s`` bounds the whole measurement, up to :data:`FIT_ROUNDS` rounds of
    ``repeats`` all-reduces of each size (a few seconds for the defaults on a loopback)."""
    import multiprocessing as mp
    import queue
    import tempfile

    if processes < 2:
        raise CommpressError(f"--processes must be >= 2, got {processes}")
    if backend not in ("gloo", "nccl"):
        raise CommpressError(f"backend must be gloo or nccl, got {backend!r}")
    if repeats < 1 or len(sizes) < 2:
        raise CommpressError("need repeats >= 1 and at least two sizes")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_network_worker,
                             args=(r, processes, f"{tmp}/store", backend, list(sizes), repeats,
                                   out), daemon=True)
                 for r in range(processes)]
        for p in procs:
            p.start()
        try:
            status, value = out.get(timeout=timeout_s)
        except queue.Empty:
            status, value = "error", f"no result within {timeout_s:g} s"
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return _worker_result(status, value)


@dataclass(frozen=True)
class JobNetwork:
    """The network of a running torchrun job, as :func:`measure_job_network` measured it:
    ``nodes`` nodes of ``per_node`` ranks; ``inter`` fits the all-reduces among one rank per
    node (the nodes' links; ``None`` on one node), ``intra`` those among the ranks of each
    node, all nodes at once (``None`` with one rank per node)."""

    nodes: int
    per_node: int
    backend: str
    inter: NetworkFit | None
    intra: NetworkFit | None

    def cluster(self) -> dict[str, Any]:
        """The calibration file's ``cluster`` entry (:meth:`Cluster.from_measured`'s flat
        form): measured goodput, so the efficiency is 1."""
        out: dict[str, Any] = {"nodes": self.nodes, "gpus_per_node": self.per_node}
        if self.inter is not None:
            out.update(inter_bw=f"{self.inter.bandwidth:.6g}B/s",
                       inter_latency=f"{self.inter.alpha_s * 1e6:.6g}us", inter_efficiency=1.0)
        if self.intra is not None:
            out.update(intra_bw=f"{self.intra.bandwidth:.6g}B/s",
                       intra_latency=f"{self.intra.alpha_s * 1e6:.6g}us")
        return out


def job_environment() -> tuple[int, int, int] | None:
    """``(rank, world size, ranks per node)`` when this process is a rank of a torchrun job of
    two or more ranks (torchrun's environment variables), else ``None``."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world < 2 or "RANK" not in os.environ:
            return None
        rank = int(os.environ["RANK"])
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise CommpressError(
                "RANK and WORLD_SIZE are set but LOCAL_WORLD_SIZE (ranks per node) is not: "
                "launch with torchrun, or set it, so calibrate can tell the nodes apart"
            )
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    except ValueError as exc:
        raise CommpressError(f"torchrun environment unreadable: {exc}") from exc
    if per_node < 1 or world % per_node:
        raise CommpressError(
            f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {per_node}: calibrate "
            "needs the same number of ranks on every node"
        )
    return rank, world, per_node


def measure_job_network(*, backend: str = "gloo",
                        sizes: Sequence[int] = (1 << 12, 1 << 18, 1 << 22),
                        repeats: int = 7) -> JobNetwork:
    """Time real all-reduces inside the running torchrun job (every rank calls this): among
    one rank per node (the inter-node links) and among the ranks of each node (all nodes at
    once, as a hierarchical all-reduce runs them), and fit each. Ranks are numbered node by
    node, as torchrun numbers them. Every rank returns the same result."""
    import torch
    import torch.distributed as dist

    env = job_environment()
    if env is None:
        raise CommpressError("not a rank of a torchrun job of 2 or more ranks")
    if repeats < 1 or len(sizes) < 2:
        raise CommpressError("need repeats >= 1 and at least two sizes")
    rank, world, per_node = env
    nodes = world // per_node
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    started = not dist.is_initialized()
    if started:
        dist.init_process_group(backend)
    try:
        node = rank // per_node
        inter = intra = None
        if nodes > 1:  # every rank creates every group, in the same order
            leaders = dist.new_group([k * per_node for k in range(nodes)])
            inter = _measure_fit(sizes, repeats, device, nodes, backend, leaders,
                                 rank % per_node == 0)
        if per_node > 1:
            groups = [dist.new_group(list(range(k * per_node, (k + 1) * per_node)))
                      for k in range(nodes)] if nodes > 1 else [None]
            intra = _measure_fit(sizes, repeats, device, per_node, backend,
                                 groups[node if nodes > 1 else 0])
        dist.barrier()
    finally:
        if started:
            dist.destroy_process_group()
    return JobNetwork(nodes, per_node, backend, inter, intra)
