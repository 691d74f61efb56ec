"""``commpress bench ddp``: the DDP comm hook against DDP's own paths, side by side in one run.

On ``--world`` local gloo ranks (loopback), it trains one MLP per configuration, all from the
same weights on the same batches, with plain SGD:

* ``no hook``: DDP's built-in all-reduce;
* ``torch allreduce``: PyTorch's ``allreduce_hook``, the floor of any Python comm hook (DDP
  divides by the world size while it fills a bucket only when no hook is registered, and a
  Python hook finishes in a Python callback);
* ``torch fp16``: PyTorch's ``fp16_compress_hook``;
* ``commpress identity``: ``commpress.ddp.register(model, "identity")``;
* ``commpress fp16``: ``commpress.ddp.register(model, "fp16")``.

After ``--warmup`` untimed steps each (DDP rebuilds its buckets after the first step, the hook
checks its plans across ranks), every repeat runs ``--steps`` timed steps of each
configuration in turn, the order rotated by one per repeat (ABCDE, BCDEA, CDEAB, ...) so that
drift in the machine's load hits every configuration alike. A step (``zero_grad``, forward,
backward with the hook's reductions, ``optimizer.step``) is timed on every rank; the slowest
rank's time counts. Per repeat, each configuration's median step time; per configuration the
median over repeats and its min-max. Each commpress configuration is compared with its
reference (identity with no hook, fp16 with PyTorch's fp16 hook) by the paired ratio of the
medians of one repeat (same load), reported as the median over repeats with its min-max;
PyTorch's allreduce hook is compared with no hook the same way, so the table shows what any
Python hook costs over DDP's own path beside what commpress's identity hook costs.
Beside wall-clock time, each step's CPU time of the whole process (``time.process_time``: every
thread, gloo's and the hook's queue included; the busier rank counts) and the same paired
ratios: on a shared machine, CPU time is far less disturbed by other jobs than wall-clock
time, and the hook's overhead is CPU work.

Bit-identity: after the last repeat every configuration has taken the same steps on the same
data, so the parameters of the identity hook and of PyTorch's allreduce hook must equal those
of DDP without a hook, and the fp16 hook's those of PyTorch's (the same arithmetic: cast,
divide by the world size, sum, cast back); and every configuration's replicas must be
identical across ranks. Both are reported. (The identity hook sums before dividing, DDP
scales each gradient by the world size's reciprocal first and PyTorch's allreduce hook divides
first: the same bits when the world size is a power of two and no sum is subnormal or
overflows.)

Loopback gloo measures the software's cost far more than a network's: this is the benchmark
for the hook's overhead, not for compression's gains.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

from commpress.bench.ranks import run_ranks
from commpress.errors import CommpressError
from commpress.report import render_table

NO_HOOK, TORCH_ALLREDUCE, TORCH_FP16 = "no hook", "torch allreduce", "torch fp16"
CP_IDENTITY, CP_FP16 = "commpress identity", "commpress fp16"
#: The configurations, in the order of the first repeat.
CONFIGS: tuple[str, ...] = (NO_HOOK, TORCH_ALLREDUCE, TORCH_FP16, CP_IDENTITY, CP_FP16)
#: Each compared configuration and its reference (same results, bit for bit).
REFERENCES: dict[str, str] = {
    TORCH_ALLREDUCE: NO_HOOK, CP_IDENTITY: NO_HOOK, CP_FP16: TORCH_FP16,
}
#: The models: layer widths of an MLP (Linear + ReLU between layers).
MODELS: dict[str, tuple[int, ...]] = {
    "small": (256, 1024, 1024, 10),  # 1.3 M parameters, one or two DDP buckets
    "large": (1024, 4096, 4096, 1024, 10),  # 25.2 M parameters, four or five buckets
}
BATCH = 32
#: Distinct batches per rank, cycled through.
BATCHES = 8


def mlp_params(widths: tuple[int, ...]) -> int:
    """Parameters of the MLP with these layer widths (weights and biases)."""
    return sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))


def _build(widths: tuple[int, ...]) -> Any:
    import torch

    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(a, b))
    return torch.nn.Sequential(*layers)


def _install(name: str, model: Any) -> None:
    if name in (TORCH_ALLREDUCE, TORCH_FP16):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook if name == TORCH_ALLREDUCE
                                 else default_hooks.fp16_compress_hook)
    elif name in (CP_IDENTITY, CP_FP16):
        import commpress

        commpress.ddp.register(model, "identity" if name == CP_IDENTITY else "fp16")


def _progress(rank: int, text: str) -> None:
    if rank == 0:
        print(f"bench ddp: {text}", file=sys.stderr, flush=True)


def bench_model(
    rank: int, world: int, model: str, steps: int, repeats: int, warmup: int
) -> dict[str, Any]:
    """One rank's run of every configuration on ``model`` (see the module doc): per
    configuration the slowest rank's step times ``[repeat][step]`` in seconds, and the
    bit-identity checks."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    widths = MODELS[model]
    torch.manual_seed(0)
    base = _build(widths)
    g = torch.Generator().manual_seed(1000 + rank)
    data = [
        (torch.randn(BATCH, widths[0], generator=g),
         torch.randint(0, widths[-1], (BATCH,), generator=g))
        for _ in range(BATCHES)
    ]
    runs: dict[str, tuple[Any, Any]] = {}
    for name in CONFIGS:
        net = _build(widths)
        net.load_state_dict(base.state_dict())
        ddp = DDP(net)
        _install(name, ddp)
        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    done = dict.fromkeys(CONFIGS, 0)

    def step(name: str) -> tuple[float, float]:
        ddp, opt = runs[name]
        x, y = data[done[name] % BATCHES]
        done[name] += 1
        c0, t0 = time.process_time(), time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0, time.process_time() - c0

    for name in CONFIGS:
        for _ in range(warmup):
            step(name)
    _progress(rank, f"{model}: {warmup} warm-up steps per configuration done")
    times = {name: [[0.0] * steps for _ in range(repeats)] for name in CONFIGS}
    cpu = {name: [[0.0] * steps for _ in range(repeats)] for name in CONFIGS}
    for r in range(repeats):
        order = CONFIGS[r % len(CONFIGS):] + CONFIGS[: r % len(CONFIGS)]
        for name in order:
            dist.barrier()
            for s in range(steps):
                times[name][r][s], cpu[name][r][s] = step(name)
            both = torch.tensor([times[name][r], cpu[name][r]], dtype=torch.float64)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            times[name][r], cpu[name][r] = both.tolist()
            _progress(rank, f"{model}: repeat {r + 1}/{repeats}, {name}: "
                            f"{1e3 * statistics.median(times[name][r]):.2f} ms/step")
    params = {
        name: torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
        for name, (ddp, _) in runs.items()
    }
    same_as_reference = {
        name: bool(torch.equal(params[name], params[ref])) for name, ref in REFERENCES.items()
    }
    replicas = {}
    for name, flat in params.items():
        theirs = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(theirs, flat)
        replicas[name] = all(torch.equal(t, theirs[0]) for t in theirs)
    return {
        "model": model,
        "widths": list(widths),
        "params": mlp_params(widths),
        "times_s": times,
        "cpu_s": cpu,
        "same_as_reference": same_as_reference,
        "replicas_identical": replicas,
    }


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per configuration of one model's :func:`bench_model` result."""
    medians = {name: [statistics.median(r) for r in result["times_s"][name]]
               for name in CONFIGS}
    cpu = {name: [statistics.median(r) for r in result["cpu_s"][name]] for name in CONFIGS}

    def paired(values: dict[str, list[float]], name: str, ref: str | None) -> list[float]:
        if ref is None:
            return []
        return [a / b for a, b in zip(values[name], values[ref], strict=True) if b > 0]

    rows = []
    for name in CONFIGS:
        ms = [1e3 * t for t in medians[name]]
        ref = REFERENCES.get(name)
        ratios = paired(medians, name, ref)
        cpu_ratios = paired(cpu, name, ref)
        rows.append({
            "model": result["model"],
            "params": result["params"],
            "config": name,
            "ms_median": statistics.median(ms),
            "ms_min": min(ms),
            "ms_max": max(ms),
            "repeat_medians_ms": ms,
            "reference": ref,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "cpu_ms_median": 1e3 * statistics.median(cpu[name]),
            "cpu_ratio_median": statistics.median(cpu_ratios) if cpu_ratios else None,
            "cpu_ratio_min": min(cpu_ratios) if cpu_ratios else None,
            "cpu_ratio_max": max(cpu_ratios) if cpu_ratios else None,
            "bit_identical": result["same_as_reference"].get(name) if ref else None,
            "replicas_identical": result["replicas_identical"][name],
        })
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["model", "params (M)", "config", "ms/step (median)", "min-max over repeats",
               "vs", "ratio (median)", "ratio min-max", "CPU ms/step", "CPU ratio",
               "CPU ratio min-max", "bit-identical to vs", "replicas identical"]

    def num(value: float | None) -> float:
        return float("nan") if value is None else value

    def span(lo: float | None, hi: float | None, fmt: str) -> str:
        return "-" if lo is None or hi is None else f"{lo:{fmt}}-{hi:{fmt}}"

    body = [
        [r["model"], r["params"] / 1e6, r["config"], r["ms_median"],
         span(r["ms_min"], r["ms_max"], ".2f"), r["reference"] or "-",
         num(r["ratio_median"]), span(r["ratio_min"], r["ratio_max"], ".3f"),
         r["cpu_ms_median"], num(r["cpu_ratio_median"]),
         span(r["cpu_ratio_min"], r["cpu_ratio_max"], ".3f"),
         "-" if r["bit_identical"] is None else r["bit_identical"], r["replicas_identical"]]
        for r in rows
    ]
    return render_table(headers, body)


def machine() -> dict[str, Any]:
    """The machine's description for the JSON report."""
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def run_bench(
    steps: dict[str, int], *, world: int, repeats: int, warmup: int, threads: int = 1,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """Run the benchmark of every model in ``steps`` (model -> timed steps per configuration
    and repeat) on ``world`` local gloo ranks; returns the report (``rows``: one per model
    and configuration, see :func:`summarize`)."""
    unknown = sorted(set(steps) - set(MODELS))
    if unknown:
        raise CommpressError(f"unknown model(s) {unknown}; known: {sorted(MODELS)}")
    if world < 2:
        raise CommpressError(f"--world must be >= 2 (ranks on this machine), got {world}")
    if min(steps.values(), default=1) < 1 or repeats < 1 or warmup < 1:
        raise CommpressError(
            f"--steps, --repeats and --warmup must be >= 1, got {steps}, {repeats}, {warmup}"
        )
    report: dict[str, Any] = {"world": world, "steps": dict(steps), "repeats": repeats,
                              "warmup": warmup, "threads": threads, "batch": BATCH,
                              "machine": machine(), "rows": []}
    for model, n in steps.items():
        result = run_ranks(world, bench_model, (model, n, repeats, warmup),
                           threads=threads, timeout=timeout, what="bench ddp")
        report["rows"] += summarize(result)
    report["load_after"] = machine()["load_1_5_15"]
    return report


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ddp",
        help="time the commpress DDP hook (identity, fp16) against DDP without a hook and "
        "PyTorch's allreduce and fp16 hooks, side by side on gloo",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--model", choices=[*MODELS, "both"], default="both",
                   help="small: MLP 256-1024-1024-10 (1.3 M parameters); large: MLP "
                   "1024-4096-4096-1024-10 (25.2 M)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per configuration and repeat (default: 30 small, 8 large)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the configurations")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    p.add_argument("--world", type=int, default=2, help="ranks (processes on this machine)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for each model")
    p.add_argument("--json", default=None, help="also write the report as JSON to this file")
    p.set_defaults(func=run)


#: Default timed steps per configuration and repeat.
DEFAULT_STEPS = {"small": 30, "large": 8}


def run(args: argparse.Namespace) -> int:
    models = list(MODELS) if args.model == "both" else [args.model]
    steps = {m: args.steps if args.steps is not None else DEFAULT_STEPS[m] for m in models}
    if args.warmup == 1:
        print("bench ddp: note: with --warmup 1 the first timed step is the one after DDP "
              "rebuilds its buckets, whose one-off costs (the hook's checks of the new buckets) "
              "land in the timing: commpress fp16 measured 1.9x torch fp16 here for --steps 2, "
              "0.9x with --warmup 2; use --warmup 2 or more (default 3)", file=sys.stderr)
    report = run_bench(steps, world=args.world, repeats=args.repeats, warmup=args.warmup,
                       threads=args.threads, timeout=args.timeout)
    report = {"command": "commpress " + " ".join(sys.argv[1:]), **report}
    print(table(report["rows"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


__all__ = ["CONFIGS", "MODELS", "REFERENCES", "bench_model", "mlp_params", "run_bench",
           "summarize", "table"]
