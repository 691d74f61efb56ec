"""``commpress bench allreduce``: compressed all-reduce against plain all-reduce, side by side.

For each world size (separate gloo groups of local processes) and tensor size, it times, in one
run and interleaved call by call (so that machine noise hits every method alike):

* ``plain fp32`` / ``plain fp16``: ``torch.distributed.all_reduce`` in place on a buffer of that
  many elements (the baseline a user would otherwise write), and ``plain fp32 out-of-place``
  (``clone()`` then all-reduce: what returning a new tensor costs), and ``plain fp32
  (control)``, the same in-place call on another buffer: its "overhead" against ``plain fp32``
  shows how far two identical calls differ in this run (the measurement's noise);
* ``CODEC/STRATEGY``: :func:`commpress.all_reduce` with ``op="sum"`` for each requested codec
  and each strategy it supports, plus ``identity/auto inplace`` (``inplace=True``, the default
  ``check="first"``) and the same with ``check="every"`` (the per-call order check, one tiny
  all-reduce whose latency is a fixed cost per call: the price of that safety net).

Reported per row: the median and the fastest time per call over the repeats (each call timed
as the slowest rank's); this rank's wire bytes (the codec's logical payload bytes over all
rounds and hops; plain rows count the tensor once); the speed relative to plain fp32
(medians); and for the identity codec the framework's overhead relative to the equivalent
plain call (the median over repeats of the paired time ratio; goal: within 5 %): the in-place
identity rows against in-place ``all_reduce``, the out-of-place identity rows against
``clone()`` plus ``all_reduce``. Beside the times, each row gives the calling thread's CPU time
per call (``time.thread_time``; each repeat counts the busiest rank, as times count the
slowest; the median over repeats) and, for the identity rows, its
paired difference to the plain call in microseconds: the Python a call adds in front of the
collective, measured without the scheduling noise that blurs wall-clock ratios of short calls
on a shared machine (work on other threads, such as the offload worker or gloo's own, is not
in it).
Short calls are timed in batches: each repeat of a method runs ``max(1, 8 MB / size)`` calls
back to back (as a training loop would) and records their mean, and sizes up to 4 MB get 4x the
repeats (timings of single millisecond calls on a shared machine spread by several times).

Loopback gloo on one machine measures the *software* cost (encoding, decoding, scheduling) far
more than the network: bandwidth savings pay off on real links, not here.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from commpress.bench.ranks import run_ranks
from commpress.codecs.registry import codec_ids, get_codec
from commpress.collectives.api import STRATEGIES, all_reduce, reduce
from commpress.errors import CommpressError, error_context
from commpress.report import render_table

DEFAULT_CODECS = "identity,fp16,bf16,qsgd,topk,powersgd,thc"
DEFAULT_STRATEGIES = "auto,allgather,ring,hierarchical"
INPLACE = "identity/auto inplace"
INPLACE_EVERY = "identity/auto inplace check=every"
#: The plain fp32 call again, on another buffer: its "overhead" is the measurement's noise.
CONTROL = "plain fp32 (control)"
#: Sizes up to this many MB get this many times the repeats (their calls are short and noisy).
SMALL_MB, SMALL_REPEAT_FACTOR = 4.0, 4
#: Each timed sample of a method runs calls back to back until about this many MB went through.
BATCH_MB = 8.0


#: ... but never more calls than this (tiny sizes would otherwise take thousands).
MAX_CALLS_PER_SAMPLE = 64


def calls_per_sample(size_mb: float) -> int:
    """How many back-to-back calls one timed sample of a ``size_mb`` call averages."""
    return max(1, min(MAX_CALLS_PER_SAMPLE, round(BATCH_MB / size_mb)))


def _parse_list(text: str, kind: type, what: str) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CommpressError(
            f"--{what}: expected comma-separated {kind.__name__}s, got {text!r}"
        ) from None
    if not values:
        raise CommpressError(f"--{what}: empty list")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "allreduce",
        help="time compressed all-reduce (codec x strategy) against plain all-reduce on gloo",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--sizes", default="1,4,16,64,256", help="tensor sizes in MB of fp32")
    p.add_argument("--max-mb", type=float, default=None, help="skip sizes above this many MB")
    p.add_argument("--worlds", default="2,4", help="world sizes (processes on this machine)")
    p.add_argument(
        "--codecs",
        default=DEFAULT_CODECS,
        help="codec specs separated by ',' (or by ';' when a spec has several parameters, "
        "e.g. 'powersgd:rank=4,warm_start=true;fp16'); default adds netzip when installed",
    )
    p.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help="strategies to try for each codec (unsupported combinations are skipped)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed calls per method (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per method first")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for each world size")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    p.set_defaults(func=run)


def _methods(
    codecs: list[str], strategies: list[str], skipped: list[str] | None = None
) -> list[tuple[str, str]]:
    """The (codec, strategy) pairs to time; the pairs a strategy cannot run are left out and,
    when ``skipped`` is given, named in it."""
    out = []
    for spec in codecs:
        if "=" in spec and ":" not in spec and "," not in spec:
            # 'powersgd:rank=4,warm_start=true' split at its comma: the second parameter
            raise CommpressError(
                f"--codecs: {spec!r} is not a codec spec; a spec with several parameters "
                "needs ';' between the specs ('powersgd:rank=4,warm_start=true;fp16')"
            )
        with error_context(f"--codecs {spec!r}"):
            codec = get_codec(spec)
        for strategy in strategies:
            if strategy not in STRATEGIES:
                raise CommpressError(f"unknown strategy {strategy!r}; accepted: {STRATEGIES}")
            if (codec.multi_round and strategy in (
                "allgather",
                "ring",
                "hierarchical-compress-first",
            )) or (strategy == "allreduce" and not (codec.summable or codec.multi_round)):
                if skipped is not None:
                    skipped.append(f"{spec}/{strategy}")
                continue
            out.append((spec, strategy))
    return out


def _measure_all(
    rank: int,
    world: int,
    sizes_mb: list[float],
    methods: list[tuple[str, str]],
    repeats: int,
    warmup: int,
) -> list[dict[str, Any]]:
    """One rank's measurements of every size (run by :func:`commpress.bench.ranks.run_ranks`)."""
    local_size = 2 if world % 2 == 0 and world > 2 else 1
    rows = []
    for size_mb in sizes_mb:
        rows += _measure_size(rank, world, size_mb, methods, repeats, warmup, local_size)
    return rows


def _measure_size(
    rank: int,
    world: int,
    size_mb: float,
    methods: list[tuple[str, str]],
    repeats: int,
    warmup: int,
    local_size: int,
) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    n = max(1, int(size_mb * 2**20) // 4)
    g = torch.Generator().manual_seed(rank)
    # A matrix, as most gradients are (low-rank codecs need two dimensions).
    shape = (n // 1024, 1024) if n % 1024 == 0 else (n,)
    x = torch.randn(shape, generator=g)
    buf32 = torch.zeros(n)
    buf32_control = torch.zeros(n)
    buf16 = torch.zeros(n, dtype=torch.float16)
    buf_id = torch.zeros(n)
    calls: dict[str, Callable[[], Any]] = {
        "plain fp32": functools.partial(dist.all_reduce, buf32),
        CONTROL: functools.partial(dist.all_reduce, buf32_control),
        "plain fp32 out-of-place": lambda: dist.all_reduce(x.clone()),
        "plain fp16": functools.partial(dist.all_reduce, buf16),
        INPLACE: functools.partial(
            all_reduce, buf_id, "identity", op="sum", key=INPLACE, inplace=True
        ),
        INPLACE_EVERY: functools.partial(
            all_reduce, buf_id, "identity", op="sum", key=INPLACE_EVERY, inplace=True,
            check="every",
        ),
    }
    wire: dict[str, int] = {
        "plain fp32": 4 * n,
        CONTROL: 4 * n,
        "plain fp32 out-of-place": 4 * n,
        "plain fp16": 2 * n,
        INPLACE: 4 * n,
        INPLACE_EVERY: 4 * n,
    }
    for spec, strategy in methods:
        name = f"{spec}/{strategy}"
        options: dict[str, Any] = dict(op="sum", strategy=strategy, key=name, local_size=local_size)
        stats: dict[str, int] = {}
        reduce(x, spec, stats=stats, **options)  # also the first-call agreement check
        wire[name] = stats.get("wire_bytes", 0)
        calls[name] = functools.partial(all_reduce, x, spec, **options)
    rows = []
    times: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    if size_mb <= SMALL_MB:
        repeats *= SMALL_REPEAT_FACTOR
    batch = calls_per_sample(size_mb)
    # Round-robin: every repeat times every method once, so drift hits all alike, in an order
    # shuffled per repeat (the same on every rank) so that no method always follows the same one.
    for i in range(repeats):
        order = list(calls)
        random.Random(i).shuffle(order)
        for name in order:
            fn = calls[name]
            dist.barrier()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            times[name].append((time.perf_counter() - t0) / batch)
            cpu[name].append((time.thread_time() - c0) / batch)
    for name in calls:
        slowest = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        busiest = torch.tensor(cpu[name], dtype=torch.float64)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        rows.append(
            {
                "world": world,
                "size_mb": size_mb,
                "method": name,
                "ms": 1e3 * statistics.median(slowest.tolist()),
                "ms_min": 1e3 * min(slowest.tolist()),
                "times_ms": [1e3 * t for t in slowest.tolist()],
                "cpu_us": 1e6 * statistics.median(busiest.tolist()),
                "cpu_times_us": [1e6 * t for t in busiest.tolist()],
                "calls_per_sample": batch,
                "wire_bytes": wire[name],
            }
        )
    return rows


def measure(
    world: int,
    sizes_mb: list[float],
    methods: list[tuple[str, str]],
    *,
    repeats: int,
    warmup: int,
    threads: int = 1,
    timeout: float = 1800.0,
) -> list[dict[str, Any]]:
    """Run the measurements on ``world`` local gloo processes; returns rank 0's rows."""
    rows = run_ranks(
        world, _measure_all, (sizes_mb, methods, repeats, warmup), threads=threads,
        timeout=timeout,
    )
    return list(rows)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ``vs_fp32`` (plain fp32 time / this time) and the identity codec's overhead.

    The overhead compares like with like: the in-place identity calls against the in-place
    plain all-reduce, and the identity codec's out-of-place call (which returns a new tensor)
    against ``clone()`` plus a plain all-reduce. It is *paired*: every repeat times every
    method once, in turn, so the ratio of the two times of one repeat sees the same machine
    load; the overhead is the median of those ratios, minus one. ``cpu_overhead_us`` is the
    median of the same repeats' differences in the calling thread's CPU time per call (each
    repeat's busiest rank, which need not be the same rank for both calls). ``vs_fp32`` uses
    medians.
    """

    def times(method: str) -> dict[tuple[int, float], dict[str, Any]]:
        return {(r["world"], r["size_mb"]): r for r in rows if r["method"] == method}

    inplace = times("plain fp32")
    out_of_place = times("plain fp32 out-of-place")
    for r in rows:
        key = (r["world"], r["size_mb"])
        ref = inplace.get(key)
        r["vs_fp32"] = ref["ms"] / r["ms"] if ref and r["ms"] else float("nan")
        base = None
        if r["method"] in (INPLACE, INPLACE_EVERY, CONTROL):
            base = inplace.get(key)
        elif r["method"].startswith("identity/"):
            base = out_of_place.get(key)
        ratios = (
            [t / b for t, b in zip(r["times_ms"], base["times_ms"], strict=True) if b > 0]
            if base
            else []
        )
        r["overhead_pct"] = 100.0 * (statistics.median(ratios) - 1.0) if ratios else float("nan")
        extra = (
            [t - b for t, b in zip(r["cpu_times_us"], base["cpu_times_us"], strict=True)]
            if base
            else []
        )
        r["cpu_overhead_us"] = statistics.median(extra) if extra else float("nan")
    return rows


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm


    sizes = _parse_list(args.sizes, float, "sizes")
    if any(not s > 0 for s in sizes):
        raise CommpressError(f"--sizes must be positive numbers of MB, got {sizes}")
    if args.max_mb is not None:
        sizes = [s for s in sizes if s <= args.max_mb]
        if not sizes:
            raise CommpressError(f"--max-mb {args.max_mb} leaves no size from --sizes")
    worlds = _parse_list(args.worlds, int, "worlds")
    if any(w < 1 for w in worlds):
        raise CommpressError(f"--worlds must be positive, got {worlds}")
    if args.repeats < 1 or args.warmup < 0:
        raise CommpressError("--repeats must be >= 1 and --warmup >= 0")
    codec_text = args.codecs
    if codec_text == DEFAULT_CODECS and "netzip" in codec_ids():
        codec_text += ",netzip"  # the lossless codec, where the ring strategy matters
    sep = ";" if ";" in codec_text else ","
    codecs = [c.strip() for c in codec_text.split(sep) if c.strip()]
    if not codecs:
        raise CommpressError("--codecs: empty list")
    skipped: list[str] = []
    methods = _methods(codecs, args.strategies.split(","), skipped)
    if skipped:
        print(f"skipped (the strategy cannot run the codec): {', '.join(skipped)}",
              file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for world in tqdm(worlds, desc="world sizes", disable=None):
        rows += measure(
            world,
            sizes,
            methods,
            repeats=args.repeats,
            warmup=args.warmup,
            threads=args.threads,
            timeout=args.timeout,
        )
    summarize(rows)
    headers = [
        "world",
        "MB",
        "method",
        "ms/call (median)",
        "ms/call (min)",
        "wire MB/rank",
        "vs plain fp32",
        "overhead %",
        "caller CPU us",
        "CPU overhead us",
    ]
    table = [
        [
            r["world"],
            r["size_mb"],
            r["method"],
            r["ms"],
            r["ms_min"],
            r["wire_bytes"] / 2**20,
            r["vs_fp32"],
            r["overhead_pct"],
            r["cpu_us"],
            r["cpu_overhead_us"],
        ]
        for r in rows
    ]
    print(render_table(headers, table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
