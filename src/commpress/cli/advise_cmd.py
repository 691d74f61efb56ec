"""``commpress advise``: a codec per gradient bucket, or "no compression".

Examples::

    commpress advise --params 1.3e9 --compute-ms 250 --nodes 16 --inter-bw 25gbit
    commpress advise --demo-model small --compute-ms 40 --links links.json --gpus-per-node 1
    commpress advise --params 350M --max-nmse 1 --codec topk:ratio=0.01 --codec thc

``--links`` takes the emulated cluster's measured links (``commpress cluster status --json >
links.json``) or a flat JSON description. See :mod:`commpress.perfmodel.advisor` for the
algorithm.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from commpress.cli.argtypes import non_negative_int, positive_float


def add_parser(sub: argparse._SubParsersAction) -> None:
    from commpress.cli.model_args import add_cluster_args, add_model_args, add_workload_args

    p = sub.add_parser(
        "advise",
        help="recommend a codec per bucket (or no compression) for a model and a cluster",
        description="Recommend the codec of each gradient bucket that minimizes the predicted "
        "step time under an error budget, or 'no compression' (the fp16 baseline) when no "
        "codec pays.",
    )
    p.add_argument("--codec", action="append", default=[],
                   help="candidate codec spec (repeat; default: the registered ones among "
                   "the advisor's defaults)")
    p.add_argument("--max-nmse", default="0.5",
                   help="error budget: largest NMSE per step allowed (0.5; 'none' for no "
                   "budget; use 1 with error feedback)")
    p.add_argument("--nmse-table", help="JSON {codec spec: nmse} of measured errors (others "
                   "are measured on synthetic samples)")
    p.add_argument("--min-speedup", type=positive_float, default=1.05,
                   help="predicted speedup over fp16 needed to recommend compression (1.05)")
    p.add_argument("--max-passes", type=non_negative_int, default=2,
                   help="coordinate-descent passes over the buckets (2; 0: one codec for "
                   "every bucket)")
    p.add_argument("--emit-policy", metavar="FILE",
                   help="write the advice as a policy file that "
                   "commpress.ddp.register(model, policy=FILE) loads (a mixed choice needs "
                   "the model's parameter names: --demo-model)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show the codec of every bucket")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_workload_args(p)
    add_cluster_args(p)
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from commpress.cli.model_args import (
        bucket_names_from_args,
        cluster_from_args,
        model_kwargs,
        workload_from_args,
    )
    from commpress.errors import CommpressError, read_json
    from commpress.perfmodel.advisor import advise

    workload = workload_from_args(args)
    names = bucket_names_from_args(args)
    cluster = cluster_from_args(args)
    kwargs = model_kwargs(args)
    if str(args.max_nmse).lower() == "none":
        max_nmse = None
    else:
        try:
            max_nmse = float(args.max_nmse)
        except ValueError:
            raise CommpressError(
                f"--max-nmse must be a number or 'none', got {args.max_nmse!r}"
            ) from None
    table = None
    if args.nmse_table:
        table = read_json(args.nmse_table, f"--nmse-table {args.nmse_table}")
        if not isinstance(table, dict) or not all(
            isinstance(v, (int, float)) for v in table.values()
        ):
            raise CommpressError("--nmse-table must be a JSON object {codec spec: number}")
    from commpress.perfmodel.codec_costs import spec_key
    from commpress.perfmodel.model import BASELINE_CODEC
    from commpress.perfmodel.ratio import model_codec

    for spec in args.codec:
        try:
            key = spec_key(model_codec(spec))
        except CommpressError:
            continue  # advise() reports it, naming the candidate
        if key == BASELINE_CODEC:
            print(f"commpress advise: note: --codec {spec} is the baseline ({BASELINE_CODEC}, "
                  "no compression), which every bucket may keep anyway; it is not a separate "
                  "candidate", file=sys.stderr)
    bar: Any = None
    progress = None
    if not args.quiet and not args.json:
        from tqdm import tqdm

        bar = tqdm(desc="advising", unit="trial")

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.n = done
            bar.refresh()

    try:
        advice = advise(
            workload, cluster, candidates=args.codec or None, max_nmse=max_nmse,
            nmse_table=table, min_speedup=args.min_speedup, max_passes=args.max_passes,
            progress=progress, bucket_names=names, **kwargs,
        )
    finally:
        if bar is not None:
            bar.close()
    if args.emit_policy:
        from commpress.collectives.policy import POLICY_FILE_VERSION
        from commpress.perfmodel.ratio import RATIO_ID

        if any(str(c).partition(":")[0] == RATIO_ID for c in advice.choices):
            raise CommpressError(
                "--emit-policy: the advice uses the model-only 'ratio' codec, which nothing "
                "can train with; drop it from --codec to get a policy file"
            )

        policy = {"commpress_policy": POLICY_FILE_VERSION, "summary": advice.summary(),
                  "rules": advice.policy()}
        try:
            Path(args.emit_policy).write_text(json.dumps(policy, indent=2) + "\n")
        except OSError as exc:
            raise CommpressError(f"cannot write --emit-policy {args.emit_policy}: {exc}") from exc
    if args.json:
        print(json.dumps(advice.to_dict(), indent=2))
    else:
        print(advice.report(verbose=args.verbose))
        if args.emit_policy:
            print(f"policy written to {args.emit_policy}: load it with "
                  f"commpress.ddp.register(model, policy={str(args.emit_policy)!r})")
    return 0
