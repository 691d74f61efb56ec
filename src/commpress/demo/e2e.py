"""End-to-end runs: train the built-in GPT with DDP across real processes, one codec per setup.

This is what ``commpress demo`` runs and what the performance model is validated against::

    from commpress.demo.e2e import run_setup, run_setups

    fp16 = run_setup("fp16", nodes=2, bandwidth="100mbit", steps=150)
    print(fp16.step_time_median, fp16.step_time_spread, fp16.final_eval_loss)

    results = run_setups(["fp16", "powersgd:rank=4", "sign"], world_size=2, steps=40)
    for r in results:
        print(r.label, r.bits_per_coord, r.time_to_loss(results[0].final_eval_loss + 0.02))

Where the processes run:

* ``nodes``/``bandwidth``/``latency`` given (or ``use_cluster=True``) and root + network
  namespaces available: an :class:`~commpress.cluster.EmulatedCluster` (one namespace per node,
  ``tc``-shaped links), one ``torchrun`` per node through :func:`commpress.cluster.launch`.
* Otherwise local processes on loopback (still one ``torchrun`` per "node", gloo over ``lo``);
  links are not shaped and :attr:`RunResult.network` says so in its ``note``.

All setups of one call share one launch (one cluster, one set of worker processes): every
worker runs the setups one after the other, each with a fresh model, optimizer and hook. A
setup may carry its own ``seed`` and ``steps``; with a ``stop_rule`` each seed's baseline run
sets time-to-accuracy targets (:mod:`commpress.demo.tta`) and that seed's later runs stop
once they have reached them all (``commpress demo``'s step budget). Rank 0
writes results as JSON (``results.json`` in ``work_dir``) after every setup; nothing is pickled
across processes.

What is measured, per setup:

* **step times**: each rank's wall-clock time of every step (forward, backward with the
  compressed all-reduce, clipping, optimizer), gathered after training; the step's time is the
  *maximum over ranks* (the slowest rank sets the pace of synchronous data parallelism).
  Evaluation and data slicing are not inside a step.
* **iteration time** (:attr:`RunResult.step_time_median`, :attr:`RunResult.step_time_spread`):
  median and 10th-90th percentiles over the steady steps, i.e. after the first
  ``timing_skip`` steps (one-off costs) and after the compression warm-up (which sends fp16).
* **training clock** (:attr:`RunResult.elapsed`): cumulative step time. The first
  ``timing_skip`` steps are charged at the median of the next five steps (their excess, JIT
  compilation and DDP's bucket rebuild, is kept in :attr:`RunResult.startup_s`), so a
  one-off start-up cost that a long run would amortize does not decide a short demo.
  :attr:`RunResult.eval_times_median_clock` reads the evaluations on :func:`median_clock`
  instead (every step at its phase's median step time), which load spikes cannot move.
* **eval loss** every ``eval_every`` steps on fixed validation windows (identical across
  setups), with the training clock at that step.
* **bytes**: the bytes of every tensor this rank hands to ``torch.distributed`` collectives
  during a step (the *collective input size*, as in "bits per coordinate" in the literature),
  per step; :attr:`RunResult.bits_per_coord` divides by the number of gradient elements. On an
  emulated cluster also the bytes node 0 really sent over its shaped link (headers included).
* **replicas**: a SHA-256 of all parameters on every rank after the last step; they must be
  equal (:attr:`RunResult.replicas_identical`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from commpress.errors import CommpressError, error_context, exit_status, read_json

#: Results file rank 0 writes in the work directory.
RESULTS_FILE = "results.json"
#: Progress events (one JSON object per line) rank 0 appends while training.
PROGRESS_FILE = "progress.jsonl"
#: Combined output of every worker and torchrun.
LOG_FILE = "workers.log"
#: Format version of the results JSON.
FORMAT_VERSION = 1

#: Codec-independent schedule of the demo runs (see :class:`Setup`).
DEFAULT_WARMUP_STEPS = 10
DEFAULT_MIN_NUMEL = 4096
DEFAULT_MIN_COMPRESSION_RATE = 2.0


# --------------------------------------------------------------------------------- setups
@dataclass(frozen=True)
class Setup:
    """One training run: a codec and how :func:`commpress.ddp.register` applies it.

    Attributes:
        codec: codec spec string, e.g. ``"powersgd:rank=4"`` or ``"fp16"``.
        label: name in tables and plots (default: ``codec``, or ``codec@strategy`` when the
            strategy is not ``auto``).
        error_feedback: ``None`` (automatic: on for lossy codecs except the fp16/bf16 casts),
            ``True`` or ``False``. Biased codecs (sign, top-k, PowerSGD) need it.
        warmup_steps: first steps sent as fp16 before the codec starts (ignored for the fp16
            and lossless codecs). 5-10% of a short run; PowerSGD and sign are the ones that
            need it most.
        min_numel: tensors with fewer elements (biases, LayerNorm gains) go as fp16 in one
            flat all-reduce instead of one compressed collective each. A few thousand suits
            the built-in models.
        min_compression_rate: tensors the codec shrinks less than this (input bytes / wire
            bytes) go as fp16; 2 means "only where it beats fp16".
        strategy: how the hook exchanges each tensor (``strategy=`` of
            :func:`commpress.ddp.register`): ``"auto"`` (the codec's own protocol),
            ``"allreduce"``, ``"allgather"``, ``"ring"``, ``"hierarchical"`` or
            ``"hierarchical-compress-first"``; the hierarchical ones take the launch's
            processes per node as the node size.
        seed: weights and data order of this run (``None``: the launch's ``seed``). Setups
            that differ only in seed are distinct runs of one launch.
        steps: optimizer steps of this run at most (``None``: the launch's ``steps``); with a
            ``stop_rule`` the run may end earlier (see :func:`run_setups`).
    """

    codec: str
    label: str | None = None
    error_feedback: bool | None = None
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    min_numel: int = DEFAULT_MIN_NUMEL
    min_compression_rate: float = DEFAULT_MIN_COMPRESSION_RATE
    strategy: str = "auto"
    seed: int | None = None
    steps: int | None = None

    @property
    def name(self) -> str:
        return self.label or setup_spec(self.codec, self.strategy)

    def check(self) -> dict[str, Any]:
        """Validate (building the codec once) and return the codec's full configuration."""
        from commpress.codecs.registry import get_codec

        if not isinstance(self.codec, str) or not self.codec.strip():
            raise CommpressError(
                f"a setup's codec must be a spec string like 'powersgd:rank=4', got {self.codec!r}"
            )
        if self.error_feedback not in (None, True, False):
            raise CommpressError(
                f"error_feedback must be True, False or None (automatic), got "
                f"{self.error_feedback!r}"
            )
        for name in ("warmup_steps", "min_numel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CommpressError(f"{name} must be a non-negative int, got {value!r}")
        for name, low in (("seed", 0), ("steps", 1)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < low):
                raise CommpressError(f"a setup's {name} must be None or an int >= {low}, "
                                     f"got {value!r}")
        rate = self.min_compression_rate
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate >= 0):
            raise CommpressError(f"min_compression_rate must be a number >= 0, got {rate!r}")
        with error_context(f"codec {self.codec!r}"):
            codec = get_codec(self.codec)
        from commpress.collectives.api import STRATEGIES
        from commpress.ddp import strategy_refusal

        if self.strategy not in STRATEGIES:
            raise CommpressError(
                f"unknown strategy {self.strategy!r} for {self.codec!r}; accepted: "
                f"{', '.join(STRATEGIES)}"
            )
        why = strategy_refusal(codec, self.strategy)
        if why is not None:
            raise CommpressError(f"setup {self.name!r}: {why}")
        return codec.get_config()


def setup_spec(codec: str, strategy: str = "auto") -> str:
    """``codec`` for strategy ``auto``, else ``codec@strategy`` (``"fp16@ring"``)."""
    return codec if strategy == "auto" else f"{codec}@{strategy}"


def parse_setup_spec(spec: str) -> tuple[str, str]:
    """``"fp16@ring"`` -> ``("fp16", "ring")``; a spec without ``@`` has strategy ``auto``."""
    codec, sep, strategy = spec.rpartition("@")
    if not sep:
        return spec, "auto"
    return codec, strategy.strip()


def as_setup(item: str | Setup | Mapping[str, Any]) -> Setup:
    """A :class:`Setup` from a spec string (``"powersgd:rank=4"``, ``"fp16@ring"`` for a
    strategy), a mapping of its fields, or a Setup."""
    if isinstance(item, Setup):
        return item
    if isinstance(item, str):
        codec, strategy = parse_setup_spec(item)
        return Setup(codec=codec, strategy=strategy)
    if isinstance(item, Mapping):
        try:
            return Setup(**dict(item))
        except TypeError as exc:
            raise CommpressError(
                f"bad setup {dict(item)!r}: {exc}; accepted keys: codec, label, "
                "error_feedback, warmup_steps, min_numel, min_compression_rate, strategy, "
                "seed, steps"
            ) from None
    raise CommpressError(
        f"a setup is a codec spec string, a Setup or a mapping, got {type(item).__name__}"
    )


# --------------------------------------------------------------------------------- results
def _percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]) of a non-empty sequence."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class RunResult:
    """Everything one setup measured (see the module doc for the definitions).

    Attributes:
        label, codec, codec_config: the setup (``codec_config`` is the full configuration).
        setup: the :class:`Setup` fields.
        world_size, nodes, procs_per_node: the process layout.
        network: ``{"mode": "emulated"|"local", "bandwidth": ..., "latency": ..., "note": ...}``.
        model, steps, batch_size, lr, seed: the training run (``batch_size`` is global).
        losses: rank 0's training loss of every step (its shard of the batch).
        step_times: per step, the maximum over ranks of the step's wall-clock seconds.
        step_times_by_rank: the per-rank measurements behind ``step_times``.
        timing_skip: first steps treated as start-up (see ``elapsed``).
        steady_from: first step counted in the iteration-time statistics.
        elapsed: training clock after each step (seconds, start-up excess removed).
        startup_s: what the first ``timing_skip`` steps took beyond their charge.
        eval_steps, eval_losses, eval_times: validation loss after ``eval_steps[i]`` steps,
            reached at training-clock time ``eval_times[i]``.
        bytes_per_step: bytes rank 0 handed to collectives in each step.
        grad_numel: gradient elements per step (all trainable parameters).
        link_bytes_per_step: bytes node 0 sent over its emulated link in each step, headers
            included (``None`` on local processes).
        plans: per codec id, how many tensors / elements it sent at the last step.
        checksums: SHA-256 (hex, 16 chars) of all parameters on each rank after training.
        wall_s: seconds the setup took in the workers (training, evaluation, checks).
    """

    label: str
    codec: str
    codec_config: dict[str, Any]
    setup: dict[str, Any]
    world_size: int
    nodes: int
    procs_per_node: int
    network: dict[str, Any]
    model: str
    steps: int
    batch_size: int
    lr: float
    seed: int
    losses: list[float]
    step_times: list[float]
    step_times_by_rank: list[list[float]]
    timing_skip: int
    steady_from: int
    elapsed: list[float]
    startup_s: float
    eval_steps: list[int]
    eval_losses: list[float]
    eval_times: list[float]
    bytes_per_step: list[int]
    grad_numel: int
    link_bytes_per_step: list[int] | None
    plans: dict[str, dict[str, int]]
    checksums: list[str]
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    # ---------------------------------------------------------------- derived statistics
    @property
    def steady_step_times(self) -> list[float]:
        """Step times from :attr:`steady_from` on (all steps if that leaves none)."""
        tail = self.step_times[self.steady_from :]
        return tail or self.step_times

    @property
    def step_time_median(self) -> float:
        """Median iteration time (s) over the steady steps (``nan`` without steps)."""
        times = self.steady_step_times
        return statistics.median(times) if times else math.nan

    @property
    def step_time_spread(self) -> tuple[float, float]:
        """10th and 90th percentile of the steady iteration times (s)."""
        times = self.steady_step_times
        if not times:
            return (math.nan, math.nan)
        return (_percentile(times, 10), _percentile(times, 90))

    @property
    def bytes_per_step_median(self) -> float:
        """Median collective input bytes per steady step (rank 0)."""
        tail = self.bytes_per_step[self.steady_from :] or self.bytes_per_step
        return float(statistics.median(tail)) if tail else math.nan

    @property
    def link_bytes_median(self) -> float | None:
        """Median bytes node 0 sent over its emulated link per steady step (``None``: local)."""
        if self.link_bytes_per_step is None:
            return None
        tail = self.link_bytes_per_step[self.steady_from :] or self.link_bytes_per_step
        return float(statistics.median(tail)) if tail else None

    @property
    def bits_per_coord(self) -> float:
        """Collective input bits per gradient element in a steady step."""
        if not self.grad_numel:
            return math.nan
        return 8.0 * self.bytes_per_step_median / self.grad_numel

    @property
    def final_eval_loss(self) -> float:
        """Validation loss after the last step (``nan`` if there was no evaluation)."""
        return self.eval_losses[-1] if self.eval_losses else math.nan

    @property
    def replicas_identical(self) -> bool:
        """Whether every rank ended with bit-identical parameters."""
        return bool(self.checksums) and len(set(self.checksums)) == 1

    @property
    def train_time(self) -> float:
        """Training clock at the last step (s)."""
        return self.elapsed[-1] if self.elapsed else 0.0

    @property
    def eval_times_median_clock(self) -> list[float]:
        """:attr:`eval_times` on :func:`median_clock` (each step at its phase's median)."""
        clock = median_clock(self.step_times, self.timing_skip, self.steady_from)
        return [clock[s - 1] if 0 < s <= len(clock) else 0.0 for s in self.eval_steps]

    def time_to_loss(self, target: float) -> float | None:
        """Training-clock seconds at the first evaluation with loss <= ``target``.

        ``None`` if no evaluation reached it. Resolution is one evaluation interval: the loss
        may have crossed the target up to ``eval_every`` steps earlier.
        """
        for t, loss in zip(self.eval_times, self.eval_losses, strict=True):
            if loss <= target:
                return t
        return None

    def steps_to_loss(self, target: float) -> int | None:
        """Steps at the first evaluation with loss <= ``target`` (``None``: never)."""
        for s, loss in zip(self.eval_steps, self.eval_losses, strict=True):
            if loss <= target:
                return s
        return None

    def summary(self) -> dict[str, Any]:
        """The headline numbers (what the demo table shows, before the target is known)."""
        lo, hi = self.step_time_spread
        return {
            "label": self.label,
            "bits_per_coord": self.bits_per_coord,
            "bytes_per_step": self.bytes_per_step_median,
            "link_bytes_per_step": self.link_bytes_median,
            "step_time_median_s": self.step_time_median,
            "step_time_p10_s": lo,
            "step_time_p90_s": hi,
            "final_eval_loss": self.final_eval_loss,
            "train_time_s": self.train_time,
            "replicas_identical": self.replicas_identical,
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (all fields plus :meth:`summary`)."""
        data = asdict(self)
        data["summary"] = self.summary()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunResult:
        """Inverse of :meth:`to_dict` (derived ``summary`` is ignored)."""
        names = {f for f in cls.__dataclass_fields__}
        missing = sorted(names - set(data) - {"extra"})
        if missing:
            raise CommpressError(f"run result is missing field(s): {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in names})


def load_results(path: str | os.PathLike[str]) -> list[RunResult]:
    """Read the ``results.json`` written by the workers (or by ``commpress demo``)."""
    data = read_json(path, f"run results from {path}")
    if not isinstance(data, dict) or data.get("format") != "commpress-e2e":
        raise CommpressError(f"{path} is not a commpress end-to-end results file")
    return [RunResult.from_dict(r) for r in data.get("results", [])]


# --------------------------------------------------------------------------------- runner
@dataclass(frozen=True)
class Layout:
    """Where the workers run (resolved from :func:`run_setups`'s arguments)."""

    nodes: int
    procs_per_node: int
    emulated: bool
    bandwidth: str | None
    latency: str | None
    note: str

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def network(self) -> dict[str, Any]:
        return {
            "mode": "emulated" if self.emulated else "local",
            "bandwidth": self.bandwidth if self.emulated else None,
            "latency": self.latency if self.emulated else None,
            "requested_bandwidth": self.bandwidth,
            "requested_latency": self.latency,
            "note": self.note,
        }


def resolve_layout(
    *,
    world_size: int | None,
    nodes: int | None,
    procs_per_node: int | None,
    bandwidth: str | float | None,
    latency: str | float | None,
    use_cluster: bool | None,
) -> Layout:
    """Decide nodes x processes and emulated vs local (see :func:`run_setups`)."""
    for name, value, low in (("world_size", world_size, 2), ("nodes", nodes, 1),
                             ("procs_per_node", procs_per_node, 1)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < low):
            raise CommpressError(f"{name} must be an int >= {low}, got {value!r}")
    wants_cluster = use_cluster is True or (
        use_cluster is None and (nodes is not None or bandwidth is not None or latency is not None)
    )
    if nodes is None:
        if wants_cluster:
            ppn = procs_per_node or 1
            nodes = max(2, (world_size or 2) // ppn)
        else:
            nodes = 1
    if procs_per_node is None:
        procs_per_node = 1 if wants_cluster or nodes > 1 else (world_size or 2)
    total = nodes * procs_per_node
    if world_size is not None and world_size != total:
        raise CommpressError(
            f"world_size={world_size} does not match nodes x procs_per_node = "
            f"{nodes} x {procs_per_node} = {total}; give one or the other"
        )
    if total < 2:
        raise CommpressError(
            f"data-parallel training needs at least 2 processes, got {nodes} node(s) x "
            f"{procs_per_node} process(es)"
        )
    bw = None if bandwidth is None else str(bandwidth)
    lat = None if latency is None else str(latency)
    if bw is not None or lat is not None:
        from commpress.cluster.shaping import LinkShape

        with error_context("link shape"):
            LinkShape.parse(bw, lat, None, None)
    if not wants_cluster:
        return Layout(nodes, procs_per_node, False, bw, lat,
                      "local processes on loopback: links are not shaped")
    from commpress.cluster import namespaces_available

    available, reason = namespaces_available()
    if not available:
        if use_cluster is True:
            raise CommpressError(f"cannot emulate a cluster: {reason}")
        return Layout(
            nodes, procs_per_node, False, bw, lat,
            f"local processes on loopback because {reason}: links are NOT shaped"
            + (" (requested " + ", ".join(x for x in (bw, lat) if x) + " ignored)"
               if bw or lat else ""),
        )
    if nodes < 2:
        raise CommpressError(f"an emulated cluster needs at least 2 nodes, got {nodes}")
    shape = ", ".join(x for x in (f"{bw} links" if bw else "unshaped links",
                                  f"{lat} RTT" if lat else "") if x)
    return Layout(nodes, procs_per_node, True, bw, lat,
                  f"emulated cluster: {nodes} node(s) x {procs_per_node} process(es), {shape}")


ProgressCallback = Callable[[dict[str, Any]], None]


def _tail_progress(path: Path, callback: ProgressCallback, stop: threading.Event) -> None:
    """Feed every complete JSON line appended to ``path`` to ``callback`` until ``stop``."""
    pos = 0
    buf = ""
    while True:
        done = stop.is_set()
        with contextlib.suppress(OSError):
            with open(path) as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos = fh.tell()
            buf += chunk
            *lines, buf = buf.split("\n")
            for line in lines:
                if line.strip():
                    with contextlib.suppress(json.JSONDecodeError):
                        callback(json.loads(line))
        if done:
            return
        stop.wait(0.2)


def _log_tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace").splitlines()
        keep = [ln for ln in text if "hostname of the client socket" not in ln]
        return "\n".join(keep[-lines:])
    return "(no worker log)"


def run_setups(
    setups: Sequence[str | Setup | Mapping[str, Any]],
    *,
    world_size: int | None = None,
    nodes: int | None = None,
    procs_per_node: int | None = None,
    bandwidth: str | float | None = None,
    latency: str | float | None = None,
    use_cluster: bool | None = None,
    steps: int = 150,
    batch_size: int = 16,
    model: str = "tiny",
    seed: int = 0,
    lr: float | None = None,
    eval_every: int = 10,
    eval_batches: int = 8,
    timing_skip: int = 2,
    corpus_bytes: int = 2_000_000,
    threads: int | None = None,
    timeout_s: float | None = None,
    hook_timeout_s: float = 300.0,
    work_dir: str | os.PathLike[str] | None = None,
    progress: ProgressCallback | None = None,
    log: IO[str] | None = None,
    stop_rule: Mapping[str, Any] | None = None,
    cluster: Any = None,
) -> list[RunResult]:
    """Train the built-in GPT once per setup with DDP across real processes; measure each.

    Algorithm:

    1. Validate every setup (building its codec) and resolve the layout: an emulated cluster
       when ``nodes``/``bandwidth``/``latency`` or ``use_cluster=True`` ask for one and root +
       namespaces are available; local processes on loopback otherwise (with a note).
    2. Write the worker configuration to ``work_dir`` and start the workers with
       :func:`commpress.cluster.launch` (one ``torchrun`` per node, gloo).
    3. In every worker, for each setup in order: build a fresh model (same seed), wrap it in
       DDP, :func:`commpress.ddp.register` the codec, train ``steps`` steps counting the bytes
       handed to collectives and timing every step, evaluate every ``eval_every`` steps;
       gather the per-rank step times and parameter checksums; rank 0 appends the result to
       ``results.json`` and reports progress lines to ``progress.jsonl``.
    4. Read ``results.json`` back. A failed or timed-out launch raises
       :class:`CommpressError` with the tail of the worker log (``workers.log``).

    Args:
        setups: codec spec strings (``"powersgd:rank=4"``), :class:`Setup` objects or
            mappings of Setup fields. All run in one launch, in order.
        world_size: total processes (default 2). With ``nodes``, must equal
            ``nodes * procs_per_node``.
        nodes, procs_per_node: emulated nodes and processes per node (default 2 x 1 when a
            cluster is requested). On a 2-core machine keep the total at 2: more processes
            only time-share the cores.
        bandwidth: each node's link rate, e.g. ``"100mbit"`` (tc units). Pick it so that the
            fp16 gradient exchange takes at least as long as the computation, or compression
            cannot matter: the tiny model's fp16 gradients are 1.7 MB, ~0.14 s at 100 Mbit/s.
        latency: round-trip time between nodes (``"1ms"``); needs the kernel's netem.
        use_cluster: ``None`` (emulate when asked for and possible), ``True`` (must emulate),
            ``False`` (always local processes).
        steps: optimizer steps per setup; the same for every setup, so final losses compare
            at equal data. 150 tiny-model steps reach ~2.5 nats/byte.
        batch_size: global rows per step (multiple of the world size).
        model: preset ``"tiny"`` (0.87 M parameters) or ``"small"`` (4.9 M) (or ``"medium"``).
        seed: weights and data order, identical for every setup.
        lr: AdamW peak learning rate (default 3e-3 for tiny, 1e-3 otherwise).
        eval_every: steps between validation losses; the time-to-accuracy resolution.
        eval_batches: validation batches of ``batch_size`` windows each (fixed windows).
            8 x 16 windows x 64 bytes = 8 KB of text; more is steadier and slower.
        timing_skip: first steps treated as start-up cost (JIT compilation, DDP bucket
            rebuild); see the module doc. 2 covers both.
        corpus_bytes: bytes of stdlib source to train on.
        threads: torch threads per worker (default: CPU cores / world size, at least 1).
        timeout_s: the whole launch's limit (default: generous, from steps and setups).
        hook_timeout_s: a collective waiting longer than this for a peer raises instead of
            hanging.
        work_dir: where configuration, results, progress and log go (default: a temporary
            directory, removed afterwards).
        progress: called in this process with every progress event (dicts with ``event`` =
            ``"start"``, ``"step"``, ``"eval"`` or ``"done"``, plus ``setup`` index, ``label``,
            ``step``, ``loss``...).
        log: where worker output goes in addition to ``workers.log`` (default: only the file).
        stop_rule: early stopping for time-to-accuracy runs, a mapping ``{"baseline": label,
            "fractions": [...], "window": 3}``: when the setup labelled ``baseline`` of a seed
            has run, its targets are taken
            (:func:`commpress.demo.tta.targets_from_baseline`), and every later setup of the
            same seed stops at the first evaluation after its smoothed curve has settled
            below all of them (:func:`commpress.demo.tta.reached_all`), or at its ``steps``.
            ``None`` (default): every setup runs all its steps.
        cluster: an :class:`~commpress.cluster.EmulatedCluster` that is already up to run on
            (its layout must match); it is left up. Lets a caller measure the links first.

    Returns:
        One :class:`RunResult` per setup, in order.
    """
    from commpress.cluster import launch
    from commpress.demo.model import preset

    if not setups:
        raise CommpressError("run_setups needs at least one setup (a codec spec string)")
    parsed = [as_setup(s) for s in setups]
    configs = [s.check() for s in parsed]
    labels = [s.name for s in parsed]
    keyed = [(s.name, s.seed) for s in parsed]
    if len(set(keyed)) != len(keyed):
        raise CommpressError(f"setup labels must be distinct (per seed), got {labels}")
    if stop_rule is not None:
        from commpress.demo.tta import check_fractions

        if not isinstance(stop_rule, Mapping) or "baseline" not in stop_rule:
            raise CommpressError("stop_rule must be a mapping with a 'baseline' label")
        check_fractions(stop_rule.get("fractions") or (1.0,))
    preset(model)  # validates the name
    for name, value, low in (("steps", steps, 1), ("batch_size", batch_size, 1),
                             ("eval_every", eval_every, 1), ("eval_batches", eval_batches, 1),
                             ("timing_skip", timing_skip, 0), ("corpus_bytes", corpus_bytes, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise CommpressError(f"{name} must be an int >= {low}, got {value!r}")
    if lr is None:
        lr = 3e-3 if model == "tiny" else 1e-3
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise CommpressError(f"lr must be a positive number, got {lr!r}")
    layout = resolve_layout(world_size=world_size, nodes=nodes, procs_per_node=procs_per_node,
                            bandwidth=bandwidth, latency=latency, use_cluster=use_cluster)
    if batch_size % layout.world_size:
        raise CommpressError(
            f"batch_size {batch_size} must be a multiple of the world size {layout.world_size}"
        )
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // layout.world_size)
    if timeout_s is None:
        total_steps = sum(s.steps or steps for s in parsed)
        timeout_s = 300.0 + 5.0 * total_steps * (1 if model == "tiny" else 4)

    owned = work_dir is None
    base = Path(tempfile.mkdtemp(prefix="commpress-e2e-") if owned else work_dir)  # type: ignore[arg-type]
    base.mkdir(parents=True, exist_ok=True)
    results_path = base / RESULTS_FILE
    progress_path = base / PROGRESS_FILE
    log_path = base / LOG_FILE
    for stale in (results_path, progress_path):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    progress_path.touch()
    config = {
        "setups": [{**asdict(s), "codec_config": c} for s, c in zip(parsed, configs, strict=True)],
        "model": model, "steps": steps, "batch_size": batch_size, "lr": float(lr),
        "seed": seed, "eval_every": eval_every, "eval_batches": eval_batches,
        "timing_skip": timing_skip, "corpus_bytes": corpus_bytes, "threads": threads,
        "hook_timeout_s": hook_timeout_s, "nodes": layout.nodes,
        "procs_per_node": layout.procs_per_node, "network": layout.network(),
        "results_path": str(results_path.resolve()),
        "progress_path": str(progress_path.resolve()),
        "stop_rule": dict(stop_rule) if stop_rule is not None else None,
    }
    config_path = base / "config.json"
    config_path.write_text(json.dumps(config, indent=1))

    stop = threading.Event()
    tail = None
    if progress is not None:
        tail = threading.Thread(target=_tail_progress, args=(progress_path, progress, stop),
                                daemon=True)
        tail.start()
    cmd = [sys.executable, "-m", "commpress.demo.e2e", "--worker", str(config_path.resolve())]
    # numba's parallel kernels (used by several codecs on CPU) must not use more threads than
    # the worker's share of the cores: oversubscribed, they slow down by orders of magnitude.
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads),
           "NUMBA_NUM_THREADS": str(threads)}
    try:
        with open(log_path, "w") as log_fh:
            out: Any = _Tee(log_fh, log) if log is not None else log_fh
            if cluster is not None:
                from commpress.cluster.launcher import launch_on

                code = launch_on(cluster, cmd, timeout_s=timeout_s, env=env, stdout=out,
                                 stderr=out)
            else:
                code = launch(
                    cmd, nodes=layout.nodes, procs_per_node=layout.procs_per_node,
                    bandwidth=layout.bandwidth if layout.emulated else None,
                    latency=layout.latency if layout.emulated else None,
                    use_netns=layout.emulated, timeout_s=timeout_s, env=env,
                    stdout=out, stderr=out,
                )
    finally:
        stop.set()
        if tail is not None:
            tail.join(5.0)
    try:
        if code != 0:
            why = {124: f"timed out after {timeout_s:g} s", 130: "interrupted"}.get(
                code, f"exited with code {code}")
            done = []
            if results_path.exists():
                with contextlib.suppress(CommpressError):
                    done = [r.label for r in load_results(results_path)]
            raise CommpressError(
                f"the training workers {why} (completed setups: {', '.join(done) or 'none'}; "
                f"full log: {log_path}). Last worker output:\n{_log_tail(log_path)}"
            )
        results = load_results(results_path)
        if len(results) != len(parsed):
            raise CommpressError(
                f"workers exited cleanly but reported {len(results)} of {len(parsed)} setups; "
                f"see {log_path}"
            )
        return results
    finally:
        if owned and code == 0:
            import shutil

            shutil.rmtree(base, ignore_errors=True)


def run_setup(codec: str | Setup | Mapping[str, Any], **kwargs: Any) -> RunResult:
    """:func:`run_setups` with a single setup; same keyword arguments."""
    return run_setups([codec], **kwargs)[0]


class _Tee:
    """A minimal text sink writing to two streams (the log file and the user's stream)."""

    def __init__(self, first: IO[str], second: IO[str]) -> None:
        self.first, self.second = first, second

    def write(self, text: str) -> int:
        self.first.write(text)
        self.second.write(text)
        return len(text)

    def flush(self) -> None:
        self.first.flush()
        self.second.flush()


# --------------------------------------------------------------------------------- worker
class CollectiveBytes:
    """Counts the bytes of tensors this process hands to ``torch.distributed`` collectives.

    While installed (a context manager), ``all_reduce``, ``all_gather``,
    ``all_gather_into_tensor``, ``broadcast``, ``send``, ``isend`` and ``batch_isend_irecv``
    (its sends) of the ``torch.distributed`` module are wrapped: each call adds its *input*
    tensor's byte size (``numel * element_size``) to :attr:`total`, then runs the original.
    This is the "collective input size" of the compression literature, measured on the real
    calls the DDP
    hook makes (including dtype widening and padding the transport adds). The wire traffic of
    a ring all-reduce is about ``2 (n-1)/n`` times it per rank, of an all-gather ``(n-1)``
    times it; at 2 workers both are 1x.
    """

    _INPUT_ARG = {
        "all_reduce": 0,
        "all_gather": 1,
        "all_gather_into_tensor": 1,
        "broadcast": 0,
        "send": 0,
        "isend": 0,
        "batch_isend_irecv": 0,
    }

    def __init__(self) -> None:
        self.total = 0
        self.calls = 0
        self._lock = threading.Lock()
        self._saved: dict[str, Any] = {}

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        index = self._INPUT_ARG[name]
        keyword = "input_tensor" if name == "all_gather_into_tensor" else "tensor"

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if name == "batch_isend_irecv":  # the sends of a list of P2POp
                import torch.distributed.distributed_c10d as c10d

                ops = args[0] if args else kwargs.get("p2p_op_list", [])
                nbytes = sum(
                    op.tensor.numel() * op.tensor.element_size()
                    for op in ops
                    if op.op is c10d.isend
                )
                with self._lock:
                    self.total += nbytes
                    self.calls += 1
                return original(*args, **kwargs)
            tensor = args[index] if len(args) > index else kwargs.get(keyword)
            nbytes = tensor.numel() * tensor.element_size() if tensor is not None else 0
            with self._lock:
                self.total += nbytes
                self.calls += 1
            return original(*args, **kwargs)

        return counted

    def __enter__(self) -> CollectiveBytes:
        import torch.distributed as dist

        for name in self._INPUT_ARG:
            original = getattr(dist, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()


def link_tx_bytes(interface: str) -> int | None:
    """Bytes sent so far by ``interface`` in this process's network namespace.

    Read from ``/proc/self/net/dev`` (per network namespace, unlike ``/sys/class/net``, which
    shows the namespace sysfs was mounted in). ``None`` if the interface is not there.
    """
    with contextlib.suppress(OSError), open("/proc/self/net/dev") as fh:
        for line in fh.readlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() == interface:
                return int(fields.split()[8])
    return None


def _params_digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(dtype=_u8()).numpy().tobytes())
    return h.hexdigest()[:16]


def _u8() -> Any:
    import torch

    return torch.uint8


def _write_json_atomic(path: str, data: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


@contextlib.contextmanager
def _progress_writer(path: str | None) -> Iterator[Callable[..., None]]:
    if path is None:
        yield lambda **_: None
        return
    with open(path, "a") as fh:

        def emit(**event: Any) -> None:
            fh.write(json.dumps(event) + "\n")
            fh.flush()

        yield emit


def _gather_floats(values: Sequence[float], world_size: int) -> list[list[float]]:
    import torch
    import torch.distributed as dist

    mine = torch.tensor(list(values), dtype=torch.float64)
    bufs = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(bufs, mine)
    return [b.tolist() for b in bufs]


def _gather_digests(digest: str, world_size: int) -> list[str]:
    import torch
    import torch.distributed as dist

    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8)
    bufs = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(bufs, mine)
    return [bytes(b.tolist()).hex() for b in bufs]


def elapsed_clock(step_times: Sequence[float], timing_skip: int) -> tuple[list[float], float]:
    """Training clock after each step, and the start-up excess taken out of it.

    The first ``timing_skip`` steps are charged at the median of the following five steps
    (or of what exists); a step shorter than that charge keeps its own time.
    """
    times = list(step_times)
    skip = min(timing_skip, len(times))
    ref = times[skip : skip + 5]
    charge = statistics.median(ref) if ref else None
    clock: list[float] = []
    total = 0.0
    excess = 0.0
    for i, t in enumerate(times):
        c = min(t, charge) if (i < skip and charge is not None) else t
        excess += t - c
        total += c
        clock.append(total)
    return clock, excess


def median_clock(step_times: Sequence[float], timing_skip: int, steady_from: int) -> list[float]:
    """A training clock that load spikes cannot move: every step charged at its phase's median.

    Two phases: the steps before ``steady_from`` (start-up and the fp16 warm-up) and the
    steady steps from it on. A step is charged the median of its phase's step times, leaving
    out the first ``timing_skip`` steps (one-off costs); a phase with no such steps is charged
    the other phase's median. The clock after step ``i`` is the sum of the charges up to it,
    so a time to target becomes (in effect) steps to target x the run's typical step time.
    """
    times = list(step_times)
    if not times:
        return []
    skip = min(max(0, timing_skip), len(times))
    start = min(max(skip, steady_from), len(times))
    early, steady = times[skip:start], times[start:]
    if not early and not steady:
        early = steady = times
    m_early = statistics.median(early) if early else statistics.median(steady)
    m_steady = statistics.median(steady) if steady else m_early
    clock: list[float] = []
    total = 0.0
    for i in range(len(times)):
        total += m_early if i < start else m_steady
        clock.append(total)
    return clock


def _initial_eval(cfg: Mapping[str, Any], corpus: bytes, seed: int | None = None) -> float:
    """Validation loss of the untrained model (the same for every setup of one seed)."""
    from commpress.demo.data import eval_loss
    from commpress.demo.model import build_model, preset

    config = preset(cfg["model"])
    model = build_model(config, seed=int(cfg["seed"]) if seed is None else seed)
    return eval_loss(model, corpus, context=config.context, batch_size=int(cfg["batch_size"]),
                     n_batches=int(cfg["eval_batches"]), device="cpu")


def _prewarm(codec: Any, cfg: Mapping[str, Any], min_numel: int) -> float:
    """Run ``codec`` once (in-process, 2 simulated workers) on every distinct parameter shape
    it will see, so one-off costs (numba compilation or cache loading, first-call dispatch)
    happen before the timed steps, as they would early in a long run. Returns the seconds."""
    import torch

    from commpress.codecs import simulate
    from commpress.demo.model import build_model, preset

    t0 = time.perf_counter()
    shapes = sorted({tuple(p.shape) for p in build_model(preset(cfg["model"]), seed=0).parameters()
                     if p.numel() >= min_numel})
    gen = torch.Generator().manual_seed(0)
    for shape in shapes:
        simulate(codec, [torch.randn(shape, generator=gen) for _ in range(2)], need_local=True)
    return time.perf_counter() - t0


def _label_of(setup: Mapping[str, Any]) -> str:
    return str(setup.get("label") or setup_spec(setup["codec"], setup.get("strategy", "auto")))


def _setup_seed(setup: Mapping[str, Any], cfg: Mapping[str, Any]) -> int:
    value = setup.get("seed")
    return int(cfg["seed"]) if value is None else int(value)


def _setup_steps(setup: Mapping[str, Any], cfg: Mapping[str, Any]) -> int:
    value = setup.get("steps")
    return int(cfg["steps"]) if value is None else int(value)


def _run_one(index: int, setup: Mapping[str, Any], cfg: Mapping[str, Any], corpus: bytes,
             initial_loss: float, emit: Callable[..., None],
             targets: Sequence[float] | None = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import commpress.ddp
    from commpress.codecs.registry import get_codec
    from commpress.collectives.strategies import get_strategy
    from commpress.demo.model import preset
    from commpress.demo.train import train

    rank, world = dist.get_rank(), dist.get_world_size()
    label = _label_of(setup)
    codec = get_codec(setup["codec"])
    strategy = str(setup.get("strategy", "auto"))
    dense = codec.codec_id in ("fp16", "bf16", "identity") or codec.lossless
    warmup = 0 if dense else int(setup["warmup_steps"])
    states: list[Any] = []

    def hook(ddp_model: Any) -> None:
        states.append(commpress.ddp.register(
            ddp_model, codec, error_feedback=setup["error_feedback"], warmup_steps=warmup,
            warmup_codec="fp16", min_numel=int(setup["min_numel"]),
            min_compression_rate=float(setup["min_compression_rate"]), fallback_codec="fp16",
            timeout=float(cfg["hook_timeout_s"]), strategy=strategy,  # type: ignore[arg-type]
            local_size=int(cfg["procs_per_node"])
            if get_strategy(strategy).needs_local_size else None,
        ))

    counter = CollectiveBytes()
    per_step: list[int] = []
    last = [0]
    steps = _setup_steps(setup, cfg)
    seed = _setup_seed(setup, cfg)
    rule = cfg.get("stop_rule") or {}
    stop: Callable[[list[tuple[int, float]]], bool] | None = None
    if targets:
        from commpress.demo.tta import reached_all

        window = int(rule.get("window", 3))

        def settled(evals: list[tuple[int, float]]) -> bool:
            return reached_all([0] + [s for s, _ in evals],
                               [initial_loss] + [v for _, v in evals], targets, window=window)

        stop = settled
    report_every = max(1, steps // 50)

    iface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    emulated = cfg["network"]["mode"] == "emulated"
    link: list[int] | None = [] if emulated and rank == 0 else None
    tx_last = [0]

    def on_step(step: int, model: Any, loss: float) -> None:
        per_step.append(counter.total - last[0])
        last[0] = counter.total
        if link is not None:
            tx = link_tx_bytes(iface) or 0
            link.append(tx - tx_last[0])
            tx_last[0] = tx
        if rank == 0 and ((step + 1) % report_every == 0 or step + 1 == steps):
            emit(event="step", setup=index, label=label, step=step + 1, loss=loss, seed=seed)

    emit(event="start", setup=index, label=label, seed=seed, max_steps=steps)
    t_start = time.perf_counter()
    prewarm_s = _prewarm(codec, cfg, int(setup["min_numel"]))
    dist.barrier()
    if link is not None:
        tx_last[0] = link_tx_bytes(iface) or 0
    with counter:
        res = train(
            preset(cfg["model"]), steps=steps, batch_size=int(cfg["batch_size"]),
            lr=float(cfg["lr"]), seed=seed, ddp_hook=hook,
            eval_every=int(cfg["eval_every"]), eval_batches=int(cfg["eval_batches"]),
            corpus=corpus, device="cpu", progress=False, on_step=on_step, stop=stop,
        )
    ran = len(res.step_times)
    by_rank = _gather_floats(res.step_times, world)
    assert res.model is not None
    digests = _gather_digests(_params_digest(res.model), world)
    step_times = [max(col) for col in zip(*by_rank, strict=True)]
    skip = int(cfg["timing_skip"])
    steady_from = min(max(skip, warmup), max(0, ran - 1))
    clock, excess = elapsed_clock(step_times, skip)
    plans: dict[str, dict[str, int]] = {}
    params = dict(res.model.named_parameters())
    if states:
        for key, plan in states[0].plans.items():
            entry = plans.setdefault(plan.codec.codec_id, {"tensors": 0, "numel": 0})
            entry["tensors"] += 1
            entry["numel"] += params[key].numel() if key in params else 0
    grad_numel = sum(p.numel() for p in res.model.parameters() if p.requires_grad)
    eval_steps = [0] + [s for s, _ in res.eval_losses]
    eval_values = [initial_loss] + [v for _, v in res.eval_losses]
    result = {
        "label": label,
        "codec": setup["codec"],
        "codec_config": setup["codec_config"],
        "setup": {**{k: setup[k] for k in ("codec", "label", "error_feedback", "warmup_steps",
                                           "min_numel", "min_compression_rate")},
                  "strategy": strategy, "seed": setup.get("seed"), "steps": setup.get("steps")},
        "world_size": world,
        "nodes": int(cfg["nodes"]),
        "procs_per_node": int(cfg["procs_per_node"]),
        "network": dict(cfg["network"]),
        "model": cfg["model"],
        "steps": ran,
        "batch_size": int(cfg["batch_size"]),
        "lr": float(cfg["lr"]),
        "seed": seed,
        "losses": res.losses,
        "step_times": step_times,
        "step_times_by_rank": by_rank,
        "timing_skip": skip,
        "steady_from": steady_from,
        "elapsed": clock,
        "startup_s": excess,
        "eval_steps": eval_steps,
        "eval_losses": eval_values,
        "eval_times": [clock[s - 1] if s > 0 else 0.0 for s in eval_steps],
        "bytes_per_step": per_step,
        "grad_numel": grad_numel,
        "link_bytes_per_step": link,
        "plans": plans,
        "checksums": digests,
        "wall_s": time.perf_counter() - t_start,
        "extra": {"warmup_steps_applied": warmup, "prewarm_s": prewarm_s,
                  "threads": torch.get_num_threads(), "collective_calls": counter.calls,
                  "max_steps": steps, "stopped_early": ran < steps,
                  "targets": list(targets) if targets else None},
    }
    if rank == 0:
        rr = RunResult.from_dict(result)
        emit(event="done", setup=index, seed=seed, steps=ran, max_steps=steps,
             stopped_early=ran < steps, **rr.summary())
    return result


def _baseline_targets(result: Mapping[str, Any], rule: Mapping[str, Any]) -> list[float]:
    """The targets a baseline run sets (:func:`commpress.demo.tta.targets_from_baseline`),
    computed on rank 0 and broadcast, so every rank stops the later runs at the same step."""
    import torch
    import torch.distributed as dist

    from commpress.demo.tta import DEFAULT_FRACTIONS, targets_from_baseline

    fractions = rule.get("fractions") or DEFAULT_FRACTIONS
    mine = targets_from_baseline(result["eval_steps"], result["eval_losses"],
                                 fractions=fractions, window=int(rule.get("window", 3)))
    buf = torch.tensor(mine, dtype=torch.float64)
    dist.broadcast(buf, src=0)
    return [float(v) for v in buf.tolist()]


def worker_main(config_path: str) -> int:
    """Body of every worker process (``python -m commpress.demo.e2e --worker CONFIG``)."""
    import torch
    import torch.distributed as dist

    from commpress.demo.data import stdlib_corpus

    with open(config_path) as fh:
        cfg = json.load(fh)
    torch.set_num_threads(int(cfg["threads"]))
    dist.init_process_group(backend="gloo")
    try:
        rank = dist.get_rank()
        corpus = stdlib_corpus(int(cfg["corpus_bytes"]))
        initial: dict[int, float] = {}
        rule = cfg.get("stop_rule") or {}
        targets: dict[int, list[float]] = {}
        results: list[dict[str, Any]] = []
        with _progress_writer(cfg["progress_path"] if rank == 0 else None) as emit:
            for i, setup in enumerate(cfg["setups"]):
                label = _label_of(setup)
                seed = _setup_seed(setup, cfg)
                if seed not in initial:
                    initial[seed] = _initial_eval(cfg, corpus, seed)
                is_base = bool(rule) and label == rule.get("baseline")
                try:
                    result = _run_one(i, setup, cfg, corpus, initial[seed], emit,
                                      None if is_base else targets.get(seed))
                    if is_base:
                        assert result is not None
                        targets[seed] = _baseline_targets(result, rule)
                except Exception as exc:
                    emit(event="error", setup=i, label=label, error=f"{type(exc).__name__}: {exc}")
                    raise
                if rank == 0 and result is not None:
                    results.append(result)
                    _write_json_atomic(cfg["results_path"], {
                        "format": "commpress-e2e", "version": FORMAT_VERSION,
                        "results": results,
                    })
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m commpress.demo.e2e",
        description="Worker of commpress.demo.e2e.run_setups (started by torchrun; not meant "
        "to be run by hand).",
    )
    p.add_argument("--worker", metavar="CONFIG", required=True,
                   help="worker configuration JSON written by run_setups")
    args = p.parse_args(argv)
    return worker_main(args.worker)


if __name__ == "__main__":
    sys.exit(exit_status(_main))


__all__ = [
    "CollectiveBytes",
    "Layout",
    "RunResult",
    "Setup",
    "as_setup",
    "elapsed_clock",
    "median_clock",
    "link_tx_bytes",
    "load_results",
    "parse_setup_spec",
    "resolve_layout",
    "run_setup",
    "run_setups",
    "setup_spec",
]
