"""``commpress demo``: time-to-accuracy of compressed DDP training against an FP16 baseline.

Algorithm:

1. Resolve the cluster: by default 2 emulated nodes x 1 process joined by 50 Mbit/s links
   (network namespaces + ``tc``; needs root). Without root or namespaces, or with
   ``--no-cluster``, local processes on loopback, and the output says the links are not shaped.
2. Train the built-in tiny GPT from the same weights on the same data with DDP, once with the
   ``fp16`` codec (the honest baseline: what PyTorch's ``fp16_compress_hook`` sends) and once
   per ``--codecs`` entry (:func:`commpress.demo.e2e.run_setups`; all in one launch).
3. Target loss = the baseline's final eval loss + ``--tolerance`` (or ``--target-loss``). For
   every run: the training time at the first evaluation at or below the target, and the
   speedup = baseline's time / run's time ("never" if the run did not get there).
4. Print the table; write ``demo.json`` (settings, target, every run's full measurements) and
   ``demo.png`` (eval loss against training time and against steps) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
from pathlib import Path
from typing import Any

from commpress.demo.e2e import DEFAULT_WARMUP_STEPS
from commpress.errors import CommpressError
from commpress.report import render_table

#: Codecs run after the fp16 baseline by default: one of each family (low rank, chunked
#: sparsification, rotation + integer quantization, 1-bit with error feedback).
DEFAULT_CODECS = ("powersgd:rank=4", "topkc", "thc", "sign")
DEFAULT_BANDWIDTH = "50mbit"
DEFAULT_STEPS = 200
DEFAULT_TOLERANCE = 0.02
BASELINE = "fp16"
#: ``--quick``: enough to exercise every part (warm-up, compression, eval, table, plot).
QUICK_STEPS = 8
QUICK_EVAL_EVERY = 4
QUICK_EVAL_BATCHES = 2
QUICK_WARMUP_STEPS = 2
QUICK_CODECS = ("powersgd:rank=4",)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train with DDP on an emulated slow network: time-to-accuracy of codecs vs fp16",
        description="Train the built-in tiny GPT with DDP across real processes on an emulated "
        "slow network (2 nodes, 50 Mbit/s links by default; local processes without root), "
        "once with the fp16 baseline and once per codec, and report bits per coordinate, step "
        "time, final eval loss and the time to reach the baseline's loss (time-to-accuracy). "
        "The defaults take about 2-4 minutes on 2 CPU cores.",
    )
    p.add_argument("--codecs", nargs="+", metavar="SPEC", default=None,
                   help="codec specs to compare with fp16, space-separated "
                   f"(default: {' '.join(DEFAULT_CODECS)})")
    p.add_argument("--steps", type=int, default=None,
                   help=f"training steps per codec, the same for all (default {DEFAULT_STEPS})")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--procs-per-node", type=int, default=1,
                   help="processes per node (default 1; on 2 cores more only time-share them)")
    p.add_argument("--bandwidth", default=DEFAULT_BANDWIDTH,
                   help=f"each node's link rate, tc units (default {DEFAULT_BANDWIDTH}: sending "
                   "the tiny model's fp16 gradients, 1.7 MB, takes ~0.28 s, longer than "
                   "computing them on 2 CPU cores)")
    p.add_argument("--latency", default=None, help="round-trip time between nodes, e.g. 1ms "
                   "(needs the kernel's netem)")
    p.add_argument("--no-cluster", action="store_true",
                   help="run local processes on loopback (links not shaped)")
    p.add_argument("--model", default="tiny", choices=("tiny", "small"),
                   help="model preset: tiny (0.87M parameters, default) or small (4.9M)")
    p.add_argument("--batch-size", type=int, default=16, help="global rows per step (16)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate (default 3e-3 tiny, 1e-3 small)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first steps every codec sends as fp16 before compressing (default "
                   f"{DEFAULT_WARMUP_STEPS}; PowerSGD and sign need a few)")
    p.add_argument("--eval-every", type=int, default=None,
                   help="steps between eval losses: the time-to-accuracy resolution (10)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="eval loss to reach (default: fp16's final eval loss + --tolerance)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"nats/byte above fp16's final eval loss that still counts as reached "
                   f"(default {DEFAULT_TOLERANCE}, about the eval estimate's standard error)")
    p.add_argument("--out", default="commpress-demo",
                   help="output directory for demo.json, demo.png, workers.log "
                   "(default ./commpress-demo/)")
    p.add_argument("--quick", action="store_true",
                   help=f"a tiny run ({QUICK_STEPS} steps, powersgd only unless --codecs) to "
                   "check that everything works; numbers are meaningless")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------ analysis
def speedup_rows(results: list[Any], target: float) -> list[dict[str, Any]]:
    """Per run: time and steps to ``target`` and speedup over the first run (the baseline)."""
    base_t = results[0].time_to_loss(target)
    rows = []
    for r in results:
        t = r.time_to_loss(target)
        lo, hi = r.step_time_spread
        rows.append({
            "label": r.label,
            "bits_per_coord": r.bits_per_coord,
            "mb_per_step": r.bytes_per_step_median / 1e6,
            "link_mb_per_step": (r.link_bytes_median / 1e6
                                 if r.link_bytes_median is not None else None),
            "step_ms": 1e3 * r.step_time_median,
            "step_ms_p10": 1e3 * lo,
            "step_ms_p90": 1e3 * hi,
            "final_eval_loss": r.final_eval_loss,
            "time_to_target_s": t,
            "steps_to_target": r.steps_to_loss(target),
            "speedup": (base_t / t) if (t is not None and base_t is not None and t > 0) else None,
            "replicas_identical": r.replicas_identical,
        })
    return rows


def render(rows: list[dict[str, Any]], steps: int) -> str:
    headers = ["codec", "bits/coord", "MB/step", "step ms (p10-p90)", "final eval loss",
               "time to target", "speedup vs fp16"]
    table = []
    for row in rows:
        t = row["time_to_target_s"]
        reached = (f"{t:.1f} s (step {row['steps_to_target']})" if t is not None
                   else f"never ({steps} steps)")
        speed = f"{row['speedup']:.2f}x" if row["speedup"] is not None else "-"
        label = row["label"] + ("" if row["replicas_identical"] else " [REPLICAS DIFFER]")
        table.append([
            label, f"{row['bits_per_coord']:.2f}", f"{row['mb_per_step']:.3f}",
            f"{row['step_ms']:.0f} ({row['step_ms_p10']:.0f}-{row['step_ms_p90']:.0f})",
            f"{row['final_eval_loss']:.3f}", reached, speed,
        ])
    return render_table(headers, table)


def plot(results: list[Any], target: float, path: Path, title: str) -> None:
    """Eval loss against training time (left) and against steps (right), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for r in results:
        style = {"linewidth": 2.4, "color": "black"} if r is results[0] else {"linewidth": 1.5}
        (line,) = ax_t.plot(r.eval_times, r.eval_losses, marker="o", markersize=3,
                            label=r.label, **style)
        ax_s.plot(r.eval_steps, r.eval_losses, marker="o", markersize=3,
                  color=line.get_color(), linewidth=style["linewidth"])
        t = r.time_to_loss(target)
        if t is not None:
            ax_t.plot([t], [target], marker="*", markersize=11, color=line.get_color())
    for ax in (ax_t, ax_s):
        ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    finals = [r.final_eval_loss for r in results if math.isfinite(r.final_eval_loss)]
    if finals:  # zoom on the part of the curves that decides the comparison
        low = min(min(finals), target)
        ax_t.set_ylim(low - 0.1, max(low + 1.5, target + 0.5))
    ax_t.set_xlabel("training time (s, step times summed; eval excluded)")
    ax_t.set_ylabel("eval loss (nats/byte)")
    ax_s.set_xlabel("optimizer steps")
    ax_t.set_title("time to accuracy (star: target reached)", fontsize=10)
    ax_s.set_title("loss per step (what compression costs in quality)", fontsize=10)
    ax_t.text(0.01, 0.02, f"dashed: target {target:.3f}", transform=ax_t.transAxes,
              ha="left", va="bottom", fontsize=8, color="gray")
    ax_t.legend(fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ progress
class _Progress:
    """A tqdm bar over all steps of all runs, plus one status line per finished run."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.lock = threading.Lock()
        self.bar: Any = None
        self.done_steps = 0
        self.steps_per_setup = 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="step", file=sys.stderr, desc="starting workers",
                            dynamic_ncols=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def __call__(self, event: dict[str, Any]) -> None:
        with self.lock:
            kind = event.get("event")
            if kind == "start":
                if self.bar is not None:
                    self.bar.set_description(str(event.get("label")))
            elif kind == "step" and self.bar is not None:
                base = event["setup"] * self.steps_per_setup
                self.bar.update(max(0, base + int(event["step"]) - self.bar.n))
                self.bar.set_postfix(loss=f"{event['loss']:.3f}")
            elif kind == "done":
                self.write(
                    f"  {event['label']}: median step {1e3 * event['step_time_median_s']:.0f} ms,"
                    f" {event['bits_per_coord']:.2f} bits/coord, final eval loss "
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


def run(args: argparse.Namespace) -> int:
    from commpress.demo.e2e import Setup, resolve_layout, run_setups
    from commpress.demo.model import build_model, preset

    for name in ("steps", "nodes", "procs_per_node", "batch_size", "eval_every"):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise CommpressError(f"--tolerance must be a number >= 0, got {args.tolerance}")
    if args.target_loss is not None and not (math.isfinite(args.target_loss)
                                             and args.target_loss > 0):
        raise CommpressError(f"--target-loss must be a positive number, got {args.target_loss}")
    codecs = list(args.codecs) if args.codecs else list(
        QUICK_CODECS if args.quick else DEFAULT_CODECS)
    codecs = [c.strip() for c in codecs if c.strip()]
    others = [c for c in dict.fromkeys(codecs) if c != BASELINE]
    if not others:
        raise CommpressError(
            f"--codecs needs at least one codec besides the {BASELINE} baseline "
            f"(e.g. --codecs powersgd:rank=4 sign); list them with `commpress codecs`"
        )
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    eval_every = args.eval_every or min(steps, QUICK_EVAL_EVERY if args.quick else 10)
    eval_batches = QUICK_EVAL_BATCHES if args.quick else 8
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
    setups = [Setup(codec=BASELINE), *(Setup(codec=c, warmup_steps=warmup) for c in others)]
    for s in setups:
        s.check()  # clear errors for bad specs before anything starts
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
    print(f"  {len(setups)} runs ({', '.join(s.name for s in setups)}) x {steps} steps, "
          f"global batch {args.batch_size}, codecs start after {warmup} fp16 steps; "
          f"output in {out}/", flush=True)

    progress = _Progress(total=steps * len(setups), enabled=not args.no_progress)
    progress.steps_per_setup = steps
    try:
        results = run_setups(
            setups, nodes=layout.nodes, procs_per_node=layout.procs_per_node,
            bandwidth=layout.bandwidth, latency=layout.latency, use_cluster=layout.emulated,
            steps=steps, batch_size=args.batch_size, model=args.model, seed=args.seed,
            lr=args.lr, eval_every=eval_every, eval_batches=eval_batches, work_dir=out,
            progress=progress,
        )
    finally:
        progress.close()

    baseline = results[0]
    target = (args.target_loss if args.target_loss is not None
              else baseline.final_eval_loss + args.tolerance)
    rows = speedup_rows(results, target)
    how = ("--target-loss" if args.target_loss is not None
           else f"fp16's final eval loss {baseline.final_eval_loss:.3f} + {args.tolerance:g}")
    print()
    print(render(rows, steps))
    print(f"\ntarget eval loss {target:.3f} ({how}); time = summed step times (eval excluded), "
          f"resolution {eval_every} steps; speedup = fp16's time to target / the codec's.")
    print("bits/coord and MB/step: what one rank hands to collectives per step (steady state).")

    title = (f"commpress demo: {args.model} GPT, {layout.nodes}x{layout.procs_per_node} procs, "
             + (f"{layout.bandwidth or 'unshaped'} emulated links" if layout.emulated
                else "local loopback (links NOT shaped)"))
    png = out / "demo.png"
    plot(results, target, png, title)
    report = {
        "format": "commpress-demo",
        "version": 1,
        "options": {k: v for k, v in vars(args).items() if k != "func"},
        "settings": {
            "codecs": [s.codec for s in setups], "steps": steps, "model": args.model,
            "batch_size": args.batch_size, "seed": args.seed, "eval_every": eval_every,
            "eval_batches": eval_batches, "warmup_steps": warmup, "nodes": layout.nodes,
            "procs_per_node": layout.procs_per_node, "network": layout.network(),
            "quick": bool(args.quick),
        },
        "target_loss": target,
        "target_rule": how,
        "table": rows,
        "runs": [r.to_dict() for r in results],
    }
    json_path = out / "demo.json"
    json_path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {json_path} and {png}")
    if not all(r.replicas_identical for r in results):
        bad = ", ".join(r.label for r in results if not r.replicas_identical)
        raise CommpressError(
            f"replicas ended with different parameters for: {bad} (a bug in the codec or "
            f"the DDP hook; see {json_path})"
        )
    return 0
