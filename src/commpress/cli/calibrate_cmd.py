"""``commpress calibrate``: measure this machine once, reuse the result in predict/sweep/advise.

Example::

    commpress calibrate --processes 2 --backend gloo --compute-ms 250 --out calib.json
    commpress predict --platform calib.json --params 25M --codec powersgd:rank=4

Measures the network with real all-reduces among ``--processes`` local processes (the job's
own process count; gloo or nccl over torch.distributed) at ``--sizes``, fits the alpha-beta
link (latency, bandwidth, spread); takes the codec speeds from ``--codec-speeds`` (a profile
of ``commpress bench codecs --profile``) or the built-in profile of ``--device``; and the
compute time from ``--compute-ms`` or a short timed run of ``--demo-model``. Writes one JSON
file (format ``commpress-calibration/1``) that ``--platform`` loads: its cluster, codec
speeds, compute time and spreads become the defaults of predict/sweep/advise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from typing import Any

from commpress.cli.argtypes import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure network (real collectives), codec speeds and compute once; write a "
        "platform file for predict/sweep/advise --platform",
        description="Measure the network with real all-reduces among local processes, take "
        "the codec profile and the compute time, and write a calibration file that "
        "`commpress predict/sweep/advise --platform FILE` load.",
    )
    p.add_argument("--processes", type=int, default=None,
                   help="processes of the job (ranks on this machine, default 2); under "
                   "torchrun the job's own ranks are measured instead, across its nodes")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--sizes", default="4kB,256kB,4MB",
                   help="all-reduce sizes, comma-separated (4kB,256kB,4MB)")
    p.add_argument("--repeats", type=positive_int, default=7, help="timed all-reduces per size (7)")
    p.add_argument("--device", choices=["cpu", "gpu"], default=None,
                   help="built-in codec profile when --codec-speeds is not given (default: "
                   "cpu for gloo, gpu for nccl)")
    p.add_argument("--codec-speeds", help="a device profile (commpress bench codecs --profile)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compute-ms", help="forward + backward time per step (ms)")
    g.add_argument("--demo-model", choices=["tiny", "small", "medium"],
                   help="time a few forward+backward steps of this built-in model instead")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps of --demo-model (5)")
    p.add_argument("--out", required=True, help="output JSON")
    p.set_defaults(func=run, out_kind="file")


def _demo_compute_s(preset_name: str, steps: int) -> float:
    """Median forward + backward seconds of the built-in model on this machine."""
    import statistics

    import torch

    from commpress.demo.model import build_model, preset

    cfg = preset(preset_name)
    model = build_model(cfg)
    seq = cfg.context
    vocab = cfg.vocab_size
    x = torch.randint(0, vocab, (8, seq))
    times = []
    for _ in range(max(1, steps) + 1):
        t0 = time.perf_counter()
        out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run(args: argparse.Namespace) -> int:
    from commpress.errors import CommpressError
    from commpress.perfmodel.calibration import (
        job_environment,
        measure_job_network,
        measure_network,
    )
    from commpress.units import parse_list, parse_size

    sizes = [int(s) for s in parse_list(args.sizes, parse_size)]
    job = job_environment()
    if job is None:
        processes = 2 if args.processes is None else args.processes
        fit = measure_network(processes, backend=args.backend, sizes=sizes,
                              repeats=args.repeats)
        cluster = {"nodes": 1, "gpus_per_node": processes,
                   "intra_bw": f"{fit.bandwidth:.6g}B/s",
                   "intra_latency": f"{fit.alpha_s * 1e6:.6g}us"}
        return _write(args, f"{processes} {args.backend} processes", cluster,
                      [("intra-node", fit)], processes)
    if args.processes is not None:
        raise CommpressError("--processes is for a run outside torchrun; under torchrun the "
                             "job's own ranks are measured")
    net = measure_job_network(backend=args.backend, sizes=sizes, repeats=args.repeats)
    if job[0] != 0:  # rank 0 writes and reports
        return 0
    fits = [(what, f) for what, f in (("inter-node", net.inter), ("intra-node", net.intra))
            if f is not None]
    return _write(args, f"torchrun job, {net.nodes} node(s) x {net.per_node} {args.backend} "
                  "rank(s)", net.cluster(), fits, net.per_node)


def _write(args: argparse.Namespace, label: str, cluster: dict[str, Any],
           fits: list[tuple[str, Any]], ranks_here: int) -> int:
    """Write the calibration file: the measured ``cluster`` and network ``fits`` (the first
    is the one a flat collective is limited by), the codec speeds (a CPU profile slowed to
    the share of the cores each of the ``ranks_here`` ranks on this machine gets) and the
    compute time."""
    import torch

    from commpress.errors import CommpressError
    from commpress.perfmodel.codec_costs import SpeedTable
    from commpress.perfmodel.model import CALIBRATION_FORMAT, Platform
    from commpress.units import format_bandwidth, format_seconds, parse_duration

    device = args.device or ("gpu" if args.backend == "nccl" else "cpu")
    speeds = SpeedTable.load(args.codec_speeds) if args.codec_speeds else SpeedTable.builtin(
        device)
    # The processes share this machine's cores: a CPU profile measured with more threads than
    # one process gets is slowed to the process's share (DDP ranks split the cores).
    threads = max(1, (os.cpu_count() or 1) // ranks_here)
    if device == "cpu":
        speeds = speeds.for_threads(threads)
    if args.compute_ms is not None:
        text = str(args.compute_ms).strip()
        compute_s: float | None = parse_duration(text if text[-1:].isalpha() else text + "ms")
    elif args.demo_model:
        compute_s = _demo_compute_s(args.demo_model, args.steps)
    else:
        compute_s = None
    if compute_s is not None and not compute_s > 0:
        raise CommpressError(f"compute time must be > 0, got {compute_s!r}")
    spread = max(f.spread for _, f in fits)
    platform = Platform(network_spread=spread, codec_spread=speeds.spread,
                        name=f"commpress calibrate ({label})")
    data: dict[str, Any] = {
        "format": CALIBRATION_FORMAT,
        "provenance": {
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "threads_per_process": threads,
            "command": shlex.join(["commpress", *sys.argv[1:]]),
        },
        "platform": platform.to_dict(),
        "cluster": cluster,
        "network": fits[0][1].to_dict(),
        **({"network_intra": fits[1][1].to_dict()} if len(fits) > 1 else {}),
        "compute_s": compute_s,
        "codec_speeds": speeds.to_dict(),
    }
    try:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    except OSError as exc:
        raise CommpressError(f"cannot write --out {args.out}: {exc}") from exc
    print(f"network: {label}")
    for what, fit in fits:
        print(f"  {what} all-reduce ({fit.processes} ranks) fit: alpha "
              f"{format_seconds(fit.alpha_s)}, bandwidth {format_bandwidth(fit.bandwidth)} "
              f"(spread {fit.spread:.0%})")
        for nbytes, times in fit.samples:
            med = sorted(times)[len(times) // 2]
            print(f"  {nbytes:>10} B: median {format_seconds(med)}, fit "
                  f"{format_seconds(fit.predicted(nbytes))}")
    print(f"codec speeds: {speeds.source} (spread {speeds.spread:.0%})")
    print("compute: " + (format_seconds(compute_s) if compute_s else "not given (pass "
                         "--compute-ms to predict)"))
    print(f"written to {args.out}; use commpress predict/sweep/advise --platform {args.out}")
    return 0
