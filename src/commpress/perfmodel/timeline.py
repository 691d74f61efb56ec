"""Per-bucket event timeline of one data-parallel training step, as PyTorch DDP overlaps it.

The step is simulated on three serial resources:

* ``gpu`` runs the forward pass, the backward pass (one segment per gradient bucket, in the
  order DDP's buckets become ready) and, unless offloaded, the codec work;
* ``net`` runs exchanges, one at a time and in bucket order (one communicator, as NCCL and
  gloo process groups issue collectives in submission order);
* ``offload`` runs codec work moved off the GPU (a compressing NIC such as SqueezeNIC, or a
  helper thread).

Every bucket has a *job*: a chain of :class:`Segment` (for example encode on ``gpu``, two
all-reduce rounds on ``net``, decode on ``gpu``), built by
:func:`commpress.perfmodel.codec_costs.exchange_segments`. Algorithm of :func:`simulate_step`:

1. ``forward`` then the backward segments ``b_0, b_1, ...`` run back to back on the GPU;
   bucket ``i``'s gradients are ready when ``b_i`` ends.
2. The first segment of job ``i`` is released when bucket ``i`` is ready **and** job
   ``i-1``'s first ``net`` segment has started (the encode of the next bucket overlaps the
   previous bucket's exchange, two buckets in flight). Each later segment of a job is released
   when the previous one ends. In *queue mode* (``queue_depth=d``, commpress's DDP hook, which
   reduces one bucket at a time on one thread, every tensor as its own job, ``d`` in flight)
   a bucket's first job also waits for every job of the earlier buckets to end, and job ``k``
   of a bucket for job ``k-d`` of the same bucket.
3. A job's first ``net`` segment also waits for the previous job's last ``net`` segment to end
   (exchanges are issued in bucket order).
4. Each resource runs its released segments non-preemptively, earliest release first; on a tie
   codec work goes before backward compute (DDP calls the comm hook before autograd launches
   the next bucket's kernels), then the lower bucket first.
5. The optimizer starts when the backward pass and every job are done; the step ends with it.
6. Communication hidden behind backward compute is not free on real hardware (communication
   kernels and the network stack slow compute down). With ``overlap_efficiency`` ``eta``,
   each second of communication (``net`` segments of kind ``comm``) that overlaps backward
   compute adds ``(1 - eta)`` seconds to the step: ``eta = 1`` is perfect overlap, ``eta = 0``
   makes overlap worthless, and ``eta < 0`` (down to :data:`MIN_OVERLAP_EFFICIENCY`) makes it
   worse than running the two one after the other (communication kernels that compete with
   backward for the GPU's memory bandwidth and SMs: Han et al.'s dense baselines need
   ``eta`` about -0.4). It is a per-platform constant, fitted by
   :mod:`commpress.perfmodel.calibration`.

The result carries a critical-path breakdown: walking back from the end, every second of the
step is attributed to compute, communication or codec work on the path, plus the overlap
penalty, so ``compute + exposed_comm + codec + overlap_penalty == total``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from commpress.errors import CommpressError

Resource: TypeAlias = Literal["gpu", "net", "offload"]
Kind: TypeAlias = Literal["compute", "comm", "codec"]
RESOURCES: tuple[str, ...] = ("gpu", "net", "offload")
KINDS: tuple[str, ...] = ("compute", "comm", "codec")
#: Lowest overlap efficiency: each overlapped second of communication costs at most 5.
MIN_OVERLAP_EFFICIENCY = -4.0


@dataclass(frozen=True, slots=True)
class Segment:
    """One piece of work on one resource.

    Attributes:
        resource: ``"gpu"``, ``"net"`` or ``"offload"``.
        seconds: duration (>= 0).
        kind: what it is for the breakdown: ``"compute"``, ``"comm"`` or ``"codec"``.
        label: free text for timelines and debugging.
        nbytes: for ``net`` segments, the bytes this rank pushes through its link (each
            direction), whose ``nbytes / bandwidth`` is part of ``seconds``; the timeline's
            token bucket (``token_bucket``) may pass some of them for free.
    """

    resource: str
    seconds: float
    kind: str
    label: str = ""
    nbytes: float = 0.0

    def __post_init__(self) -> None:
        if self.resource not in RESOURCES:
            raise CommpressError(
                f"segment resource must be one of {', '.join(RESOURCES)}, got {self.resource!r}"
            )
        if self.kind not in KINDS:
            raise CommpressError(f"segment kind must be one of {', '.join(KINDS)}, "
                                 f"got {self.kind!r}")
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise CommpressError(f"segment duration must be finite and >= 0, got {self.seconds!r}")
        if not (math.isfinite(self.nbytes) and self.nbytes >= 0):
            raise CommpressError(f"segment bytes must be finite and >= 0, got {self.nbytes!r}")


@dataclass(frozen=True, slots=True)
class Event:
    """A scheduled segment: ``bucket`` is -1 for forward/optimizer."""

    name: str
    resource: str
    kind: str
    bucket: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class StepTimeline:
    """Result of :func:`simulate_step`.

    Attributes:
        total: step time in seconds, overlap penalty included.
        compute, exposed_comm, codec: seconds of each kind on the critical path.
        overlap_penalty: ``(1 - eta) * overlapped``.
        overlapped: seconds of ``net`` time that overlap backward compute.
        comm_busy, codec_busy: total busy time of all comm / codec segments (on or off the
            critical path).
        events: every scheduled segment.
    """

    total: float
    compute: float
    exposed_comm: float
    codec: float
    overlap_penalty: float
    overlapped: float
    comm_busy: float
    codec_busy: float
    events: tuple[Event, ...] = field(repr=False, default=())

    def breakdown(self) -> dict[str, float]:
        return {
            "total": self.total,
            "compute": self.compute,
            "exposed_comm": self.exposed_comm + self.overlap_penalty,
            "codec": self.codec,
        }


@dataclass(slots=True)
class _Task:
    index: int
    name: str
    resource: str
    kind: str
    seconds: float
    bucket: int
    prio: int  # 0 codec/comm, 1 compute (ties: codec before compute)
    nbytes: float = 0.0
    end_deps: list[int] = field(default_factory=list)
    start_deps: list[int] = field(default_factory=list)
    successors: list[int] = field(default_factory=list)
    waiting: int = 0
    start: float = math.nan
    end: float = math.nan
    binding: int = -1  # task whose end (or start) fixed our start
    binding_is_start: bool = False


def _intervals_overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two unions of intervals."""

    def merged(xs: list[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for lo, hi in sorted(xs):
            if hi <= lo:
                continue
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        return out

    ma, mb = merged(a), merged(b)
    i = j = 0
    total = 0.0
    while i < len(ma) and j < len(mb):
        lo = max(ma[i][0], mb[j][0])
        hi = min(ma[i][1], mb[j][1])
        if hi > lo:
            total += hi - lo
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    return total


def simulate_step(
    *,
    forward_s: float,
    backward_s: Sequence[float],
    jobs: Sequence[Sequence[Segment]],
    optimizer_s: float = 0.0,
    overlap_efficiency: float = 1.0,
    bucket_of: Sequence[int] | None = None,
    queue_depth: int | None = None,
    token_bucket: tuple[float, float] | None = None,
) -> StepTimeline:
    """Simulate one step (see the module docstring for the rules).

    Args:
        forward_s: forward pass time (nothing overlaps it).
        backward_s: backward compute time of each bucket, in the order buckets become ready.
        jobs: for each bucket, its exchange job (segments in order); same length as
            ``backward_s``. An empty job means nothing to exchange. With ``bucket_of``, any
            number of jobs (for example one per tensor of a bucket).
        optimizer_s: optimizer step after all gradients are reduced.
        overlap_efficiency: ``eta`` in [MIN_OVERLAP_EFFICIENCY, 1], see step 6.
        bucket_of: the bucket whose gradients each job needs (non-decreasing, one entry per
            job); default job ``i`` belongs to bucket ``i``.
        queue_depth: ``None`` for rule 2 (two jobs in flight, whatever their buckets). An int
            ``d >= 1`` models a hook that reduces buckets one at a time on a single queue
            (commpress's DDP hook): the first job of a bucket starts only after every job of
            the earlier buckets has ended; inside a bucket, job ``k`` starts after job
            ``k-1``'s first ``net`` segment has started and after job ``k-d`` has ended
            (``d`` jobs in flight).
        token_bucket: ``(depth, rate)`` in payload bytes and bytes/s of a rate-limited link
            (``tc tbf``): the bucket starts the step full, refills at ``rate`` up to
            ``depth``, and each ``net`` segment's first bytes (its ``nbytes``) are sent free
            while tokens last (``seconds`` shrinks by ``credit / rate``). ``None``: a link at
            line rate.
    """
    if bucket_of is None:
        if len(jobs) != len(backward_s):
            raise CommpressError(
                f"got {len(jobs)} bucket jobs for {len(backward_s)} backward segments; one per "
                "bucket"
            )
        owners = list(range(len(jobs)))
    else:
        owners = [int(b) for b in bucket_of]
        if len(owners) != len(jobs):
            raise CommpressError(f"bucket_of has {len(owners)} entries for {len(jobs)} jobs")
        if any(not 0 <= b < len(backward_s) for b in owners) or any(
            b > c for b, c in zip(owners, owners[1:], strict=False)
        ):
            raise CommpressError(
                f"bucket_of must be non-decreasing bucket indices in [0, {len(backward_s)}), "
                f"got {owners}"
            )
    if queue_depth is not None and (
        isinstance(queue_depth, bool) or not isinstance(queue_depth, int) or queue_depth < 1
    ):
        raise CommpressError(f"queue_depth must be None or an int >= 1, got {queue_depth!r}")
    if token_bucket is not None:
        depth, rate = token_bucket
        if not (math.isfinite(depth) and depth >= 0 and math.isfinite(rate) and rate > 0):
            raise CommpressError(
                f"token_bucket must be (depth >= 0 bytes, rate > 0 bytes/s), got {token_bucket!r}"
            )
    tokens, tokens_at = (token_bucket[0], 0.0) if token_bucket is not None else (0.0, 0.0)
    if not MIN_OVERLAP_EFFICIENCY <= overlap_efficiency <= 1.0:
        raise CommpressError(f"overlap_efficiency must be in [{MIN_OVERLAP_EFFICIENCY:g}, 1], "
                             f"got {overlap_efficiency!r}")
    for name, value in (("forward_s", forward_s), ("optimizer_s", optimizer_s),
                        *((f"backward_s[{i}]", b) for i, b in enumerate(backward_s))):
        if not (math.isfinite(value) and value >= 0):
            raise CommpressError(f"{name} must be finite and >= 0, got {value!r}")

    tasks: list[_Task] = []

    def add(name: str, seg: Segment, bucket: int) -> _Task:
        prio = 1 if seg.kind == "compute" else 0
        t = _Task(len(tasks), name, seg.resource, seg.kind, seg.seconds, bucket, prio,
                  seg.nbytes)
        tasks.append(t)
        return t

    fwd = add("forward", Segment("gpu", forward_s, "compute", "forward"), -1)
    prev: _Task = fwd
    backward_tasks: list[_Task] = []
    for i, b in enumerate(backward_s):
        t = add(f"backward[{i}]", Segment("gpu", b, "compute"), i)
        t.end_deps.append(prev.index)
        backward_tasks.append(t)
        prev = t
    last_backward = prev
    prev_first: _Task | None = None  # first net segment (or first segment) of the previous job
    prev_last_net: _Task | None = None
    finals: list[_Task] = [last_backward]
    # Queue mode bookkeeping: last task of every earlier job, and of this bucket's jobs.
    done_before: list[_Task] = []
    bucket_jobs: list[_Task] = []
    current_bucket = -1
    for j, job in enumerate(jobs):
        if not job:
            continue
        i = owners[j]
        if queue_depth is not None and i != current_bucket:
            done_before.extend(bucket_jobs)
            bucket_jobs, current_bucket, prev_first = [], i, None
        chain: list[_Task] = []
        first_net: _Task | None = None
        last_net: _Task | None = None
        name = f"bucket[{i}]" if bucket_of is None else f"bucket[{i}].job[{j}]"
        for k, seg in enumerate(job):
            t = add(f"{name}.{k}:{seg.label or seg.kind}", seg, i)
            if k == 0:
                t.end_deps.append(backward_tasks[i].index)
                if prev_first is not None:
                    t.start_deps.append(prev_first.index)
                if queue_depth is not None:
                    if not bucket_jobs:
                        t.end_deps.extend(d.index for d in done_before)
                    elif len(bucket_jobs) >= queue_depth:
                        t.end_deps.append(bucket_jobs[-queue_depth].index)
            else:
                t.end_deps.append(chain[-1].index)
            if seg.resource == "net":
                if first_net is None:
                    first_net = t
                    if prev_last_net is not None:
                        t.end_deps.append(prev_last_net.index)
                last_net = t
            chain.append(t)
        prev_first = first_net if first_net is not None else chain[0]
        if last_net is not None:
            prev_last_net = last_net
        finals.append(chain[-1])
        bucket_jobs.append(chain[-1])
    opt = add("optimizer", Segment("gpu", optimizer_s, "compute", "optimizer"), -1)
    opt.end_deps.extend(t.index for t in finals)

    for t in tasks:
        t.waiting = len(t.end_deps) + len(t.start_deps)
        for d in (*t.end_deps, *t.start_deps):
            tasks[d].successors.append(t.index)

    free = dict.fromkeys(RESOURCES, 0.0)
    last_on: dict[str, int] = dict.fromkeys(RESOURCES, -1)
    heaps: dict[str, list[tuple[float, int, int, int]]] = {r: [] for r in RESOURCES}

    def release_of(t: _Task) -> tuple[float, int, bool]:
        rel, who, is_start = 0.0, -1, False
        for d in t.end_deps:
            if tasks[d].end > rel or who < 0:
                rel, who, is_start = max(rel, tasks[d].end), d, False
        for d in t.start_deps:
            if tasks[d].start > rel:
                rel, who, is_start = tasks[d].start, d, True
        return rel, who, is_start

    def push(t: _Task) -> None:
        rel, _, _ = release_of(t)
        heapq.heappush(heaps[t.resource], (rel, t.prio, max(t.bucket, 0), t.index))

    # Each successor is notified once its dependencies are scheduled: end deps count when the
    # dependency is scheduled (its end is then known), start deps likewise.
    for t in tasks:
        if t.waiting == 0:
            push(t)
    scheduled = 0
    while scheduled < len(tasks):
        best: tuple[float, int, int, int, str] | None = None
        for r in RESOURCES:
            if heaps[r]:
                rel, prio, bucket, idx = heaps[r][0]
                start = max(rel, free[r])
                cand = (start, prio, bucket, idx, r)
                if best is None or cand < best:
                    best = cand
        if best is None:
            raise CommpressError("timeline deadlock (a dependency cycle); this is a bug")
        start, _, _, idx, r = best
        heapq.heappop(heaps[r])
        t = tasks[idx]
        rel, who, is_start = release_of(t)
        t.start = start
        if token_bucket is not None and r == "net" and t.nbytes > 0:
            # Net segments run in start order, so the bucket is tracked at the link's time.
            depth, rate = token_bucket
            tokens = min(depth, tokens + (start - tokens_at) * rate)
            credit = min(tokens, t.nbytes, t.seconds * rate)
            t.seconds -= credit / rate
            tokens -= credit
            tokens_at = start + t.seconds
        t.end = start + t.seconds
        if free[r] > rel and last_on[r] >= 0:
            t.binding, t.binding_is_start = last_on[r], False
        else:
            t.binding, t.binding_is_start = who, is_start
        free[r] = t.end
        last_on[r] = idx
        scheduled += 1
        for s in t.successors:
            tasks[s].waiting -= 1
            if tasks[s].waiting == 0:
                push(tasks[s])

    # Overlap penalty: net time that overlaps backward compute.
    net_iv = [(t.start, t.end) for t in tasks if t.resource == "net" and t.kind == "comm"]
    bwd_iv = [(t.start, t.end) for t in backward_tasks]
    overlapped = _intervals_overlap(net_iv, bwd_iv)
    penalty = (1.0 - overlap_efficiency) * overlapped

    # Critical path: walk back from the optimizer through binding predecessors.
    by_kind = dict.fromkeys(KINDS, 0.0)
    cur = opt.index
    until = opt.end
    while cur >= 0:
        t = tasks[cur]
        by_kind[t.kind] += max(0.0, until - t.start)
        nxt = t.binding
        if nxt >= 0:
            # Through a start dependency the path reaches the predecessor's start, so the
            # predecessor itself contributes nothing and the walk continues from its binding.
            until = tasks[nxt].start if t.binding_is_start else tasks[nxt].end
        cur = nxt

    events = tuple(
        Event(t.name, t.resource, t.kind, t.bucket, t.start, t.end) for t in tasks
    )
    comm_busy = sum(t.seconds for t in tasks if t.kind == "comm")
    codec_busy = sum(t.seconds for t in tasks if t.kind == "codec")
    return StepTimeline(
        total=opt.end + penalty,
        compute=by_kind["compute"],
        exposed_comm=by_kind["comm"],
        codec=by_kind["codec"],
        overlap_penalty=penalty,
        overlapped=overlapped,
        comm_busy=comm_busy,
        codec_busy=codec_busy,
        events=events,
    )


__all__ = ["KINDS", "RESOURCES", "Event", "Segment", "StepTimeline", "simulate_step"]
