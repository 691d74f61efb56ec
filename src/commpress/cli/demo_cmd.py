"""``commpress demo``: time-to-accuracy of compressed DDP training against an FP16 baseline.

Algorithm (the design is argued in docs/demo.md):

1. Resolve the cluster: by default 2 emulated nodes x 1 process joined by 30 Mbit/s links
   (network namespaces + ``tc``; needs root). The cluster is brought up here and its links
   are measured (:meth:`~commpress.cluster.EmulatedCluster.check_links`) before training.
   Without root or namespaces, or with ``--no-cluster``, local processes on loopback, and the
   output says the links are not shaped.
2. Measure the model's compute per step in this process, and ask the performance model
   (:func:`commpress.perfmodel.advisor.advise`, uniform codecs only) which codec it
   recommends for this model on the measured link; that codec gets a row (if it is not
   already one). The same model says which real cluster has this compute-to-communication
   ratio.
3. Train the built-in tiny GPT with DDP (:func:`commpress.demo.e2e.run_setups`, all in one
   launch), for each of ``--seeds`` seeds: ``fp16`` first (the honest baseline: what
   PyTorch's ``fp16_compress_hook`` sends), for ``--steps`` steps; then every codec, for up
   to ``--budget`` times as many steps, stopping once its smoothed eval curve has settled
   below every target of that seed (:mod:`commpress.demo.tta`). The lossless codec runs on
   the first ``--lossless-seeds`` seeds.
4. Per seed, targets = fp16's smoothed eval loss at ``--targets`` fractions of its steps; per
   codec and seed, the speedup = geometric mean over targets of fp16's time / the codec's
   ("never" if a target was missed within the budget). Over seeds: the median and the range.
5. Print the table and the one-line verdict; write ``demo.json`` (the command line,
   environment, measured link, settings, targets, every run's measurements) and ``demo.png``
   to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from commpress.demo.e2e import DEFAULT_MIN_NUMEL, DEFAULT_WARMUP_STEPS
from commpress.demo.tta import (
    DEFAULT_BUDGET,
    DEFAULT_FRACTIONS,
    DEFAULT_WINDOW,
    Crossing,
    Summary,
    check_fractions,
    seed_speedup,
    summarize,
    targets_from_baseline,
    time_to_target,
    verdict,
)
from commpress.errors import CommpressError
from commpress.report import render_table

#: Codecs run after the fp16 baseline by default: low rank and 1-bit (the lossless codec and
#: the advisor's choice are added to them).
DEFAULT_CODECS = ("powersgd:rank=4", "sign")
#: The lossless row.
LOSSLESS_CODEC = "netzip"
DEFAULT_LOSSLESS_SEEDS = 1
DEFAULT_BANDWIDTH = "30mbit"
DEFAULT_STEPS = 150
DEFAULT_SEEDS = 3
DEFAULT_EVAL_EVERY = 10
#: Validation batches of ``--batch-size`` windows per evaluation: 4 x 16 windows of 64 bytes
#: (about +-0.02 nats; the smoothing averages 3 evaluations).
DEFAULT_EVAL_BATCHES = 4
BASELINE = "fp16"
#: Training clocks the times to target can be read on (the first is the default; see
#: docs/demo.md): each step at its phase's median step time, or the summed step times.
CLOCKS = ("median", "sum")
CLOCK_TEXT = {"median": "steps x the run's median step time, warm-up and compressed steps "
                        "apart",
              "sum": "summed step times"}
#: Wall-clock time of the default run, measured from a fresh clone (README and docs/demo.md
#: quote this string; a test checks that they do).
TIME_ESTIMATE = (
    "10-18 minutes on a 2-core machine shared with other jobs "
    "(10 at load average 2-7, up to 18 at 9-30)"
)
#: ``--quick``: enough to exercise every part (warm-up, compression, eval, table, plot).
QUICK_STEPS = 8
QUICK_EVAL_EVERY = 2
QUICK_EVAL_BATCHES = 2
QUICK_WARMUP_STEPS = 2
QUICK_CODECS = ("powersgd:rank=4",)
QUICK_SEEDS = 1
#: Error budget (NMSE per step on this model's gradients) the demo gives the advisor: its
#: conservative end, because the performance model predicts step time, not convergence.
ADVISOR_MAX_NMSE = 0.1
#: The real cluster the demo's compute-to-communication ratio is compared with.
CONTEXT_PARAMS = 7e9
CONTEXT_NODES = 4
CONTEXT_GPUS = 8


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train with DDP on an emulated slow network: time-to-accuracy of codecs vs fp16",
        description="Train the built-in tiny GPT with DDP across real processes on an emulated "
        "slow network (2 nodes, 30 Mbit/s links by default; local processes without root), "
        "with the fp16 baseline, a few codecs, the lossless codec and the performance "
        "model's choice, over several seeds; report the time to reach fp16's loss (targets "
        "from fp16's smoothed curve, a step budget, the median speedup and its range over "
        f"seeds) and a one-line verdict. The defaults take {TIME_ESTIMATE} (measured from a "
        "fresh clone); --quick takes about a minute.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--codecs", nargs="+", metavar="SPEC", default=None,
                   help="codec specs to compare with fp16, space-separated (default: "
                   f"{' '.join(DEFAULT_CODECS)}; --quick: {' '.join(QUICK_CODECS)})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"fp16's training steps (default {DEFAULT_STEPS}; --quick "
                   f"{QUICK_STEPS}); the codecs may run --budget times as many")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help="steps a codec may take, as a multiple of fp16's; a target not reached "
                   "within them is 'never'")
    p.add_argument("--seeds", type=int, default=None,
                   help=f"seeds (weights and data order) per codec (default {DEFAULT_SEEDS}; "
                   f"--quick {QUICK_SEEDS})")
    p.add_argument("--seed", type=int, default=0, help="first seed; seeds are consecutive")
    p.add_argument("--targets", nargs="+", type=float, metavar="F",
                   default=list(DEFAULT_FRACTIONS),
                   help="fractions of fp16's steps at which its smoothed eval loss sets a target")
    p.add_argument("--smooth", type=int, default=DEFAULT_WINDOW,
                   help="evaluations averaged by the centred moving average (odd; 1: none)")
    p.add_argument("--clock", default=CLOCKS[0], choices=CLOCKS,
                   help="training clock for the time to target: 'median' charges every step "
                   "its run's median step time (the fp16 warm-up and the compressed steps "
                   "apart), so load spikes from other jobs cannot decide the verdict; 'sum' "
                   "adds up the measured step times (both are recorded in demo.json)")
    p.add_argument("--lossless", default=LOSSLESS_CODEC, metavar="SPEC",
                   help="the lossless codec's row ('none' to leave it out)")
    p.add_argument("--lossless-seeds", type=int, default=DEFAULT_LOSSLESS_SEEDS,
                   help="seeds the lossless codec runs on (it learns exactly as fp32 does, so "
                   "its row is about step cost; each of its steps is fp16's or slower)")
    p.add_argument("--no-advisor", action="store_true",
                   help="no row for the performance model's choice")
    p.add_argument("--advisor-max-nmse", type=float, default=ADVISOR_MAX_NMSE,
                   help="the advisor's error budget: NMSE per step on this model's gradients")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes")
    p.add_argument("--procs-per-node", type=int, default=1,
                   help="processes per node (on 2 cores more only time-share them)")
    p.add_argument("--bandwidth", default=DEFAULT_BANDWIDTH,
                   help="each node's link rate, tc units (sending the tiny model's fp16 "
                   "gradients, 1.7 MB, takes ~0.47 s at 30mbit, several times longer than "
                   "computing them on 2 CPU cores)")
    p.add_argument("--latency", default=None, help="round-trip time between nodes, e.g. 1ms "
                   "(needs the kernel's netem)")
    p.add_argument("--no-cluster", action="store_true",
                   help="run local processes on loopback (links not shaped)")
    p.add_argument("--model", default="tiny", choices=("tiny", "small"),
                   help="model preset: tiny (0.87M parameters) or small (4.9M)")
    p.add_argument("--batch-size", type=int, default=16, help="global rows per step")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default 3e-3 tiny, 1e-3 small)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps every codec sends as fp16 before compressing (default "
                   f"{DEFAULT_WARMUP_STEPS}; --quick {QUICK_WARMUP_STEPS})")
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"steps between eval losses (default {DEFAULT_EVAL_EVERY}; --quick "
                   f"{QUICK_EVAL_EVERY})")
    p.add_argument("--eval-batches", type=int, default=None,
                   help=f"validation batches per evaluation (default {DEFAULT_EVAL_BATCHES}; "
                   f"--quick {QUICK_EVAL_BATCHES}); fixed windows, the same for every run")
    p.add_argument("--out", default="commpress-demo",
                   help="output directory for demo.json, demo.png, workers.log (ignored by "
                   "git in a checkout)")
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny run ({QUICK_STEPS} steps, {QUICK_SEEDS} seed, powersgd and "
                   "the lossless codec unless --codecs) to check that everything works; "
                   "numbers are meaningless")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (the line per finished run stays)")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------ records
def _git_commit() -> dict[str, Any] | None:
    """The commit (and whether the tree is modified) of the checkout commpress runs from."""
    here = Path(__file__).resolve().parent
    root = next((d for d in (here, *here.parents) if (d / ".git").exists()), None)
    if root is None:
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head, "modified": bool(dirty), "path": str(root)}


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.lower().startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _loadavg() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def equivalent_command(args: argparse.Namespace) -> list[str]:
    """``commpress demo`` with every option spelled out: reruns exactly these settings."""
    cmd = ["commpress", "demo"]
    for key, value in vars(args).items():
        if key in ("func", "command") or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif isinstance(value, (list, tuple)):
            cmd.extend([flag, *(str(v) for v in value)])
        else:
            cmd.extend([flag, str(value)])
    return cmd


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """What a reader needs to reproduce or judge a run (recorded in ``demo.json``)."""
    import torch

    import commpress

    return {
        "command": equivalent_command(args),
        "argv": list(sys.argv),
        "commpress": commpress.__version__,
        "git": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


# ------------------------------------------------------------------------------ model
def measure_compute(model: str, batch_size: int, world_size: int, *, steps: int = 6,
                    grads: list[Any] | None = None, min_numel: int = 0) -> float:
    """Median seconds of one worker's forward + backward + optimizer step on its shard of the
    batch, with a worker's thread count, in this process (no communication).

    ``grads``, when given, receives the last step's gradients of the tensors with at least
    ``min_numel`` elements (the ones the DDP hook compresses)."""
    import torch

    from commpress.demo.data import batches, stdlib_corpus
    from commpress.demo.model import build_model, preset
    from commpress.demo.train import make_optimizer

    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        config = preset(model)
        net = build_model(config, seed=0)
        opt = make_optimizer(net, 1e-3)
        data = batches(stdlib_corpus(200_000), batch_size=max(1, batch_size // world_size),
                       context=config.context, seed=0)
        times = []
        for i in range(steps + 2):
            x, y = next(data)
            t0 = time.perf_counter()
            loss = net.loss(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        if grads is not None:
            grads.extend(p.grad.detach().clone() for p in net.parameters()
                         if p.grad is not None and p.numel() >= min_numel)
        return statistics.median(times)
    finally:
        torch.set_num_threads(saved)


def _demo_cluster(nodes: int, procs_per_node: int, link_bps: float | None) -> Any:
    from commpress.cluster.shaping import choose_burst
    from commpress.perfmodel.collectives import TCP_EFFICIENCY, Cluster

    if link_bps is None:  # loopback: no shaped link; modelled as a fast LAN
        return Cluster.build(nodes=nodes, gpus_per_node=procs_per_node, inter_bw="10gbit",
                             inter_latency="50us", intra_bw="10gbit", intra_latency="50us")
    return Cluster.build(nodes=nodes, gpus_per_node=procs_per_node, inter_bw=link_bps,
                         inter_latency="50us", inter_efficiency=TCP_EFFICIENCY,
                         intra_bw="10gbit", intra_latency="50us",
                         inter_burst=choose_burst(link_bps))


def gradient_nmse(spec: str, grads: Sequence[Any]) -> float:
    """One worker's error (NMSE) of ``spec`` on real gradients: ``sum ||reduce(g) - g||^2 /
    sum ||g||^2`` over the tensors."""
    from commpress.codecs.registry import get_codec
    from commpress.codecs.simulate import single_worker

    codec = get_codec(spec)
    err = ref = 0.0
    for g in grads:
        out = single_worker(codec, g).total
        err += float((out.double() - g.double()).pow(2).sum())
        ref += float(g.double().pow(2).sum())
    return err / ref if ref > 0 else 0.0


def advisor_choice(model: str, compute_s: float, cluster: Any, world_size: int,
                   candidates: Sequence[str] | None = None,
                   grads: Sequence[Any] | None = None,
                   max_nmse: float = ADVISOR_MAX_NMSE) -> dict[str, Any]:
    """The performance model's codec for this model and cluster (uniform choices only, so
    the choice is one codec that a training run can use), with codec speeds measured here
    and, when ``grads`` are given, each candidate's error measured on them (the advisor's
    own synthetic samples overstate PowerSGD's error on real, low-rank gradients)."""
    import torch

    from commpress.demo.model import build_model, preset
    from commpress.perfmodel.advisor import advise, default_candidates
    from commpress.perfmodel.codec_costs import SpeedTable, calibrate_speeds
    from commpress.perfmodel.model import Workload

    t0 = time.perf_counter()
    specs = list(candidates) if candidates is not None else default_candidates()
    table = {spec: gradient_nmse(spec, grads) for spec in specs} if grads else None
    # Speeds measured here with a worker's threads, for the candidates within the budget
    # (the others are never predicted).
    timed = [s for s in specs if table is None or table[s] <= max_nmse]
    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        speeds = SpeedTable.builtin().merged(calibrate_speeds(
            ["fp16", *timed], small=1 << 10, large=1 << 16, repeats=3))
    finally:
        torch.set_num_threads(saved)
    workload = Workload.from_module(build_model(preset(model), seed=0), compute_s=compute_s)
    advice = advise(workload, cluster, candidates=specs, speeds=speeds, max_passes=0,
                    nmse_table=table, max_nmse=max_nmse)
    return {
        "codec": advice.choices[0],
        "recommendation": advice.recommendation,
        "predicted_speedup": advice.speedup,
        "predicted_step_s": advice.prediction.total,
        "predicted_fp16_step_s": advice.baseline.total,
        "advice": advice.to_dict(),
        "nmse_source": "this model's gradients" if table else "synthetic samples",
        "seconds": time.perf_counter() - t0,
    }


def cluster_context(model: str, compute_s: float, cluster: Any) -> dict[str, Any]:
    """Which real cluster has the demo's compute-to-communication ratio.

    The ratio is a step's compute (forward, backward, optimizer; measured) over the time of
    fp16's gradient exchange alone (the performance model's baseline with no compute to
    overlap). The reference is a :data:`CONTEXT_PARAMS`-parameter model on
    :data:`CONTEXT_NODES` nodes of :data:`CONTEXT_GPUS` GPUs, compute from
    :func:`~commpress.perfmodel.model.estimate_compute_s`; the answer is the inter-node
    bandwidth at which its ratio is the demo's (bisection: exchange time falls as the
    bandwidth grows)."""
    from commpress.demo.model import build_model, preset
    from commpress.perfmodel.collectives import Cluster
    from commpress.perfmodel.model import Workload, estimate_compute_s, predict_baseline

    def exchange_s(workload: Any, cl: Any) -> float:
        return float(predict_baseline(workload, cl).total)

    net = build_model(preset(model), seed=0)
    comm = exchange_s(Workload.from_module(net, compute_s=0.0), cluster)
    ratio = compute_s / comm if comm > 0 else math.inf
    big = Workload.from_params(CONTEXT_PARAMS, compute_s=0.0)
    big_compute = estimate_compute_s(CONTEXT_PARAMS)

    def ref_cluster(bps: float) -> Any:
        return Cluster.build(nodes=CONTEXT_NODES, gpus_per_node=CONTEXT_GPUS, inter_bw=bps)

    lo, hi = 1e7, 1e13  # bits/s
    for _ in range(50):
        mid = math.sqrt(lo * hi)
        if big_compute / exchange_s(big, ref_cluster(mid)) < ratio:
            lo = mid  # communication still too slow for the demo's ratio
        else:
            hi = mid
    bps = math.sqrt(lo * hi)
    ref_comm = exchange_s(big, ref_cluster(bps))
    return {
        "compute_s": compute_s,
        "fp16_exchange_s": comm,
        "ratio": ratio,
        "reference_params": CONTEXT_PARAMS,
        "reference_nodes": CONTEXT_NODES,
        "reference_gpus_per_node": CONTEXT_GPUS,
        "reference_compute_s": big_compute,
        "reference_exchange_s": ref_comm,
        "reference_inter_bps": bps,
        "reference_ratio": big_compute / ref_comm if ref_comm > 0 else math.inf,
    }


def _format_bps(bps: float) -> str:
    return f"{bps / 1e9:.3g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.3g} Mbit/s"


def context_line(ctx: dict[str, Any]) -> str:
    return (
        f"context: here a step computes for {1e3 * ctx['compute_s']:.0f} ms and fp16's "
        f"gradient exchange takes {1e3 * ctx['fp16_exchange_s']:.0f} ms (compute/communication "
        f"{ctx['ratio']:.2f}, performance model); a {ctx['reference_params'] / 1e9:g}B model on "
        f"{ctx['reference_nodes']} nodes of {ctx['reference_gpus_per_node']} H100-class GPUs "
        f"({ctx['reference_compute_s']:.2f} s of compute per step: 16k tokens per GPU at "
        f"400 TFLOP/s) has this ratio with {_format_bps(ctx['reference_inter_bps'])} between "
        "nodes"
    )


# ------------------------------------------------------------------------------ analysis
def _eval_times(r: Any, clock: str) -> list[float]:
    return list(r.eval_times_median_clock if clock == "median" else r.eval_times)


def analyse(results: Sequence[Any], *, baseline: str, fractions: Sequence[float],
            window: int, clock: str = "median") -> dict[str, Any]:
    """Targets per seed, crossings and speedups per run, summaries per codec.

    ``clock`` is the training clock the times to target are read on: ``"median"`` (every
    step at its phase's median step time, :func:`commpress.demo.e2e.median_clock`) or
    ``"sum"`` (the summed step times). Each run's record also carries the other clock's
    times and speedup, so a reader can compare them."""
    if clock not in CLOCKS:
        raise CommpressError(f"--clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    other = next(c for c in CLOCKS if c != clock)
    by_seed: dict[int, Any] = {}
    for r in results:
        if r.label == baseline:
            by_seed[r.seed] = r
    targets: dict[int, list[float]] = {
        seed: targets_from_baseline(b.eval_steps, b.eval_losses, fractions=fractions,
                                    window=window)
        for seed, b in by_seed.items()
    }

    def crossings(r: Any, on: str) -> list[Crossing | None]:
        times = _eval_times(r, on)
        return [time_to_target(r.eval_steps, times, r.eval_losses, t, window=window)
                for t in targets[r.seed]]

    base_cross = {on: {seed: crossings(b, on) for seed, b in by_seed.items()}
                  for on in (clock, other)}
    runs = []
    speedups: dict[str, list[float | None]] = {}
    for r in results:
        cross, cross_other = crossings(r, clock), crossings(r, other)
        sp = seed_speedup(base_cross[clock][r.seed], cross)
        speedups.setdefault(r.label, []).append(sp)
        runs.append({
            "label": r.label, "seed": r.seed, "steps": r.steps,
            "max_steps": r.extra.get("max_steps", r.steps),
            "targets": targets[r.seed],
            "clock": clock,
            "time_to_targets_s": [c.time_s if c else None for c in cross],
            "steps_to_targets": [c.step if c else None for c in cross],
            "speedup": sp,
            f"time_to_targets_{other}_clock_s": [c.time_s if c else None for c in cross_other],
            f"speedup_{other}_clock": seed_speedup(base_cross[other][r.seed], cross_other),
        })
    summaries = {label: summarize(label, sp) for label, sp in speedups.items()}
    others: dict[str, list[float | None]] = {}
    for run in runs:
        others.setdefault(run["label"], []).append(run[f"speedup_{other}_clock"])
    return {"targets": {str(k): v for k, v in targets.items()}, "runs": runs,
            "summaries": summaries, "clock": clock, "other_clock": other,
            "summaries_other_clock": {k: summarize(k, v) for k, v in others.items()}}


def _median(values: Sequence[float]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else math.nan


def table_rows(results: Sequence[Any], analysis: dict[str, Any],
               roles: dict[str, str]) -> list[dict[str, Any]]:
    """One row per codec, aggregated over its seeds."""
    order: list[str] = []
    for r in results:
        if r.label not in order:
            order.append(r.label)
    rows = []
    for label in order:
        mine = [r for r in results if r.label == label]
        runs = [a for a in analysis["runs"] if a["label"] == label]
        final = [a["time_to_targets_s"][-1] for a in runs if a["time_to_targets_s"][-1]]
        summary: Summary = analysis["summaries"][label]
        rows.append({
            "label": label,
            "role": roles.get(label, ""),
            "seeds": len(mine),
            "bits_per_coord": _median([r.bits_per_coord for r in mine]),
            "mb_per_step": _median([r.bytes_per_step_median for r in mine]) / 1e6,
            "link_mb_per_step": (_median([r.link_bytes_median for r in mine]) / 1e6
                                 if all(r.link_bytes_median is not None for r in mine) else None),
            "step_ms": 1e3 * _median([r.step_time_median for r in mine]),
            "step_ms_p10": 1e3 * min(r.step_time_spread[0] for r in mine),
            "step_ms_p90": 1e3 * max(r.step_time_spread[1] for r in mine),
            "steps_run": [r.steps for r in mine],
            "final_eval_loss": _median([r.final_eval_loss for r in mine]),
            "time_to_final_target_s": _median(final) if final else None,
            "reached_seeds": summary.reached,
            "speedup": summary.median,
            "speedup_interval": list(summary.interval) if summary.interval else None,
            "speedup_text": summary.describe(),
            "replicas_identical": all(r.replicas_identical for r in mine),
        })
    return rows


def render(rows: Sequence[dict[str, Any]]) -> str:
    headers = ["codec", "seeds", "bits/coord", "MB/step", "step ms (p10-p90)", "steps run",
               "final eval loss", "time to last target", "speedup vs fp16 [range]"]
    table = []
    for row in rows:
        label = row["label"] + (f" ({row['role']})" if row["role"] else "")
        if not row["replicas_identical"]:
            label += " [REPLICAS DIFFER]"
        steps = row["steps_run"]
        steps_text = (str(steps[0]) if len(set(steps)) == 1
                      else f"{min(steps)}-{max(steps)}")
        t = row["time_to_final_target_s"]
        table.append([
            label, row["seeds"], f"{row['bits_per_coord']:.2f}", f"{row['mb_per_step']:.3f}",
            f"{row['step_ms']:.0f} ({row['step_ms_p10']:.0f}-{row['step_ms_p90']:.0f})",
            steps_text, f"{row['final_eval_loss']:.3f}",
            f"{t:.1f} s" if t is not None else "never", row["speedup_text"],
        ])
    return render_table(headers, table)


def plot(results: Sequence[Any], analysis: dict[str, Any], path: Path, title: str,
         baseline: str) -> None:
    """Eval loss against training time (left) and against steps (right), one line per run
    (one colour per codec, one line per seed); dashed: the first seed's targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colors: dict[str, Any] = {}
    for r in results:
        style: dict[str, Any] = ({"linewidth": 2.2, "color": "black"} if r.label == baseline
                                 else {"linewidth": 1.2})
        if r.label in colors:
            style["color"] = colors[r.label]
        (line,) = ax_t.plot(_eval_times(r, analysis.get("clock", "sum")), r.eval_losses,
                            alpha=0.85,
                            label=r.label if r.label not in colors else None, **style)
        colors[r.label] = line.get_color()
        ax_s.plot(r.eval_steps, r.eval_losses, color=line.get_color(), alpha=0.85,
                  linewidth=style["linewidth"])
    first: list[float] = next(iter(analysis["targets"].values()), [])
    for ax in (ax_t, ax_s):
        for t in first:
            ax.axhline(t, color="gray", linestyle="--", linewidth=0.8)
        ax.grid(alpha=0.3)
    if first:
        ax_t.set_ylim(min(first) - 0.25, max(first) + 0.6)
    ax_t.set_xlabel(f"training time (s, {CLOCK_TEXT[analysis.get('clock', 'sum')]}; eval "
                    "excluded)", fontsize=8)
    ax_t.set_ylabel("eval loss (nats/byte)")
    ax_s.set_xlabel("optimizer steps")
    ax_t.set_title("time to accuracy (dashed: targets of the first seed)", fontsize=10)
    ax_s.set_title("loss per step (what compression costs in quality)", fontsize=10)
    ax_t.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ progress
def _terminal_bar_possible() -> bool:
    """A progress bar only where it renders: stderr is a terminal with a width."""
    if not sys.stderr.isatty():
        return False
    return shutil.get_terminal_size((0, 0)).columns > 0


class _Progress:
    """A line per finished run (always), and a tqdm bar over all steps where a terminal
    can show one."""

    def __init__(self, plan: Sequence[tuple[str, int, int]], bar: bool) -> None:
        self.plan = list(plan)
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.offsets = [0]
        for _, _, steps in self.plan:
            self.offsets.append(self.offsets[-1] + steps)
        self.bar: Any = None
        if bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.offsets[-1], unit="step", file=sys.stderr,
                            desc="starting workers", dynamic_ncols=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def __call__(self, event: dict[str, Any]) -> None:
        with self.lock:
            kind = event.get("event")
            idx = int(event.get("setup", 0))
            if kind == "start" and self.bar is not None:
                self.bar.set_description(f"{event.get('label')} seed {event.get('seed')}")
            elif kind == "step" and self.bar is not None:
                self.bar.update(max(0, self.offsets[idx] + int(event["step"]) - self.bar.n))
                self.bar.set_postfix(loss=f"{event['loss']:.3f}")
            elif kind == "done":
                if self.bar is not None:
                    self.bar.update(max(0, self.offsets[idx + 1] - self.bar.n))
                steps, cap = event.get("steps"), event.get("max_steps")
                how = (f"{steps} steps (stopped: all targets reached)"
                       if event.get("stopped_early") else f"{steps} of {cap} steps")
                self.write(
                    f"  [{idx + 1}/{len(self.plan)}, {time.perf_counter() - self.t0:.0f} s] "
                    f"{event['label']} seed {event.get('seed')}: {how}, median step "
                    f"{1e3 * event['step_time_median_s']:.0f} ms, "
                    f"{event['bits_per_coord']:.2f} bits/coord, final eval loss "
                    f"{event['final_eval_loss']:.3f}"
                    + ("" if event.get("replicas_identical") else ", REPLICAS DIFFER")
                )
            elif kind == "error":
                self.write(f"  {event['label']}: failed: {event.get('error')}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------ command
def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise CommpressError(f"{name} must be >= 1, got {value}")


@contextlib.contextmanager
def _cluster_up(layout: Any) -> Iterator[Any]:
    """The emulated cluster of ``layout`` (up, links measured), or ``None`` when local."""
    if not layout.emulated:
        yield None
        return
    from commpress.cluster import EmulatedCluster

    cluster = EmulatedCluster(nodes=layout.nodes, procs_per_node=layout.procs_per_node,
                              bandwidth=layout.bandwidth, latency=layout.latency,
                              owner="launch")
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()


def run(args: argparse.Namespace) -> int:
    from commpress.demo.e2e import Setup, resolve_layout, run_setups
    from commpress.demo.model import build_model, preset

    t_start = time.perf_counter()
    load_before = _loadavg()
    for name in ("steps", "nodes", "procs_per_node", "batch_size", "eval_every", "seeds",
                 "lossless_seeds", "eval_batches"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if not (math.isfinite(args.budget) and args.budget >= 1):
        raise CommpressError(f"--budget must be a number >= 1 (a multiple of fp16's steps), "
                             f"got {args.budget}")
    if not (math.isfinite(args.advisor_max_nmse) and args.advisor_max_nmse >= 0):
        raise CommpressError(f"--advisor-max-nmse must be a number >= 0, got "
                             f"{args.advisor_max_nmse}")
    if args.seed < 0:
        raise CommpressError(f"--seed must be >= 0, got {args.seed}")
    fractions = check_fractions(args.targets)
    if args.smooth < 1 or args.smooth % 2 == 0:
        raise CommpressError(f"--smooth must be an odd number >= 1, got {args.smooth}")
    codecs = list(args.codecs) if args.codecs else list(
        QUICK_CODECS if args.quick else DEFAULT_CODECS)
    codecs = [c.strip() for c in codecs if c.strip()]
    others = [c for c in dict.fromkeys(codecs) if c != BASELINE]
    lossless = None if args.lossless.strip().lower() in ("", "none") else args.lossless.strip()
    if not others and lossless is None and args.no_advisor:
        raise CommpressError(
            f"--codecs needs at least one codec besides the {BASELINE} baseline "
            f"(e.g. --codecs powersgd:rank=4 sign); list them with `commpress codecs`"
        )
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    n_seeds = args.seeds or (QUICK_SEEDS if args.quick else DEFAULT_SEEDS)
    seeds = list(range(args.seed, args.seed + n_seeds))
    eval_every = args.eval_every or min(steps, QUICK_EVAL_EVERY if args.quick
                                        else DEFAULT_EVAL_EVERY)
    eval_batches = args.eval_batches or (QUICK_EVAL_BATCHES if args.quick
                                         else DEFAULT_EVAL_BATCHES)
    if eval_every > steps:
        raise CommpressError(f"--eval-every {eval_every} exceeds --steps {steps}")
    warmup = args.warmup_steps if args.warmup_steps is not None else (
        QUICK_WARMUP_STEPS if args.quick else DEFAULT_WARMUP_STEPS)
    if warmup < 0:
        raise CommpressError(f"--warmup-steps must be >= 0, got {warmup}")
    if warmup >= steps:
        raise CommpressError(
            f"--warmup-steps {warmup} leaves no compressed step in --steps {steps}: every codec "
            "would just send fp16; lower --warmup-steps or raise --steps"
        )
    if steps // eval_every < 2:
        raise CommpressError(f"--steps {steps} with --eval-every {eval_every} gives fp16 fewer "
                             "than 2 evaluations after the start: no curve to take targets from")
    budget_steps = max(steps, int(math.ceil(args.budget * steps)))
    for spec in [*others, *([lossless] if lossless else [])]:
        Setup(codec=spec, warmup_steps=warmup).check()  # clear errors before anything starts
    if lossless is not None:
        from commpress.codecs.registry import get_codec

        if not get_codec(lossless).lossless:
            raise CommpressError(f"--lossless {lossless!r} is not a lossless codec")
    layout = resolve_layout(
        world_size=None, nodes=args.nodes, procs_per_node=args.procs_per_node,
        bandwidth=args.bandwidth, latency=args.latency,
        use_cluster=False if args.no_cluster else None,
    )
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommpressError(f"cannot create the output directory {out}: {exc}") from exc

    n_params = sum(p.numel() for p in build_model(preset(args.model), seed=0).parameters())
    print(f"commpress demo: {args.model} GPT ({n_params / 1e6:.2f}M parameters), {layout.note}",
          flush=True)
    if not layout.emulated:
        print("  note: without shaped links the network is not a bottleneck, so compression "
              "can only cost time here; run as root on Linux for the emulated slow network",
              flush=True)
    env = environment(args)
    with _cluster_up(layout) as cluster:
        link: dict[str, Any] | None = None
        link_bps: float | None = None
        if cluster is not None:
            report = cluster.check_links(intra=False)
            link = report.to_dict()
            rates = [lk.wire_bps for lk in report.inter]
            link_bps = statistics.median(rates) if rates else None
            measured = _format_bps(link_bps) if link_bps is not None else "no inter-node link"
            print(f"  measured link: {measured} on the wire"
                  + (f" (requested {layout.bandwidth})" if layout.bandwidth else ""), flush=True)
        grads: list[Any] = []
        compute_s = measure_compute(args.model, args.batch_size, layout.world_size,
                                    grads=grads, min_numel=DEFAULT_MIN_NUMEL)
        model_cluster = _demo_cluster(layout.nodes, layout.procs_per_node, link_bps)
        ctx = cluster_context(args.model, compute_s, model_cluster)
        advice: dict[str, Any] | None = None
        roles: dict[str, str] = {}
        if not args.no_advisor:
            advice = advisor_choice(args.model, compute_s, model_cluster, layout.world_size,
                                    grads=grads, max_nmse=args.advisor_max_nmse)
            choice = advice["codec"]
            print(f"  advisor (performance model, measured link, compute "
                  f"{1e3 * compute_s:.0f} ms/step): {advice['recommendation']}, predicted "
                  f"{advice['predicted_speedup']:.2f}x per step", flush=True)
            if choice != BASELINE and choice not in others and choice != lossless:
                others.append(choice)
            roles[choice] = "advisor"
        if lossless is not None:
            roles[lossless] = ", ".join(x for x in (roles.get(lossless), "lossless") if x)
        setups: list[Any] = []
        for i, seed in enumerate(seeds):
            setups.append(Setup(codec=BASELINE, seed=seed, steps=steps))
            setups.extend(Setup(codec=c, warmup_steps=warmup, seed=seed, steps=budget_steps)
                          for c in others)
            if lossless is not None and i < args.lossless_seeds:
                setups.append(Setup(codec=lossless, seed=seed, steps=budget_steps))
        print(f"  {len(setups)} runs: {', '.join(dict.fromkeys(s.name for s in setups))} x "
              f"{n_seeds} seed(s) ({lossless or 'no lossless codec'} on "
              f"{min(n_seeds, args.lossless_seeds)}); fp16 {steps} steps, the codecs up to "
              f"{budget_steps} ({args.budget:g}x), stopping once every target is reached; "
              f"codecs start after {warmup} fp16 steps; output in {out}/", flush=True)
        plan = [(s.name, s.seed, s.steps) for s in setups]
        progress = _Progress(plan, bar=not args.no_progress and _terminal_bar_possible())
        try:
            results = run_setups(
                setups, nodes=layout.nodes, procs_per_node=layout.procs_per_node,
                bandwidth=layout.bandwidth, latency=layout.latency, use_cluster=layout.emulated,
                steps=steps, batch_size=args.batch_size, model=args.model, seed=args.seed,
                lr=args.lr, eval_every=eval_every, eval_batches=eval_batches, work_dir=out,
                progress=progress, cluster=cluster,
                stop_rule={"baseline": BASELINE, "fractions": list(fractions),
                           "window": args.smooth},
            )
        finally:
            progress.close()
        link_after = None
        if cluster is not None:
            link_after = cluster.check_links(intra=False).to_dict()

    analysis = analyse(results, baseline=BASELINE, fractions=fractions, window=args.smooth,
                       clock=args.clock)
    rows = table_rows(results, analysis, roles)
    summaries = [analysis["summaries"][r["label"]] for r in rows if r["label"] != BASELINE]
    line = verdict(summaries, baseline=BASELINE, budget=args.budget)
    print()
    print(render(rows))
    print(f"\ntargets per seed: fp16's eval loss, smoothed over {args.smooth} evaluations, at "
          f"{', '.join(f'{f:.0%}' for f in fractions)} of its {steps} steps (every "
          f"{eval_every} steps evaluated); time = {CLOCK_TEXT[args.clock]} (eval excluded), "
          "interpolated between evaluations; speedup = geometric mean over the targets of "
          "fp16's time / the codec's; median over seeds, range in brackets; 'never' = a target "
          f"missed within {budget_steps} steps ({args.budget:g}x fp16's).")
    if advice is not None:
        choice = advice["codec"]
        if choice == BASELINE:
            check = "no compression: its row is fp16's"
        else:
            sp = analysis["summaries"][choice].speedups
            faster = sum(1 for x in sp if x is not None and x >= 1.0)
            check = (f"it reached fp16's loss sooner than fp16 in {faster} of {len(sp)} seeds"
                     + ("" if faster == len(sp) else " (SLOWER than fp16 in the others)"))
            advice["faster_than_fp16_seeds"] = faster
        print(f"advisor: the performance model's choice for this model on the measured link "
              f"was {advice['recommendation']} (predicted {advice['predicted_speedup']:.2f}x "
              f"per step); {check}")
    alt = [analysis["summaries_other_clock"][r["label"]] for r in rows
           if r["label"] != BASELINE]
    print(f"with time = {CLOCK_TEXT[analysis['other_clock']]} instead: "
          + ", ".join(f"{s.label} {s.describe()}" for s in alt))
    print(context_line(ctx))
    print(f"\nverdict: {line}")

    title = (f"commpress demo: {args.model} GPT, {layout.nodes}x{layout.procs_per_node} procs, "
             + (f"{layout.bandwidth or 'unshaped'} emulated links" if layout.emulated
                else "local loopback (links NOT shaped)") + f", {n_seeds} seed(s)")
    png = out / "demo.png"
    plot(results, analysis, png, title, BASELINE)
    load_after = _loadavg()
    report = {
        "format": "commpress-demo",
        "version": 2,
        "environment": {**env, "load_before": load_before, "load_after": load_after,
                        "wall_s": time.perf_counter() - t_start},
        "options": {k: v for k, v in vars(args).items() if k != "func"},
        "settings": {
            "codecs": [BASELINE, *others] + ([lossless] if lossless else []),
            "steps": steps, "budget": args.budget, "budget_steps": budget_steps,
            "seeds": seeds, "lossless_seeds": seeds[:args.lossless_seeds],
            "target_fractions": list(fractions), "smooth_window": args.smooth,
            "model": args.model, "batch_size": args.batch_size, "eval_every": eval_every,
            "eval_batches": eval_batches, "warmup_steps": warmup, "nodes": layout.nodes,
            "procs_per_node": layout.procs_per_node, "network": layout.network(),
            "quick": bool(args.quick),
        },
        "link": {"measured_bps": link_bps, "before": link, "after": link_after},
        "compute_s": compute_s,
        "advisor": advice,
        "context": {**ctx, "line": context_line(ctx)},
        "targets": analysis["targets"],
        "verdict": line,
        "table": rows,
        "tta": analysis["runs"],
        "clock": args.clock,
        "summaries": {k: v.to_dict() for k, v in analysis["summaries"].items()},
        "summaries_other_clock": {
            "clock": analysis["other_clock"],
            **{k: v.to_dict() for k, v in analysis["summaries_other_clock"].items()}},
        "runs": [r.to_dict() for r in results],
    }
    json_path = out / "demo.json"
    json_path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {json_path} and {png} ({time.perf_counter() - t_start:.0f} s in all; load "
          f"average {load_before[0] if load_before else '?'} before, "
          f"{load_after[0] if load_after else '?'} after)")
    if not all(r.replicas_identical for r in results):
        bad = ", ".join(sorted({r.label for r in results if not r.replicas_identical}))
        raise CommpressError(
            f"replicas ended with different parameters for: {bad} (a bug in the codec or "
            f"the DDP hook; see {json_path})"
        )
    return 0
