"""Predicted against measured: real DDP runs on the emulated cluster (``commpress validate``).

The performance model is only worth its advice if its predictions hold on real runs. This
module trains the built-in GPT with DDP across real processes on the emulated cluster
(:mod:`commpress.cluster`, via :func:`commpress.demo.e2e.run_setups`) for a grid of node
counts, link bandwidths and codecs, measures the iteration times, and checks the model against
them without ever fitting and reporting on the same runs.

Algorithm of :func:`run_validation` (measuring) and :func:`analyse` (checking):

1. **Calibration micro-benchmarks**, none of them a grid run:

   a. *Codec speeds*, once per world size, in this process with a training worker's thread
      count: every codec's whole per-tensor path as the DDP hook runs it (compensation,
      protocol with the rounds answered locally, decodes, residual update), the fastest of 9
      runs (:func:`calibrate_codecs`). Contention is applied by the model (step 3).
   b. *Compute*, right before and right after every launch: as many processes as the
      launch's world size (:class:`ComputePool`, kept alive between launches), each with a
      worker's thread count, time the model's forward, backward and optimizer step on their
      shard of the batch, without communication, once the machine is quiet
      (:func:`wait_for_quiet`: a finished launch leaves kernel work behind). Step by step
      the slowest process counts (synchronous data parallelism waits for it); medians over
      12 steps.

2. **Runs**: one launch per *group* (node count, processes per node, bandwidth, codecs; one
   emulated cluster). A codec entry ``codec@strategy`` (``"fp16@ring"``) makes the hook
   exchange with that strategy (``commpress.ddp.register(..., strategy=)``; the hierarchical
   ones with the group's processes per node as the node) and the model predict it with the
   same strategy; a plain codec uses the codec's own protocol. Every codec trains ``steps``
   steps with commpress's DDP hook; a setup's measured iteration time is the median over its
   steady steps (after ``timing_skip``
   start-up steps and the codec's fp16 warm-up), each step timed as the slowest rank's.

3. **Model setups** (:func:`model_setup`): the workload from the model's parameter shapes in
   DDP's buckets, with the compute interpolated in time between the benchmark before and after
   the launch at the middle of the setup's timed steps (the machine's load drifts); the
   cluster from the requested link rate (TCP framing leaves 1448/1514 of it) with the
   emulator's token bucket (``tbf`` burst); the hook's plan
   (:class:`~commpress.perfmodel.model.HookPlan`: small and incompressible tensors go as
   fp16, one bucket at a time, two tensors in flight); the codec speeds; and the *contention*
   ``processes x threads / cores`` (CPU-bound software costs are multiplied by it).

4. **Split** (:func:`split`): sorted by codec, node count and bandwidth, the setups are dealt
   alternately into a fit half and a holdout half, so each codec's runs fall in both halves.
   :func:`~commpress.perfmodel.calibration.fit_platform` fits the platform constants
   (:data:`VALIDATION_FIT`: per-collective overhead, codec-time scale, effective-bandwidth
   factor, compute-time scale, overlap efficiency, per-message latency) on the fit half only;
   the holdout half is predicted with them and compared.

5. **Report**: every setup (and its half), the holdout's median and worst absolute error
   (issue 6's goals: 10% and 25%), the uncalibrated model's error for comparison, a JSON file
   with everything measured, a PNG scatter of predicted against measured.

Measurements are saved before the analysis, so :func:`analyse` can refit a saved run
(``commpress validate --from validation.json``) without training again.

Tuning: the machine should be otherwise idle. Every other job that wakes up during a launch
slows the training steps it overlaps, and the compute benchmarks around the launch catch
that only on average; on a busy 2-core machine this noise, not the model, dominates the error.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from commpress.cluster.shaping import choose_burst
from commpress.demo.data import batches, stdlib_corpus
from commpress.demo.e2e import Setup as RunSetup
from commpress.demo.e2e import as_setup, parse_setup_spec, run_setups, setup_spec
from commpress.demo.model import build_model, preset
from commpress.demo.train import make_optimizer
from commpress.errors import CommpressError, error_context, read_json
from commpress.perfmodel.calibration import (
    CalibrationResult,
    FitResult,
    Measurement,
    ValidationReport,
    fit_platform,
    validate,
)
from commpress.perfmodel.codec_costs import SpeedTable, calibrate_protocol_speeds
from commpress.perfmodel.collectives import TCP_EFFICIENCY, Cluster
from commpress.perfmodel.model import HookPlan, Platform, Setup, Workload, ddp_buckets
from commpress.report import render_table
from commpress.units import format_seconds, parse_bandwidth

#: Format tag of the JSON written by :func:`save_run` / read by :func:`load_run`.
RUN_FORMAT = "commpress-validation/1"

#: Platform constants fitted on the fit half, in order of priority: with fewer than twice as
#: many fit measurements as constants, only the first ones are fitted.
VALIDATION_FIT: tuple[str, ...] = (
    "collective_overhead_s",
    "codec_time_scale",
    "inter_bandwidth_scale",
    "compute_time_scale",
    "overlap_efficiency",
    "message_latency_s",
)

#: Codecs of the default grid: the fp16 baseline, low-rank (two all-reduce rounds per
#: matrix), sparsification with a summable protocol (TopKC), a non-summable 1-bit code
#: gathered from every rank (sign) and a quantizer with a costly encoder (THC).
DEFAULT_CODECS: tuple[str, ...] = ("fp16", "powersgd:rank=4", "topkc", "sign", "thc")

#: Setups of the default grid that vary the exchange strategy (``codec@strategy``, see
#: :func:`commpress.demo.e2e.parse_setup_spec`), on 2 nodes x 2 processes so that the
#: hierarchical strategy has a node to reduce on: fp16 by the codec's all-reduce, a ring with the
#: codec in the wire and hierarchically; a non-summable quantizer gathered; PowerSGD
#: hierarchically (its rounds on one shard per local rank).
STRATEGY_SETUPS: tuple[str, ...] = ("fp16@allreduce", "fp16@ring", "fp16@hierarchical",
                                    "qsgd@allgather", "powersgd:rank=4@hierarchical")

#: Per-message latency assumed before calibration: the emulated links add none (no netem),
#: so ``alpha`` is the kernel's veth and TCP path, tens of microseconds.
BASE_LATENCY_S = 50e-6


@dataclass(frozen=True)
class Group:
    """One launch of the grid: an emulated cluster and the codecs trained on it in turn.

    Attributes:
        nodes: emulated nodes (namespaces), 2 or more.
        bandwidth: each node's link rate in ``tc`` units (``"50mbit"``, ``"2gbit"``).
        codecs: codec spec strings, each one setup.
        procs_per_node: training processes per node (they share the node's link).
    """

    nodes: int
    bandwidth: str
    codecs: tuple[str, ...]
    procs_per_node: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 2:
            raise CommpressError(f"a validation group needs an int >= 2 nodes, got "
                                 f"{self.nodes!r}")
        if (isinstance(self.procs_per_node, bool) or not isinstance(self.procs_per_node, int)
                or self.procs_per_node < 1):
            raise CommpressError(f"procs_per_node must be an int >= 1, got "
                                 f"{self.procs_per_node!r}")
        with error_context(f"bandwidth of a validation group {self.bandwidth!r}"):
            parse_bandwidth(self.bandwidth)
        if not self.codecs:
            raise CommpressError("a validation group needs at least one codec")

        for spec in self.codecs:
            with error_context(f"validation setup {spec!r}"):
                as_setup(spec).check()

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def label(self, codec: str) -> str:
        """``"<nodes>n[x<procs>] <bandwidth> <codec[@strategy]>"``."""
        layout = f"{self.nodes}n" + (f"x{self.procs_per_node}" if self.procs_per_node > 1 else "")
        return f"{layout} {self.bandwidth} {codec}"


def default_grid(codecs: Sequence[str] = DEFAULT_CODECS,
                 strategies: Sequence[str] | None = None) -> list[Group]:
    """The full grid: 8 clusters from 50 Mbit/s to 2 Gbit/s and 2 to 4 nodes, each with every
    codec (40 setups with the default codecs, each with the codec's own protocol), plus one
    2-node x 2-process cluster at 200 Mbit/s with ``strategies`` (``codec@strategy`` specs;
    default :data:`STRATEGY_SETUPS` when ``codecs`` are the default ones, none otherwise):
    45 setups by default."""
    layouts = [(2, "50mbit"), (2, "200mbit"), (2, "1gbit"), (3, "100mbit"), (3, "500mbit"),
               (4, "50mbit"), (4, "200mbit"), (4, "2gbit")]
    groups = [Group(n, bw, tuple(codecs)) for n, bw in layouts]
    if strategies is None:
        strategies = STRATEGY_SETUPS if tuple(codecs) == DEFAULT_CODECS else ()
    if strategies:
        groups.append(Group(2, "200mbit", tuple(strategies), procs_per_node=2))
    return groups


def quick_grid() -> list[Group]:
    """Five setups on one 2-node cluster at 100 Mbit/s (a smoke test of the whole pipeline,
    about a minute): fp16, PowerSGD, sign and TopKC by their own protocols, and fp16 in a ring
    with the codec in the wire."""
    return [Group(2, "100mbit", ("fp16", "powersgd:rank=4", "sign", "topkc", "fp16@ring"))]


def with_strategies(codecs: Sequence[str], strategies: Sequence[str]) -> tuple[list[str],
                                                                                list[str]]:
    """Every codec of ``codecs`` with every strategy (``codec@strategy``; a codec already
    written with ``@`` is kept as is). Returns the specs and the skipped pairs, which the
    hook refuses (multi-round codecs in a ring, non-summable ones in ``allreduce``...)."""

    specs: list[str] = []
    skipped: list[str] = []
    for codec in codecs:
        base, own = parse_setup_spec(codec)
        for strategy in ([own] if "@" in codec else strategies):
            spec = setup_spec(base, strategy)
            try:
                as_setup(spec).check()
            except CommpressError:
                skipped.append(spec)
                continue
            if spec not in specs:
                specs.append(spec)
    return specs, skipped


def parse_group(text: str, codecs: Sequence[str]) -> Group:
    """``"NODES:BANDWIDTH"`` or ``"NODESxPROCS:BANDWIDTH"`` (e.g. ``"4:200mbit"``,
    ``"2x2:1gbit"``), with ``codecs``."""
    layout, sep, bw = text.partition(":")
    nodes, _, ppn = layout.partition("x")
    try:
        if not sep or not bw:
            raise ValueError(text)
        return Group(int(nodes), bw.strip(), tuple(codecs), int(ppn) if ppn else 1)
    except ValueError:
        raise CommpressError(
            f"bad grid entry {text!r}; expected NODES:BANDWIDTH or NODESxPROCS:BANDWIDTH, "
            "e.g. 4:200mbit or 2x2:1gbit"
        ) from None


# ------------------------------------------------------------------ calibration benchmark
@dataclass(frozen=True)
class PlatformProfile:
    """What the calibration micro-benchmark measured before (and after) one launch.

    Attributes:
        processes: concurrent processes (the training world size on this machine).
        threads: torch (and numba) threads per process.
        forward_s, backward_s, optimizer_s: per-step times of one process's shard of the
            batch (optimizer includes gradient clipping): medians over steps and processes,
            averaged over the measurements before and after the launch.
        speeds: the codec speed table at this world size (uncontended: see
            :func:`calibrate_codecs`).
        wall_s: seconds the compute measurements took.
        cores: CPU cores of the machine.
        samples: the individual ``[forward, backward, optimizer]`` measurements averaged.
        sample_times: when each sample was taken (seconds since the validation started).
    """

    processes: int
    threads: int
    forward_s: float
    backward_s: float
    optimizer_s: float
    speeds: SpeedTable
    wall_s: float = 0.0
    cores: int = 1
    samples: tuple[tuple[float, float, float], ...] = ()
    sample_times: tuple[float, ...] = ()

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def compute_at(self, t: float | None) -> tuple[float, float, float]:
        """Forward, backward and optimizer seconds at time ``t``: interpolated linearly
        between the samples taken before and after the launch (the machine's load drifts),
        clamped to them; their average when ``t`` or the sample times are unknown."""
        avg = (self.forward_s, self.backward_s, self.optimizer_s)
        if t is None or len(self.samples) != 2 or len(self.sample_times) != 2:
            return avg
        (b, a), (tb, ta) = self.samples, self.sample_times
        if not ta > tb:
            return avg
        w = min(1.0, max(0.0, (t - tb) / (ta - tb)))
        return (b[0] + w * (a[0] - b[0]), b[1] + w * (a[1] - b[1]), b[2] + w * (a[2] - b[2]))

    @property
    def contention(self) -> float:
        """Runnable threads per core during training: ``processes * threads / cores``, at
        least 1 (see :attr:`commpress.perfmodel.model.Setup.contention`)."""
        return max(1.0, self.processes * self.threads / max(1, self.cores))

    def to_dict(self) -> dict[str, Any]:
        return {
            "processes": self.processes, "threads": self.threads,
            "forward_s": self.forward_s, "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s, "speeds": self.speeds.to_dict(),
            "wall_s": self.wall_s, "cores": self.cores,
            "samples": [list(s) for s in self.samples],
            "sample_times": list(self.sample_times),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlatformProfile:
        with error_context("reading a platform profile"):
            return cls(
                processes=int(data["processes"]), threads=int(data["threads"]),
                forward_s=float(data["forward_s"]), backward_s=float(data["backward_s"]),
                optimizer_s=float(data["optimizer_s"]),
                speeds=SpeedTable.from_dict(data["speeds"]), wall_s=float(data.get("wall_s", 0)),
                cores=int(data.get("cores", 1)),
                samples=tuple(tuple(float(v) for v in s)  # type: ignore[misc]
                              for s in data.get("samples", [])),
                sample_times=tuple(float(t) for t in data.get("sample_times", [])),
            )


def _benchmark_worker(config_path: str, rank: int) -> int:
    """Body of one compute micro-benchmark process (see :class:`ComputePool`): build the
    model, print ``ready``, then answer every ``compute N`` line on stdin with one JSON line
    of median forward/backward/optimizer times over ``N`` steps (after 2 warm-up steps)."""
    cfg = json.loads(Path(config_path).read_text())
    import torch

    threads = int(cfg["threads"])
    torch.set_num_threads(threads)

    processes = int(cfg["processes"])
    config = preset(cfg["model"])
    net = build_model(config, seed=0)
    opt = make_optimizer(net, 3e-3)
    data = batches(stdlib_corpus(200_000), batch_size=int(cfg["batch_size"]),
                   context=config.context, seed=0, rank=rank, world_size=processes)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "exit":
            break
        if cmd != "compute":
            print(json.dumps({"error": f"unknown command {cmd!r}"}), flush=True)
            continue
        try:
            fwd, bwd, upd = [], [], []
            warm = 2
            for i in range(warm + int(arg)):
                x, y = next(data)
                t0 = time.perf_counter()
                loss = net.loss(net(x), y)
                t1 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                t2 = time.perf_counter()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                float(loss.detach())
                t3 = time.perf_counter()
                if i >= warm:
                    fwd.append(t1 - t0)
                    bwd.append(t2 - t1)
                    upd.append(t3 - t2)
            reply: dict[str, Any] = {"forward_s": fwd, "backward_s": bwd, "optimizer_s": upd}
        except Exception as exc:  # reported to the parent instead of a silent exit
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)
    return 0


class ComputePool:
    """``processes`` long-lived processes timing the built-in model's compute together.

    Starting Python and torch costs seconds on a busy machine; the pool pays it once, so the
    compute can be measured right before and right after every launch for a second or two
    each. Use as a context manager (the processes are stopped on exit).
    """

    def __init__(self, processes: int, *, threads: int | None = None, model: str = "tiny",
                 batch_size: int = 16, timeout_s: float = 120.0) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise CommpressError(f"processes must be an int >= 1, got {processes!r}")
        if batch_size % processes:
            raise CommpressError(f"batch_size {batch_size} must be a multiple of the number "
                                 f"of processes {processes}")
        self.processes = processes
        self.threads = threads or max(1, (os.cpu_count() or 1) // processes)
        self.model = model
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self._procs: list[Any] = []
        self._tmp: Any = None

    def __enter__(self) -> ComputePool:
        import subprocess
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="commpress-bench-")
        config_path = Path(self._tmp.name) / "config.json"
        config_path.write_text(json.dumps({
            "threads": self.threads, "processes": self.processes, "model": self.model,
            "batch_size": self.batch_size,
        }))
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads),
               "NUMBA_NUM_THREADS": str(self.threads)}
        try:
            for r in range(self.processes):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-m", "commpress.experiments.validation",
                     "--benchmark-worker", str(config_path), str(r)],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True, bufsize=1,
                ))
            for line in self._read_all("start"):
                if line.strip() != "ready":
                    raise CommpressError(f"a benchmark process said {line.strip()!r}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _read_all(self, what: str) -> list[str]:
        import select

        deadline = time.monotonic() + self.timeout_s
        lines: list[str | None] = [None] * len(self._procs)
        while any(x is None for x in lines):
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommpressError(f"the compute micro-benchmark timed out after "
                                     f"{self.timeout_s:g} s ({what})")
            waiting = {p.stdout.fileno(): i for i, p in enumerate(self._procs)
                       if lines[i] is None}
            ready, _, _ = select.select(list(waiting), [], [], min(left, 1.0))
            for fd in ready:
                i = waiting[fd]
                line = self._procs[i].stdout.readline()
                if not line:
                    raise CommpressError(
                        f"a compute micro-benchmark process exited (code "
                        f"{self._procs[i].poll()}) during {what}"
                    )
                lines[i] = line
        return [x for x in lines if x is not None]

    def measure(self, steps: int = 12) -> tuple[float, float, float]:
        """Forward, backward and optimizer seconds: all processes start together and step
        freely for ``steps`` steps (after 2 warm-up steps); for every step index the slowest
        process's times are kept (synchronous data parallelism waits for the slowest rank),
        and the median over steps is returned.

        Free-running, not in lockstep: a barrier before every step makes the processes wake
        up together on one core (the scheduler places woken tasks near their waker) and
        measures that artefact instead of the compute.
        """
        if not self._procs:
            raise CommpressError("ComputePool.measure needs the pool started (use `with`)")
        for p in self._procs:  # start them together
            p.stdin.write(f"compute {int(steps)}\n")
            p.stdin.flush()
        replies = [json.loads(line) for line in self._read_all("a measurement")]
        errors = [r["error"] for r in replies if "error" in r]
        if errors:
            raise CommpressError(f"the compute micro-benchmark failed: {errors[0]}")
        # Synchronous data parallelism waits for the slowest rank at every step: take, step
        # by step, the process with the longest step, then the median over steps.
        per_step = [max(((r["forward_s"][k], r["backward_s"][k], r["optimizer_s"][k])
                         for r in replies), key=sum) for k in range(int(steps))]
        return tuple(
            statistics.median(x[i] for x in per_step) for i in range(3)
        )

    def __exit__(self, *exc: object) -> None:
        import subprocess

        for p in self._procs:
            try:
                if p.stdin and not p.stdin.closed:
                    p.stdin.write("exit\n")
                    p.stdin.close()
            except OSError:
                pass
        for p in self._procs:
            try:
                p.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10.0)
            if p.stdout:
                p.stdout.close()
        self._procs = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def calibrate_codecs(codecs: Sequence[str], *, world_size: int, threads: int = 1,
                     repeats: int = 9) -> SpeedTable:
    """Codec speeds (:func:`~commpress.perfmodel.codec_costs.calibrate_protocol_speeds`) in
    this process with ``threads`` torch/numba threads, taking the *fastest* of ``repeats``
    runs: on a shared machine every disturbance only adds time, so the minimum estimates the
    uncontended cost, and the model applies the training run's contention itself
    (:attr:`commpress.perfmodel.model.Setup.contention`)."""
    import torch


    saved = torch.get_num_threads()
    numba_saved = None
    try:
        import numba

        numba_saved = numba.get_num_threads()
        numba.set_num_threads(min(threads, getattr(numba.config, "NUMBA_NUM_THREADS", threads)))
    except (ImportError, ValueError, RuntimeError):  # pragma: no cover
        numba_saved = None
    torch.set_num_threads(threads)
    try:
        return calibrate_protocol_speeds(codecs, world_size=world_size, repeats=repeats,
                                         statistic="min")
    finally:
        torch.set_num_threads(saved)
        if numba_saved is not None:
            import numba

            numba.set_num_threads(numba_saved)


def measure_platform(
    codecs: Sequence[str],
    *,
    processes: int,
    threads: int | None = None,
    model: str = "tiny",
    batch_size: int = 16,
    steps: int = 12,
) -> PlatformProfile:
    """The calibration micro-benchmark in one call (what :func:`run_validation` does around
    each launch, without the launch).

    Algorithm:

    1. Start ``processes`` processes (as many as train concurrently on this machine), each
       with ``threads`` torch threads (default: a training worker's share,
       ``max(1, cores // processes)``), building the model (:class:`ComputePool`).
    2. All step together: 2 warm-up steps, then ``steps`` timed steps on their shard of a
       ``batch_size`` batch, timing forward (with the loss), backward, and gradient clipping
       plus AdamW separately. No communication: this is the compute DDP overlaps with, under
       the same contention for cores as in training.
    3. Codec speeds at world size ``processes`` (:func:`calibrate_codecs`).

    Tuning: ``steps`` 10-20 is enough for the tiny model (a step is tens of milliseconds); a
    busy machine needs more.
    """
    t0 = time.perf_counter()
    with ComputePool(processes, threads=threads, model=model, batch_size=batch_size) as pool:
        fwd, bwd, upd = pool.measure(steps)
        threads = pool.threads
    wall = time.perf_counter() - t0
    speeds = (calibrate_codecs(codecs, world_size=processes, threads=threads) if codecs
              else SpeedTable({}, "not measured"))
    return PlatformProfile(processes=processes, threads=threads, forward_s=fwd,
                           backward_s=bwd, optimizer_s=upd, speeds=speeds, wall_s=wall,
                           cores=os.cpu_count() or 1, samples=((fwd, bwd, upd),))


# ------------------------------------------------------------------ measured runs
@dataclass
class Run:
    """One measured setup: where and what it ran, and its iteration times.

    Attributes:
        group_index: index of its :class:`Group` in :attr:`ValidationRun.groups`.
        codec: codec spec, ``codec@strategy`` when the hook used another strategy than
            ``auto`` (JSON written before strategies existed has none: ``auto``).
        label: ``"<nodes>n <bandwidth> <codec>"``.
        measured_s: median steady iteration time (seconds).
        spread_s: 10th and 90th percentile of the steady iteration times.
        step_times: every step's time (slowest rank).
        steady_from: first step counted in ``measured_s``.
        bits_per_coord: collective input bits per gradient element (from the run).
        replicas_identical: whether all ranks ended with the same parameters.
        window_s: when the setup started and ended training (seconds since the validation
            started; ``None`` when unknown).
    """

    group_index: int
    codec: str
    label: str
    measured_s: float
    spread_s: tuple[float, float]
    step_times: list[float]
    steady_from: int
    bits_per_coord: float
    replicas_identical: bool
    window_s: tuple[float, float] | None = None

    @property
    def steady_mid_s(self) -> float | None:
        """Middle of the timed (steady) steps, assuming steps of equal length."""
        if self.window_s is None:
            return None
        t0, t1 = self.window_s
        n = max(1, len(self.step_times))
        start = t0 + (t1 - t0) * min(self.steady_from, n) / n
        return 0.5 * (start + t1)


@dataclass
class ValidationRun:
    """Everything measured by :func:`run_validation` (and saved to JSON)."""

    groups: list[Group]
    profiles: list[PlatformProfile]
    runs: list[Run]
    model: str
    steps: int
    batch_size: int
    hook: HookPlan
    date: str = ""
    command: str = ""
    wall_s: float = 0.0
    load: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": RUN_FORMAT,
            "date": self.date,
            "command": self.command,
            "model": self.model,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "hook": self.hook.to_dict(),
            "wall_s": self.wall_s,
            "load": self.load,
            "groups": [asdict(g) for g in self.groups],
            "profiles": [p.to_dict() for p in self.profiles],
            "runs": [asdict(r) for r in self.runs],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidationRun:
        if data.get("format") != RUN_FORMAT:
            raise CommpressError(
                f"not a validation run: expected format {RUN_FORMAT!r} as written by "
                "`commpress validate`"
            )
        with error_context("reading a validation run"):
            runs = []
            for r in data["runs"]:
                r = dict(r)
                r["spread_s"] = tuple(r["spread_s"])
                if r.get("window_s") is not None:
                    r["window_s"] = tuple(r["window_s"])
                runs.append(Run(**r))
            return cls(
                groups=[Group(g["nodes"], g["bandwidth"], tuple(g["codecs"]),
                              g.get("procs_per_node", 1)) for g in data["groups"]],
                profiles=[PlatformProfile.from_dict(p) for p in data["profiles"]],
                runs=runs, model=str(data["model"]), steps=int(data["steps"]),
                batch_size=int(data["batch_size"]),
                # runs recorded before the hook batched rounds were measured without it
                hook=HookPlan(**{"batch_rounds": False, **data["hook"]}),
                date=str(data.get("date", "")), command=str(data.get("command", "")),
                wall_s=float(data.get("wall_s", 0.0)),
                load=[float(x) for x in data.get("load", [])],
            )


def save_run(run: ValidationRun, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(run.to_dict(), indent=1, default=_json_default) + "\n")


def load_run(path: str | Path) -> ValidationRun:
    data = read_json(path, f"validation run {path}")
    if isinstance(data, Mapping) and "measurements" in data:  # a full report: take its runs
        data = data["measurements"]
    return ValidationRun.from_dict(data)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    raise TypeError(f"not JSON serialisable: {value!r}")


def _cpu_times() -> tuple[float, float] | None:
    """Busy and total jiffies of all CPUs since boot (``/proc/stat``), or ``None``."""
    try:
        with open("/proc/stat") as fh:
            fields = [float(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])
    return total - idle, total


def wait_for_quiet(*, busy_below: float = 0.25, interval_s: float = 0.25,
                   max_wait_s: float = 10.0) -> float:
    """Wait until less than ``busy_below`` of the machine's CPU time was busy over the last
    ``interval_s`` (the kernel's teardown of a finished launch's namespaces and processes,
    another job's burst), at most ``max_wait_s``; returns the seconds waited. Used before each
    compute benchmark, so that it measures the model's compute rather than a transient."""
    t0 = time.perf_counter()
    prev = _cpu_times()
    if prev is None:
        return 0.0
    while True:
        time.sleep(interval_s)
        cur = _cpu_times()
        if cur is None:
            return time.perf_counter() - t0
        busy, total = cur[0] - prev[0], cur[1] - prev[1]
        prev = cur
        waited = time.perf_counter() - t0
        if (total > 0 and busy / total < busy_below) or waited >= max_wait_s:
            return waited


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return math.nan


def run_validation(
    groups: Sequence[Group],
    *,
    steps: int = 20,
    warmup_steps: int = 2,
    timing_skip: int = 3,
    model: str = "tiny",
    batch_size: int = 16,
    benchmark_steps: int = 12,
    use_cluster: bool | None = True,
    progress: bool = True,
    work_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> ValidationRun:
    """Measure every setup of ``groups`` (steps 1-2 of the module's algorithm); pass the
    result to :func:`analyse`.

    Args:
        groups: the grid, one launch each.
        steps: training steps per setup. The measured time is the median over the steps after
            ``max(timing_skip, warmup_steps)``; 20 steps leave 17.
        warmup_steps: fp16 steps before a lossy codec starts (commpress's schedule); they are
            not timed. 2 is enough for timing (convergence is not measured here).
        timing_skip: first steps excluded as start-up (JIT, DDP's bucket rebuild).
        model: built-in model preset.
        batch_size: global rows per step (a multiple of every world size: 16 fits 2 and 4,
            48 fits 3 too; the default is rounded up per group).
        benchmark_steps: steps of each compute micro-benchmark (before and after every
            launch). 12 tiny-model steps take about a second.
        use_cluster: ``True`` requires the emulated cluster (root and network namespaces);
            ``None`` falls back to unshaped local processes (the links are then not what the
            model is told, so the comparison is meaningless except as a smoke test).
        progress: a tqdm bar over all training steps of the grid.
        work_dir: keep each launch's files (``group<i>/``) there (default: temporary).
        log: called with one line per finished group (default: nothing).
    """

    if not groups:
        raise CommpressError("the validation grid is empty")
    for name, value, low in (("steps", steps, 2), ("warmup_steps", warmup_steps, 0),
                             ("timing_skip", timing_skip, 0),
                             ("benchmark_steps", benchmark_steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CommpressError(f"{name} must be an int >= {low}, got {value!r}")
    if max(timing_skip, warmup_steps) >= steps - 1:
        raise CommpressError(
            f"steps={steps} leaves fewer than 2 timed steps after timing_skip={timing_skip} "
            f"and warmup_steps={warmup_steps}"
        )
    hook = HookPlan(min_numel=4096, min_compression_rate=2.0, fallback_codec="fp16")
    total_setups = sum(len(g.codecs) for g in groups)
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_setups * steps, desc="validate", unit="step", file=sys.stderr)
    t_start = time.perf_counter()
    speeds_by_size: dict[int, SpeedTable] = {}
    profiles: list[PlatformProfile] = []
    runs: list[Run] = []
    loads: list[float] = []
    pool: ComputePool | None = None
    try:
        for gi, group in enumerate(groups):
            ws = group.world_size
            bs = batch_size if batch_size % ws == 0 else ws * math.ceil(batch_size / ws)
            loads.append(_loadavg())
            if bar is not None:
                bar.set_postfix_str(f"calibrating for {ws} processes")
            # One pool of benchmark processes per world size (kept while consecutive groups
            # share it); compute measured right before and right after every launch.
            if pool is None or (pool.processes, pool.batch_size) != (ws, bs):
                if pool is not None:
                    pool.__exit__()
                    pool = None
                pool = ComputePool(ws, model=model, batch_size=bs).__enter__()
            if ws not in speeds_by_size:
                todo = sorted({"fp16", *(parse_setup_spec(c)[0] for g in groups
                                         if g.world_size == ws for c in g.codecs)})
                speeds_by_size[ws] = calibrate_codecs(todo, world_size=ws, threads=pool.threads)
            wait_for_quiet()
            t0 = time.perf_counter()
            before = pool.measure(benchmark_steps)
            bench_wall = time.perf_counter() - t0
            t_before = 0.5 * (t0 + t0 + bench_wall) - t_start
            setups = [RunSetup(codec=parse_setup_spec(c)[0], strategy=parse_setup_spec(c)[1],
                               label=group.label(c), warmup_steps=warmup_steps,
                               min_numel=hook.min_numel,
                               min_compression_rate=hook.min_compression_rate)
                      for c in group.codecs]
            seen: dict[int, int] = {}
            windows: dict[int, list[float]] = {}

            def on_event(event: dict[str, Any], seen: dict[int, int] = seen,
                         group: Group = group, windows: dict[int, list[float]] = windows
                         ) -> None:
                kind = event.get("event")
                now = time.perf_counter() - t_start
                if kind == "start":
                    windows[int(event.get("setup", 0))] = [now, now]
                elif kind in ("step", "done") and int(event.get("setup", 0)) in windows:
                    window = windows[int(event.get("setup", 0))]
                    if kind == "step" and int(event.get("step", 0)) == 1:
                        window[0] = now  # training starts after the codec's pre-warm-up
                    window[1] = now
                if bar is None or kind != "step":
                    return
                idx = int(event.get("setup", 0))
                step = int(event.get("step", 0))
                bar.update(max(0, step - seen.get(idx, 0)))
                seen[idx] = step
                bar.set_postfix_str(str(event.get("label", group.label(""))))

            gdir = None if work_dir is None else Path(work_dir) / f"group{gi}"
            with error_context(f"running group {group.label('').strip()}"):
                results = run_setups(
                    setups, nodes=group.nodes, procs_per_node=group.procs_per_node,
                    bandwidth=group.bandwidth, use_cluster=use_cluster, steps=steps,
                    batch_size=bs, model=model, timing_skip=timing_skip,
                    eval_every=steps + 1, eval_batches=1, work_dir=gdir, progress=on_event,
                )
            wait_for_quiet()
            t0 = time.perf_counter()
            after = pool.measure(benchmark_steps)
            t_after = 0.5 * (t0 + time.perf_counter()) - t_start
            bench_wall += time.perf_counter() - t0
            samples = (before, after)
            profiles.append(PlatformProfile(
                processes=ws, threads=pool.threads,
                forward_s=statistics.fmean(x[0] for x in samples),
                backward_s=statistics.fmean(x[1] for x in samples),
                optimizer_s=statistics.fmean(x[2] for x in samples),
                speeds=speeds_by_size[ws], wall_s=bench_wall, cores=os.cpu_count() or 1,
                samples=samples, sample_times=(t_before, t_after),
            ))
            for i, (codec, res) in enumerate(zip(group.codecs, results, strict=True)):
                if res.network.get("mode") != "emulated" and use_cluster:
                    raise CommpressError(f"{res.label} did not run on the emulated cluster: "
                                         f"{res.network.get('note')}")
                runs.append(Run(
                    group_index=gi, codec=codec, label=res.label,
                    measured_s=res.step_time_median,
                    spread_s=tuple(res.step_time_spread),  # type: ignore[arg-type]
                    step_times=list(res.step_times), steady_from=res.steady_from,
                    bits_per_coord=res.bits_per_coord,
                    replicas_identical=res.replicas_identical,
                    window_s=tuple(windows[i]) if i in windows else None,  # type: ignore[arg-type]
                ))
                if bar is not None:  # steps the progress file did not report
                    bar.update(max(0, steps - seen.get(i, 0)))
                    seen[i] = steps
            if log is not None:
                log(f"{group.label('').strip()}: compute {profiles[-1].compute_s * 1e3:.0f} ms "
                    f"(before {sum(before) * 1e3:.0f}, after {sum(after) * 1e3:.0f}); " +
                    ", ".join(f"{r.codec} {r.measured_s * 1e3:.0f} ms"
                              for r in runs[-len(results):]))
    finally:
        if pool is not None:
            pool.__exit__()
        if bar is not None:
            bar.close()
    return ValidationRun(
        groups=list(groups), profiles=profiles, runs=runs, model=model, steps=steps,
        batch_size=batch_size, hook=hook, date=time.strftime("%Y-%m-%d %H:%M"),
        wall_s=time.perf_counter() - t_start, load=loads,
    )


# ------------------------------------------------------------------ analysis
def model_setup(run: ValidationRun, r: Run) -> Setup:
    """The performance-model :class:`Setup` of one measured run (step 3 of the algorithm)."""
    group = run.groups[r.group_index]
    profile = run.profiles[r.group_index]
    buckets = ddp_buckets(_model_shapes(run.model))
    fwd, bwd, upd = profile.compute_at(r.steady_mid_s)
    workload = Workload(
        buckets=tuple(tuple(b) for b in buckets), forward_s=fwd, backward_s=bwd,
        optimizer_s=upd, name=f"{run.model} GPT",
    )

    rate = parse_bandwidth(group.bandwidth)
    cluster = Cluster.build(
        nodes=group.nodes, gpus_per_node=group.procs_per_node, inter_bw=rate * 8,
        inter_latency=BASE_LATENCY_S, inter_efficiency=TCP_EFFICIENCY,
        intra_bw="10gbit", intra_latency=BASE_LATENCY_S,
        inter_burst=choose_burst(rate * 8),  # the emulated links' tbf bucket
    )

    codec, strategy = parse_setup_spec(r.codec)
    return Setup(
        workload=workload, cluster=cluster, codec=codec, strategy=strategy, label=r.label,
        hook=run.hook, speeds=SpeedTable.builtin().merged(profile.speeds),
        contention=profile.contention,
        extra={"codec": r.codec, "strategy": strategy, "nodes": group.nodes,
               "bandwidth": group.bandwidth, "procs_per_node": group.procs_per_node},
    )


_SHAPES: dict[str, list[tuple[int, ...]]] = {}


def _model_shapes(model: str) -> list[tuple[int, ...]]:
    if model not in _SHAPES:
        net = build_model(preset(model), seed=0)
        _SHAPES[model] = [tuple(p.shape) for p in net.parameters() if p.requires_grad]
    return _SHAPES[model]


def _split_key(m: Measurement) -> tuple[Any, ...]:

    e = m.setup.extra
    return (str(e.get("codec", m.setup.codec)), int(e.get("nodes", m.setup.cluster.nodes)),
            int(e.get("procs_per_node", 1)),
            parse_bandwidth(e["bandwidth"]) if "bandwidth" in e else 0.0, m.setup.label)


def split(measurements: Sequence[Measurement]) -> tuple[list[Measurement], list[Measurement]]:
    """Fit and holdout halves: sorted by codec, layout and bandwidth, dealt alternately (step
    4). Each codec's runs alternate between the halves, and because the deal carries on
    across codecs, a codec with an odd number of runs hands the next codec's first run to the
    other half; so every codec and most clusters appear in both halves. No run is in both."""
    if len(measurements) < 2:
        raise CommpressError(f"need at least 2 measured setups to split, got "
                             f"{len(measurements)}")
    ordered = sorted(measurements, key=_split_key)
    return ordered[0::2], ordered[1::2]


def fit_names(n_fit: int, names: Sequence[str] = VALIDATION_FIT) -> tuple[str, ...]:
    """The constants to fit with ``n_fit`` measurements: at most ``n_fit // 2`` (two
    measurements per constant), in :data:`VALIDATION_FIT`'s priority order, at least one."""
    return tuple(names[: max(1, min(len(names), n_fit // 2))])


@dataclass(frozen=True)
class Analysis:
    """Result of :func:`analyse`.

    Attributes:
        calibration: the fit (on the fit half) and the reports on both halves.
        ideal: the uncalibrated model's report on the holdout half (for comparison).
        measurements: every measurement, in run order.
    """

    calibration: CalibrationResult
    ideal: ValidationReport
    measurements: tuple[Measurement, ...]

    @property
    def holdout(self) -> ValidationReport:
        return self.calibration.holdout_report

    def passes(self, median: float = 0.10, worst: float = 0.25) -> bool:
        return self.holdout.passes(median, worst)


def analyse(run: ValidationRun, *, fit: Sequence[str] | None = None,
            max_iter: int = 400) -> Analysis:
    """Fit on one half of ``run``'s setups and validate on the other (steps 3-4)."""
    measurements = [Measurement(model_setup(run, r), r.measured_s) for r in run.runs
                    if math.isfinite(r.measured_s) and r.measured_s > 0]
    if len(measurements) < 2:
        raise CommpressError(f"need at least 2 measured setups, got {len(measurements)}")
    fit_half, holdout = split(measurements)
    names = tuple(fit) if fit is not None else fit_names(len(fit_half))
    # Constants not fitted stay ideal; fitted ones start inside their range so the search can
    # move both ways.
    initial: dict[str, Any] = {"overlap_efficiency": 0.8, "collective_overhead_s": 1e-3,
                               "message_latency_s": 1e-4}
    start = Platform(**{k: v for k, v in initial.items() if k in names})
    result: FitResult = fit_platform(fit_half, fit=names, start=start, max_iter=max_iter,
                                     name=f"fitted on {len(fit_half)} runs")
    calibration = CalibrationResult(
        fit=result,
        fit_report=validate(fit_half, result.platform),
        holdout_report=validate(holdout, result.platform),
    )
    return Analysis(calibration, validate(holdout, Platform()), tuple(measurements))


# ------------------------------------------------------------------ output
def report_rows(analysis: Analysis) -> list[dict[str, Any]]:
    """One row per setup: label, half, predicted, measured, signed error."""
    rows: list[dict[str, Any]] = []
    for half, rep in (("fit", analysis.calibration.fit_report), ("holdout", analysis.holdout)):
        for r in rep.rows:
            rows.append({"label": r.label, "half": half, "predicted_s": r.predicted_s,
                         "measured_s": r.measured_s, "error": r.error})
    order = {m.setup.label: i for i, m in enumerate(analysis.measurements)}
    rows.sort(key=lambda row: order.get(row["label"], 0))
    return rows


def table(analysis: Analysis, run: ValidationRun | None = None) -> str:
    """The predicted-vs-measured table and the summary lines (with ``run``, also the
    machine's load during the measurements)."""

    rows = report_rows(analysis)
    body = render_table(
        ["setup", "half", "predicted", "measured", "error"],
        [[r["label"], r["half"], format_seconds(r["predicted_s"]),
          format_seconds(r["measured_s"]), f"{r['error']:+.1%}"] for r in rows],
    )
    hold, fitrep = analysis.holdout, analysis.calibration.fit_report
    p = analysis.calibration.fit.platform
    lines = [
        body,
        "",
        f"fitted on {len(fitrep.rows)} runs ({', '.join(analysis.calibration.fit.fitted)}): "
        + platform_summary(p),
        f"fit half:     median |error| {fitrep.median_abs_error:.1%}, worst "
        f"{fitrep.worst_abs_error:.1%}",
        f"holdout half: median |error| {hold.median_abs_error:.1%}, worst "
        f"{hold.worst_abs_error:.1%} over {len(hold.rows)} runs "
        f"(goal 10% / 25%: {'met' if analysis.passes() else 'NOT met'})",
        f"uncalibrated model on the holdout: median |error| "
        f"{analysis.ideal.median_abs_error:.1%}, worst {analysis.ideal.worst_abs_error:.1%}",
    ]
    loads = [x for x in (run.load if run is not None else []) if math.isfinite(x)]
    if loads:
        cores = run.profiles[0].cores if run is not None and run.profiles else os.cpu_count()
        lines.append(
            f"machine load (1-minute average) before each launch: {min(loads):.1f} to "
            f"{max(loads):.1f} on {cores} cores (this run's own processes included; other "
            "jobs on the machine make the measurements noisy)"
        )
    return "\n".join(lines)


def platform_summary(p: Platform) -> str:

    return (f"overlap efficiency {p.overlap_efficiency:.2f}, collective overhead "
            f"{format_seconds(p.collective_overhead_s)}, bandwidth x"
            f"{p.inter_bandwidth_scale:.3f}, codec time x{p.codec_time_scale:.2f}, message "
            f"latency {format_seconds(p.message_latency_s)}, compute time "
            f"x{p.compute_time_scale:.2f}")


def report_dict(run: ValidationRun, analysis: Analysis) -> dict[str, Any]:
    """JSON report: the summary, every row, the fitted platform and the raw measurements."""
    hold = analysis.holdout
    fitrep = analysis.calibration.fit_report
    return {
        "format": "commpress-validation-report/1",
        "summary": {
            "setups": len(analysis.measurements),
            "fit_setups": len(fitrep.rows),
            "holdout_setups": len(hold.rows),
            "holdout_median_abs_error": hold.median_abs_error,
            "holdout_worst_abs_error": hold.worst_abs_error,
            "fit_median_abs_error": fitrep.median_abs_error,
            "fit_worst_abs_error": fitrep.worst_abs_error,
            "uncalibrated_holdout_median_abs_error": analysis.ideal.median_abs_error,
            "uncalibrated_holdout_worst_abs_error": analysis.ideal.worst_abs_error,
            "goal_met": analysis.passes(),
            "fitted": list(analysis.calibration.fit.fitted),
        },
        "platform": analysis.calibration.fit.platform.to_dict(),
        "rows": report_rows(analysis),
        "measurements": run.to_dict(),
    }


def plot(analysis: Analysis, path: str | Path) -> None:
    """Scatter of predicted against measured (log-log): holdout filled, fit half hollow, the
    diagonal and the +-10% and +-25% bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report_rows(analysis)
    if not rows:
        raise CommpressError("nothing to plot")
    codecs = sorted({r["label"].split(" ", 2)[-1] for r in rows})
    colours = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(codecs)}
    xs = [1e3 * r["measured_s"] for r in rows] + [1e3 * r["predicted_s"] for r in rows]
    lo, hi = min(xs) / 1.3, max(xs) * 1.3
    fig, ax = plt.subplots(figsize=(6.4, 5.6), constrained_layout=True)
    line = [lo, hi]
    ax.plot(line, line, color="black", lw=1)
    for f, style in ((0.10, "--"), (0.25, ":")):
        ax.plot(line, [v * (1 + f) for v in line], color="grey", lw=0.8, ls=style)
        ax.plot(line, [v * (1 - f) for v in line], color="grey", lw=0.8, ls=style,
                label=f"+-{f:.0%}")
    for r in rows:
        codec = r["label"].split(" ", 2)[-1]
        hold = r["half"] == "holdout"
        ax.scatter(1e3 * r["measured_s"], 1e3 * r["predicted_s"], s=36,
                   facecolors=colours[codec] if hold else "none", edgecolors=colours[codec],
                   linewidths=1.2)
    for c in codecs:
        ax.scatter([], [], color=colours[c], label=c, s=36)
    ax.scatter([], [], facecolors="none", edgecolors="black", label="fit half", s=36)
    ax.scatter([], [], color="black", label="holdout half", s=36)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain)
        axis.set_tick_params(which="both", labelsize=7)
    ax.set_xlabel("measured iteration time (ms)")
    ax.set_ylabel("predicted iteration time (ms)")
    hold = analysis.holdout
    ax.set_title(f"commpress validate: holdout median |error| {hold.median_abs_error:.1%}, "
                 f"worst {hold.worst_abs_error:.1%}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "DEFAULT_CODECS",
    "RUN_FORMAT",
    "STRATEGY_SETUPS",
    "VALIDATION_FIT",
    "Analysis",
    "Group",
    "PlatformProfile",
    "Run",
    "ValidationRun",
    "analyse",
    "default_grid",
    "fit_names",
    "load_run",
    "measure_platform",
    "model_setup",
    "parse_group",
    "plot",
    "quick_grid",
    "report_dict",
    "run_validation",
    "save_run",
    "split",
    "table",
    "wait_for_quiet",
    "with_strategies",
]


def _main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m commpress.experiments.validation",
        description="Worker of commpress.experiments.validation.measure_platform (started by it; "
        "not meant to be run by hand). Use `commpress validate`.",
    )
    p.add_argument("--benchmark-worker", nargs=2, metavar=("CONFIG", "RANK"), required=True)
    args = p.parse_args(argv)
    return _benchmark_worker(args.benchmark_worker[0], int(args.benchmark_worker[1]))


if __name__ == "__main__":
    sys.exit(_main())
