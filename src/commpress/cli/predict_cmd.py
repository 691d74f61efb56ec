"""``commpress predict``: predicted step time with a codec, and the speedup over FP16.

Example::

    commpress predict --params 1.3e9 --compute-ms 250 --nodes 16 --gpus-per-node 8 \\
        --inter-bw 100gbit --intra-bw 600GB/s --codec powersgd:rank=4 --codec thc

``--calibrate-codecs`` instead measures the codecs' encode/decode speed on this machine (or
``--device cuda``) and stores it as JSON for ``--codec-speeds``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from commpress.codecs.registry import codec_ids
from commpress.report import render_table


def add_parser(sub: argparse._SubParsersAction) -> None:
    from commpress.cli.model_args import add_cluster_args, add_model_args, add_workload_args

    p = sub.add_parser(
        "predict",
        help="predict a training step's time with a codec and the speedup over fp16",
        description="Predict the time of one data-parallel training step with each --codec, "
        "its breakdown (compute, exposed communication, codec work on the critical path) and "
        "the speedup over the fp16 baseline (DDP with PyTorch's fp16_compress_hook).",
    )
    p.add_argument("--codec", action="append", default=[],
                   help="codec spec, e.g. powersgd:rank=4 (repeat for several)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_workload_args(p)
    add_cluster_args(p)
    add_model_args(p)
    c = p.add_argument_group("calibration")
    c.add_argument("--calibrate-codecs", action="store_true",
                   help="measure encode/decode speed of the --codec codecs (default: all "
                   "registered) on --device and write --save; no prediction")
    c.add_argument("--device", help="device for --calibrate-codecs (cpu)")
    c.add_argument("--save", help="output JSON for --calibrate-codecs")
    c.add_argument("--large",
                   help="elements of the large calibration tensor (1M; use >= 16M on a GPU)")
    p.set_defaults(func=run, precheck=_refuse_stray)


#: The calibration group's options: given without --calibrate-codecs they would be ignored (a
#: --save that writes nothing, a --device that predicts nothing for it)
_CALIBRATION_ONLY = ("save", "device", "large")


def _refuse_stray(args: argparse.Namespace) -> None:
    if args.calibrate_codecs:
        return
    stray = [f"--{k}" for k in _CALIBRATION_ONLY if getattr(args, k) is not None]
    if stray:
        from commpress.errors import CommpressError

        raise CommpressError(
            f"{', '.join(stray)} {'applies' if len(stray) == 1 else 'apply'} only with "
            "--calibrate-codecs (measure codec speeds and save them); a prediction takes a "
            "measured table with --codec-speeds FILE or --codec-device cpu|gpu for a built-in one"
        )


def _calibrate(args: argparse.Namespace) -> int:
    from commpress.errors import CommpressError
    from commpress.perfmodel.codec_costs import calibrate_speeds
    from commpress.units import format_count, parse_count, usable_device

    if not args.save:
        raise CommpressError("--calibrate-codecs needs --save PATH for the speed table")
    device = args.device or "cpu"
    usable_device(device)
    specs = args.codec or codec_ids()
    table = calibrate_speeds(specs, device=device, large=int(parse_count(args.large or "1M")),
                             progress=True)
    table.save(args.save)
    rows = [[k, f"{v.overhead_s * 1e6:.1f}", format_count(v.encode_eps),
             format_count(v.decode_eps)] for k, v in table.speeds.items()]
    print(render_table(["codec", "c0 (us)", "encode elem/s", "decode elem/s"], rows))
    print(f"{table.source}\nsaved to {args.save}; use --codec-speeds {args.save}")
    return 0


def result_row(name: str, pred: Any, base_total: float) -> list[Any]:
    from commpress.units import format_seconds

    b = pred.breakdown()
    return [
        name,
        pred.strategy,
        pred.bits_per_coordinate,
        format_seconds(pred.total),
        format_seconds(b["compute"]),
        format_seconds(b["exposed_comm"]),
        format_seconds(b["codec"]),
        base_total / pred.total,
    ]


def run(args: argparse.Namespace) -> int:
    if args.calibrate_codecs:
        return _calibrate(args)
    from commpress.cli.model_args import cluster_from_args, model_kwargs, workload_from_args
    from commpress.perfmodel.model import predict, predict_baseline, speedup_range
    from commpress.units import format_count, format_seconds

    workload = workload_from_args(args)
    cluster = cluster_from_args(args)
    kwargs = model_kwargs(args)
    specs = args.codec or (["powersgd:rank=4"] if "powersgd" in codec_ids() else ["bf16"])
    baseline = predict_baseline(workload, cluster, algorithm=args.algorithm,
                                speeds=kwargs["speeds"], platform=kwargs["platform"])
    preds = [predict(workload, cluster, spec, **kwargs) for spec in specs]
    range_kwargs = {k: v for k, v in kwargs.items() if k not in ("speeds", "platform")}
    ranges = [speedup_range(workload, cluster, spec, speeds=kwargs["speeds"],
                            platform=kwargs["platform"], **range_kwargs) for spec in specs]
    if args.json:
        def entry(pred: Any, spec: str = "fp16", rng: Any = None) -> dict[str, Any]:
            return {
                "speedup_range": None if rng is None else [rng.low, rng.high],
                "codec": spec,
                "strategy": pred.strategy,
                "step_s": pred.total,
                "breakdown": pred.breakdown(),
                "comm_busy_s": pred.timeline.comm_busy,
                "codec_busy_s": pred.timeline.codec_busy,
                "wire_bytes": pred.wire_bytes,
                "bits_per_coordinate": pred.bits_per_coordinate,
                "speedup_vs_fp16": baseline.total / pred.total,
            }

        print(json.dumps({
            "workload": {"name": workload.name, "params": workload.params,
                         "buckets": len(workload.buckets), "compute_s": workload.compute_s},
            "cluster": cluster.describe(),
            "codec_speeds": kwargs["speeds"].source,
            "platform": kwargs["platform"].to_dict(),
            "baseline": entry(baseline),
            "results": [entry(p, s, r) for s, p, r in zip(specs, preds, ranges, strict=True)],
        }, indent=2))
        return 0
    print(f"model: {workload.name}, {format_count(workload.params)} parameters in "
          f"{len(workload.buckets)} buckets; forward {format_seconds(workload.forward_s)}, "
          f"backward {format_seconds(workload.backward_s)}, optimizer "
          f"{format_seconds(workload.optimizer_s)}")
    print(f"cluster: {cluster.describe()}")
    print(f"codec speeds: {kwargs['speeds'].source}")
    print(f"platform: {kwargs['platform'].name}, overlap efficiency "
          f"{kwargs['platform'].overlap_efficiency:g}")
    rows = [result_row("fp16 (baseline)", baseline, baseline.total) + ["-", "-"]]
    for spec, p, r in zip(specs, preds, ranges, strict=True):
        verdict = ("faster" if r.low > 1 else "slower" if r.high < 1 else "within the range")
        rows.append(result_row(spec, p, baseline.total) + [f"{r.low:.3f}-{r.high:.3f}",
                                                           verdict])
    headers = ["codec", "strategy", "bits/coord", "step", "compute", "exposed comm", "codec",
               "speedup vs fp16", "range", "verdict"]
    print(render_table(headers, rows))
    print("compute, exposed comm and codec are the critical path's shares of the step "
          "(they add up to it). range: the speedup with the network and codec times moved "
          f"by the calibration's spread (network {kwargs['platform'].network_spread:.0%}, "
          f"codecs {max(kwargs['speeds'].spread, kwargs['platform'].codec_spread):.0%}); "
          "verdict: faster/slower than fp16 only when the whole range says so.")
    return 0
