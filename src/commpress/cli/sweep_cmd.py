"""``commpress sweep``: where does each codec beat FP16? A grid of predictions.

The grid is every combination of model size (``--params``), node count (``--nodes``),
inter-node bandwidth (``--inter-bw``) and codec (``--codec``); the defaults give 4 x 5 x 5 x
(registered default codecs) >= 200 setups. Each setup is predicted next to the FP16 baseline on
the same cluster. Output: a CSV of every setup, a summary table per codec, and a PNG of
heatmaps (one row per codec, one column per model size, nodes against bandwidth, colour =
speedup over FP16).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Any

from commpress.codecs.registry import codec_ids
from commpress.report import render_table

DEFAULT_PARAMS = "125M,350M,1.3B,7B"
DEFAULT_NODES = "2,4,8,16,32"
DEFAULT_BANDWIDTHS = "1gbit,10gbit,25gbit,100gbit,400gbit"
DEFAULT_CODECS = ("powersgd:rank=4", "topk:ratio=0.01", "thc", "qsgd", "topkc")
#: Default error budget: per-step NMSE allowed (error feedback makes sparsifiers with NMSE
#: near 1 converge; above 1 the codec's error exceeds the gradient itself).
DEFAULT_MAX_NMSE = 1.0
CSV_FIELDS = [
    "model", "params", "nodes", "gpus_per_node", "inter_bw_bps", "codec", "strategy", "step_s",
    "baseline_s", "speedup", "compute_s", "exposed_comm_s", "codec_s", "bits_per_coordinate",
    "nmse",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    from commpress.cli.model_args import add_cluster_args, add_model_args, add_workload_args

    p = sub.add_parser(
        "sweep",
        help="predict a grid of model sizes x nodes x bandwidths x codecs against fp16",
        description="Predict every combination of --params, --nodes, --inter-bw and --codec "
        "against the fp16 baseline; write a CSV, a summary and a PNG of where each codec wins.",
    )
    p.add_argument("--params", default=DEFAULT_PARAMS,
                   help=f"model sizes, comma-separated ({DEFAULT_PARAMS}; ignored with --model, "
                   "--hf-config or --shapes)")
    p.add_argument("--nodes", default=DEFAULT_NODES, help=f"node counts ({DEFAULT_NODES})")
    p.add_argument("--inter-bw", default=DEFAULT_BANDWIDTHS,
                   help=f"inter-node bandwidths ({DEFAULT_BANDWIDTHS})")
    p.add_argument("--codec", action="append", default=[],
                   help="codec spec (repeat); default: the registered ones among "
                   + ", ".join(DEFAULT_CODECS))
    p.add_argument("--max-nmse", type=float, default=DEFAULT_MAX_NMSE,
                   help="error budget: codecs whose per-step NMSE (measured as `advise` does) "
                   f"exceeds it are listed last and marked (default {DEFAULT_MAX_NMSE:g})")
    p.add_argument("--out", default="sweep", help="output directory (sweep/)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_workload_args(p, single=False)
    add_cluster_args(p, single=False)
    add_model_args(p)
    p.set_defaults(func=run)


def _plot(rows: list[dict[str, Any]], codecs: list[str], models: list[str], nodes: list[int],
          bws: list[float], path: Path) -> None:
    """Heatmaps of speedup; ``bws`` in bits/s as in the rows' ``inter_bw_bps``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from commpress.units import format_bandwidth

    index = {(r["codec"], r["model"], r["nodes"], r["inter_bw_bps"]): r["speedup"] for r in rows}
    fig, axes = plt.subplots(
        len(codecs), len(models), figsize=(2.6 * len(models) + 1.2, 2.2 * len(codecs) + 0.8),
        squeeze=False, constrained_layout=True,
    )
    image = None
    for i, codec in enumerate(codecs):
        for j, model in enumerate(models):
            ax = axes[i][j]
            grid = np.array([[index.get((codec, model, n, b), math.nan) for b in bws]
                             for n in nodes])
            image = ax.imshow(np.log2(grid), cmap="RdBu", vmin=-2, vmax=2, origin="lower",
                              aspect="auto")
            if len(bws) * len(nodes) <= 49:
                for y in range(len(nodes)):
                    for x in range(len(bws)):
                        v = grid[y, x]
                        ax.text(x, y, "-" if math.isnan(v) else f"{v:.2g}", ha="center",
                                va="center", fontsize=6)
            ax.set_xticks(range(len(bws)))
            ax.set_xticklabels([format_bandwidth(b / 8).replace("bit/s", "") for b in bws],
                               fontsize=6, rotation=45)
            ax.set_yticks(range(len(nodes)))
            ax.set_yticklabels([str(n) for n in nodes], fontsize=6)
            if i == 0:
                ax.set_title(model, fontsize=8)
            if j == 0:
                ax.set_ylabel(f"{codec}\nnodes", fontsize=7)
            if i == len(codecs) - 1:
                ax.set_xlabel("inter-node bandwidth", fontsize=7)
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.6)
        bar.set_label("speedup over fp16 (log2 scale; blue wins)", fontsize=7)
        bar.set_ticks([-2, -1, 0, 1, 2])
        bar.set_ticklabels(["0.25x", "0.5x", "1x", "2x", "4x"])
    fig.suptitle("predicted speedup of each codec over the fp16 baseline", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from commpress.cli.model_args import (
        cluster_from_args,
        compute_seconds,
        model_kwargs,
        model_shapes_from_args,
        workload_common,
    )
    from commpress.errors import CommpressError, error_context
    from commpress.perfmodel.codec_costs import measure_nmse
    from commpress.perfmodel.model import Workload, predict, predict_baseline
    from commpress.units import (
        format_bandwidth,
        format_count,
        parse_bandwidth,
        parse_count,
        parse_list,
    )

    with error_context("--params"):
        params = parse_list(args.params, parse_count)
    with error_context("--nodes"):
        counts = parse_list(args.nodes, parse_count)
        if any(n != int(n) for n in counts):
            raise CommpressError(f"node counts must be whole numbers, got {args.nodes!r}")
    nodes = [int(n) for n in counts]
    with error_context("--inter-bw"):
        bws = parse_list(args.inter_bw, parse_bandwidth)
    known = set(codec_ids())
    codecs = args.codec or [c for c in DEFAULT_CODECS if c.partition(":")[0] in known]
    if not codecs:
        raise CommpressError("no codec to sweep: pass --codec")
    kwargs = model_kwargs(args)
    nmse = {spec: measure_nmse(spec) for spec in codecs}
    described = model_shapes_from_args(args)
    if described is not None:  # one real model instead of the --params sizes
        common = workload_common(args, described)
        workloads = [described.workload(compute_s=compute_seconds(args, described.numel),
                                        **common)]
    else:
        common = workload_common(args)
        workloads = [Workload.from_params(p, compute_s=compute_seconds(args, p), **common)
                     for p in params]
    # the bar counts the setups the summary counts (model x nodes x bandwidth x codec); the
    # fp16 baseline of each cluster is predicted on the way, not counted
    total = len(workloads) * len(nodes) * len(bws) * len(codecs)
    bar: Any = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="predicting", unit="setup")
    rows: list[dict[str, Any]] = []
    for w in workloads:
        model = format_count(w.params)
        for n in nodes:
            for b in bws:
                cluster = cluster_from_args(args, nodes=n, inter_bw=b * 8)
                base = predict_baseline(w, cluster, algorithm=args.algorithm,
                                        speeds=kwargs["speeds"], platform=kwargs["platform"])
                for spec in codecs:
                    pred = predict(w, cluster, spec, **kwargs)
                    bd = pred.breakdown()
                    rows.append({
                        "model": model, "params": w.params, "nodes": n,
                        "gpus_per_node": cluster.gpus_per_node, "inter_bw_bps": b * 8,
                        "codec": spec, "strategy": pred.strategy, "step_s": pred.total,
                        "baseline_s": base.total, "speedup": base.total / pred.total,
                        "compute_s": bd["compute"], "exposed_comm_s": bd["exposed_comm"],
                        "codec_s": bd["codec"],
                        "bits_per_coordinate": pred.bits_per_coordinate, "nmse": nmse[spec],
                    })
                    if bar is not None:
                        bar.update(1)
    if bar is not None:
        bar.close()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "sweep.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    png_path = out / "sweep.png"
    _plot(rows, codecs, [format_count(w.params) for w in workloads], nodes,
          [b * 8 for b in bws], png_path)

    within = {spec: nmse[spec] <= args.max_nmse for spec in codecs}
    # codecs within the error budget first, by best speedup; those over it last, marked
    order = sorted(codecs, key=lambda c: (not within[c], -max(
        r["speedup"] for r in rows if r["codec"] == c)))
    summary = []
    for spec in order:
        mine = [r for r in rows if r["codec"] == spec]
        wins = [r for r in mine if r["speedup"] > 1.0]
        best = max(mine, key=lambda r: r["speedup"])
        worst = min(mine, key=lambda r: r["speedup"])

        def where(r: dict[str, Any]) -> str:
            return (f"{r['speedup']:.3g}x ({r['model']}, {r['nodes']} nodes, "
                    f"{format_bandwidth(r['inter_bw_bps'] / 8)})")

        quality = "yes" if within[spec] else "NO: may not train"
        summary.append([spec, nmse[spec], quality, len(mine), len(wins), where(best),
                        where(worst)])
    print(render_table(["codec", "nmse", f"within budget (<= {args.max_nmse:g})", "setups",
                        "faster than fp16", "best", "worst"], summary))
    won = sum(1 for r in rows if r["speedup"] > 1.0)
    print(f"\n{len(rows)} setups (each against fp16 on the same cluster): a codec is faster in "
          f"{won}. Codec speeds: {kwargs['speeds'].source}.")
    print(f"table: {csv_path}\nplot: {png_path}")
    return 0
