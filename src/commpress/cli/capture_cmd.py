"""``commpress capture``: save real gradients and activations of the built-in workload."""

from __future__ import annotations

import argparse
from pathlib import Path

from commpress.cli.argtypes import positive_float, positive_int
from commpress.errors import CommpressError


def _int_list(text: str) -> list[int]:
    text = text.strip()
    if not text:
        return []
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated step numbers like 0,1,2, got {text!r}"
        ) from None
    if any(s < 0 for s in steps):
        raise argparse.ArgumentTypeError(f"step numbers must be >= 0, got {text!r}")
    return steps


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capture",
        help="train the built-in tiny GPT and save gradients/activations as safetensors",
        description="Train the built-in tiny GPT from scratch on the Python standard library's "
        "source and save, at the chosen steps, every parameter gradient (grads), the embedding "
        "and block outputs (acts) and their gradients (act_grads), each in bf16, fp16 and fp32, "
        "as DIR/{kind}_stepNNNN_{dtype}.safetensors plus DIR/index.json. The defaults finish "
        "in well under a minute on 2 CPU cores.",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--early", type=_int_list, default=None,
                   help="early steps to capture (default 0,1,2)")
    p.add_argument("--late", type=_int_list, default=None,
                   help="late steps to capture (default 300,301,302; empty string: none)")
    p.add_argument("--steps", type=_int_list, default=None,
                   help="shorthand: capture exactly these steps (all labelled early); "
                   "cannot be combined with --early/--late")
    p.add_argument("--model", default="tiny",
                   help="model preset: tiny (default, 0.87M params), small (4.9M), medium (26M)")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", type=_name_list, default=["bf16", "fp16", "fp32"],
                   help="comma-separated subset of bf16,fp16,fp32")
    p.add_argument("--kinds", type=_name_list, default=["grads", "acts", "act_grads"],
                   help="comma-separated subset of grads,acts,act_grads")
    p.add_argument("--corpus-bytes", type=positive_int, default=None,
                   help="bytes of stdlib source to train on (default 2,000,000)")
    p.add_argument("--device", default=None, help="torch device (default cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from commpress.demo.capture import DEFAULT_EARLY, DEFAULT_LATE, capture
    from commpress.demo.data import stdlib_corpus
    from commpress.demo.model import preset
    from commpress.demo.train import DEFAULT_CORPUS_BYTES

    early: list[int]
    late: list[int]
    if args.steps is not None:
        if args.early is not None or args.late is not None:
            raise CommpressError("--steps replaces --early/--late; give one or the other")
        early, late = list(args.steps), []
    else:
        early = args.early if args.early is not None else list(DEFAULT_EARLY)
        late = args.late if args.late is not None else list(DEFAULT_LATE)
    if args.device is not None:
        from commpress.units import usable_device

        usable_device(args.device)
    corpus = stdlib_corpus(args.corpus_bytes or DEFAULT_CORPUS_BYTES)
    index = capture(
        Path(args.out), config=preset(args.model), early=early, late=late,
        batch_size=args.batch_size, lr=args.lr, seed=args.seed, dtypes=args.dtypes,
        kinds=args.kinds, corpus=corpus, device=args.device, progress=not args.no_progress,
    )
    total = sum(f["numel"] * {"bf16": 2, "fp16": 2, "fp32": 4}[f["dtype"]]
                for f in index["files"])
    steps = ", ".join(f"{s} ({index['loss'][str(s)]:.3f})" for s in
                      sorted({f["step"] for f in index["files"]}))
    print(f"wrote {len(index['files'])} files ({total / 1e6:.1f} MB) and index.json to "
          f"{args.out} in {index['seconds']:.1f} s; steps (loss): {steps}")
    return 0
