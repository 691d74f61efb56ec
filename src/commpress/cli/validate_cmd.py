"""``commpress validate``: the performance model's predictions against real runs.

Example::

    commpress validate --out validation/            # full grid, ~10 minutes on 2 cores
    commpress validate --quick --out /tmp/v          # 5 setups, about a minute
    commpress validate --group 2x2:200mbit --codec fp16 --codec sign \
        --strategy auto --strategy ring --strategy hierarchical      # strategies crossed
    commpress validate --group 2x2:1gbit --codec fp16@ring --codec powersgd@hierarchical
    commpress validate --from validation/validation.json --out validation/   # refit only

Trains the built-in GPT with DDP on the emulated cluster for a grid of node counts, link
bandwidths, codecs and exchange strategies (``codec@strategy``), calibrates the platform
constants on one half of the runs and reports predicted against measured iteration time on
the other half (see
:mod:`commpress.experiments.validation`). Writes ``validation.json`` (summary, every row, fitted
platform, raw measurements), ``validation.png`` (scatter) and ``platform.json`` (for
``commpress predict --platform``) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from commpress.cli.argtypes import non_negative_int, positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    p = sub.add_parser(
        "validate",
        help="check the performance model against real runs on the emulated cluster",
        description="Run a grid of real DDP trainings of the built-in model on the emulated "
        "cluster (needs root and network namespaces), fit the platform constants on one half "
        "of the runs and report predicted vs measured iteration time on the other half.",
    )
    g = p.add_argument_group("grid")
    g.add_argument("--quick", action="store_true",
                   help="5 setups on one 2-node 100 Mbit/s cluster (a smoke test, ~1 minute)")
    g.add_argument("--group", action="append", default=[], metavar="NODES:BW",
                   help="a cluster of the grid, e.g. 4:200mbit or 2x2:1gbit (NODESxPROCS); "
                   "repeat; default: 8 clusters from 50mbit to 2gbit, 2 to 4 nodes")
    g.add_argument("--codec", action="append", default=[],
                   help="codec spec (repeat), optionally with the hook's exchange strategy "
                   "after '@' (fp16@ring, powersgd:rank=4@hierarchical); default: fp16, "
                   "powersgd:rank=4, topkc, sign, thc, plus fp16@allreduce, fp16@ring, "
                   "fp16@hierarchical, qsgd@allgather, powersgd:rank=4@hierarchical on 2x2 "
                   "processes")
    g.add_argument("--strategy", action="append", default=[],
                   choices=["auto", "allreduce", "allgather", "ring", "hierarchical",
                            "hierarchical-compress-first"],
                   help="exchange strategy of the DDP hook (repeat): every --codec written "
                   "without '@' runs with each; pairs the hook refuses (multi-round codecs "
                   "in a ring...) are skipped with a note. hierarchical* use the group's "
                   "processes per node (give NODESxPROCS groups)")
    g.add_argument("--steps", type=int, default=20,
                   help="training steps per setup (20; the first max(timing-skip, warmup) are "
                   "not timed)")
    g.add_argument("--warmup-steps", type=non_negative_int, default=2,
                   help="fp16 steps before a lossy codec starts (2)")
    g.add_argument("--timing-skip", type=non_negative_int, default=3,
                   help="start-up steps excluded from the timing (3)")
    g.add_argument("--model", default="tiny", choices=["tiny", "small", "medium"],
                   help="built-in model preset (tiny)")
    g.add_argument("--batch-size", type=positive_int, default=16,
                   help="global batch rows (16; rounded up to a multiple of the world size)")
    g.add_argument("--benchmark-steps", type=positive_int, default=12,
                   help="steps of the compute micro-benchmark before each cluster (12)")
    g.add_argument("--local", action="store_true",
                   help="allow unshaped local processes when namespaces are unavailable (the "
                   "comparison is then meaningless: a smoke test only)")
    a = p.add_argument_group("analysis")
    a.add_argument("--published", action="store_true",
                   help="instead of runs on the emulated cluster: reproduce Han et al.'s "
                   "BERT-large and VGG19 tables (network and compute calibrated on their "
                   "fp16/fp32 baselines only) and print predicted vs measured")
    a.add_argument("--from", dest="from_path", metavar="JSON",
                   help="refit a saved run (validation.json) instead of training")
    a.add_argument("--out", default="validation", help="output directory (validation/)")
    a.add_argument("--keep-logs", action="store_true",
                   help="keep each launch's worker logs under OUT/runs/")
    a.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def command_line(args: argparse.Namespace) -> str:
    """The ``commpress validate`` command that reproduces ``args`` (options that differ
    from their defaults)."""
    parts = ["commpress", "validate"]
    if args.quick:
        parts.append("--quick")
    for g in args.group:
        parts += ["--group", g]
    for c in args.codec:
        parts += ["--codec", c]
    for s in args.strategy:
        parts += ["--strategy", s]
    defaults = {"steps": 20, "warmup_steps": 2, "timing_skip": 3, "model": "tiny",
                "batch_size": 16, "benchmark_steps": 12}
    for name, default in defaults.items():
        value = getattr(args, name)
        if value != default:
            parts += ["--" + name.replace("_", "-"), str(value)]
    if args.local:
        parts.append("--local")
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from commpress.errors import CommpressError
    from commpress.experiments.validation import (
        DEFAULT_CODECS,
        analyse,
        default_grid,
        load_run,
        parse_group,
        plot,
        quick_grid,
        report_dict,
        run_validation,
        save_run,
        table,
        with_strategies,
    )

    if args.published:
        from commpress.perfmodel.published import reproduce

        print(reproduce().table())
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "validation.json"
    if args.from_path:
        if args.quick or args.group or args.codec or args.strategy:
            raise CommpressError("--from refits saved runs; it takes no grid options")
        measured = load_run(args.from_path)
    else:
        codecs = tuple(args.codec) or DEFAULT_CODECS
        if args.strategy:
            crossed, skipped = with_strategies(codecs, args.strategy)
            if skipped:
                print(f"skipped (strategy not supported by the codec): {', '.join(skipped)}",
                      file=sys.stderr)
            if not crossed:
                raise CommpressError(
                    f"no codec of {list(codecs)} supports the strategies {args.strategy}"
                )
            codecs = tuple(crossed)
        custom = bool(args.codec or args.strategy)
        if args.group:
            groups = [parse_group(g, codecs) for g in args.group]
        elif args.quick:
            groups = quick_grid() if not custom else [
                type(quick_grid()[0])(2, "100mbit", codecs)]
        else:
            groups = default_grid(codecs, () if custom else None)
        log = (lambda line: None) if args.quiet else (
            lambda line: print(line, file=sys.stderr, flush=True))
        measured = run_validation(
            groups, steps=args.steps, warmup_steps=args.warmup_steps,
            timing_skip=args.timing_skip, model=args.model, batch_size=args.batch_size,
            benchmark_steps=args.benchmark_steps, use_cluster=None if args.local else True,
            progress=not args.quiet, work_dir=out / "runs" if args.keep_logs else None,
            log=log,
        )
        measured.command = command_line(args)
        save_run(measured, out / "measurements.json")  # kept even if the analysis fails
    analysis = analyse(measured)
    print(table(analysis, measured))
    report = report_dict(measured, analysis)
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    png_path = out / "validation.png"
    plot(analysis, png_path)
    platform_path = out / "platform.json"
    analysis.calibration.fit.platform.save(platform_path)
    print(f"\nmeasured {len(measured.runs)} setups in {measured.wall_s:.0f} s"
          + (f" on {measured.date}" if measured.date else "")
          + f"\nreport: {json_path}\nplot: {png_path}\nplatform: {platform_path} "
          "(commpress predict --platform)")
    return 0
