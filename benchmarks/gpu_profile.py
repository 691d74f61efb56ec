"""Where a codec's time goes on a GPU: host (Python, launches, synchronizations) or device.

    python benchmarks/gpu_profile.py --out gpu-profile.txt [--codecs minmax sign ...]

For each codec on float32 CUDA tensors, two sizes (1024 elements: the fixed cost of a call;
64 MB: the throughput):

* ``host us``: the wall time of one call without waiting for the device (what the Python
  side, the launches and any synchronization inside the call cost), median of 50;
* ``device us``: CUDA events around one call after the device is idle (host and device
  together, as ``commpress bench codecs`` times a call), median of 50;
* ``kernels``: device kernels per call and their summed time (torch.profiler), and the
  ``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaMemcpy`` calls per call that
  make the host wait (each a point where the launch queue drains);
* the profiler's table of the 12 operators with the most host time per size, in the text file.

Beside them, the floor of a call: a trivial Triton kernel launched from Python, one
``torch.empty``, one ``torch.cuda.synchronize`` of an idle device.

``--python N`` instead writes, per codec and operation on a 1024-element tensor, the N Python
functions with the most own time over 200 calls (cProfile; microseconds per call), which says
which part of the host time is the codec's Python, the kernel wrapper's, Triton's launcher or
torch's; ``--device cpu`` runs the same on the CPU (the numba kernels then count as host time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from commpress.codecs import CodecContext, get_codec
from commpress.metrics import gaussian

DEFAULT = ["fp16", "minmax", "sign", "qsgd", "terngrad", "thc", "topk", "dgc", "topkc",
           "randomk", "powersgd"]


def host_us(fn: Callable[[], object], n: int = 50) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def event_us(fn: Callable[[], object], n: int = 50) -> float:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def floor_costs() -> str:
    import triton
    import triton.language as tl

    @triton.jit
    def _nop(x_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    x = torch.zeros(1024, device="cuda")
    _nop[(1,)](x, 1024, BLOCK=1024)
    lines = [
        f"trivial Triton launch: host {host_us(lambda: _nop[(1,)](x, 1024, BLOCK=1024)):.1f} us",
        f"torch.empty(1024): host {host_us(lambda: torch.empty(1024, device='cuda')):.1f} us",
        f"torch add (one kernel): host {host_us(lambda: x.add(1.0)):.1f} us",
        f"synchronize of an idle device: host {host_us(lambda: None):.1f} us (timer floor)",
    ]
    return "\n".join(lines)


def per_call_profile(fn: Callable[[], object], calls: int
                     ) -> tuple[str, int, float, dict[str, int]]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = 0
    kernel_us = 0.0
    waits: dict[str, int] = {}
    for e in events:
        dev_type = str(getattr(e, "device_type", ""))
        if dev_type.endswith("CUDA") and e.key and not e.key.startswith("cuda"):
            kernels += e.count
            kernel_us += getattr(e, "self_device_time_total", 0.0) or getattr(
                e, "self_cuda_time_total", 0.0)
        for name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                     "cudaMemcpy", "cudaEventSynchronize"):
            if e.key == name:
                waits[name] = waits.get(name, 0) + e.count
    table = events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60)
    per = {k: round(v / calls) for k, v in waits.items()}
    return table, round(kernels / calls), kernel_us / calls, per


def python_profile(fn: Callable[[], object], top: int, calls: int = 200) -> str:
    """The ``top`` functions by own time over ``calls`` calls of ``fn``, per call."""
    for _ in range(5):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{path.rsplit('/', 2)[-1] if '/' in path else path}:{line}({name})"
        rows.append((tt, ct, nc, where))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows) / calls * 1e6
    out = io.StringIO()
    out.write(f"  python total {total:8.1f} us/call\n  {'own us':>8} {'cum us':>8} "
              f"{'calls':>6}  function\n")
    for tt, ct, nc, where in rows[:top]:
        out.write(f"  {tt / calls * 1e6:8.2f} {ct / calls * 1e6:8.2f} {nc / calls:6.1f}  "
                  f"{where}\n")
    return out.getvalue()


def python_report(specs: list[str], top: int, device: str, out_path: str) -> None:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    report = [f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
              f"torch {torch.__version__}, cProfile over 200 calls on 1024 float32 elements"]
    for spec in specs:
        codec = get_codec(spec)
        x = gaussian(1024, seed=0).to(device)
        ctx = CodecContext(key="profile")
        out = torch.empty_like(x)
        try:
            payload = codec.encode(x, ctx)
            for op, fn in (("encode", lambda: codec.encode(x, ctx)),  # noqa: B023
                           ("decode", lambda: codec.decode(payload, ctx, out=out))):  # noqa: B023
                text = python_profile(fn, top)
                sync()
                report.append(f"\n### {spec} {op}\n{text}")
                print(report[-1], flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            report.append(f"\n### {spec} error {type(exc).__name__}: {exc}"[:400])
            print(report[-1], flush=True)
        with open(out_path, "w") as f:
            f.write("\n".join(report) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", nargs="*", default=DEFAULT)
    ap.add_argument("--out", default="gpu-profile.txt")
    ap.add_argument("--size-mb", type=float, default=64.0)
    ap.add_argument("--python", type=int, default=0, metavar="N",
                    help="write the N Python functions with the most own time per call instead")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="with --python: where the tensors live")
    args = ap.parse_args(argv)
    if args.python and args.device == "cpu":
        python_report(args.codecs, args.python, "cpu", args.out)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.python:
        python_report(args.codecs, args.python, "cuda", args.out)
        return 0
    try:
        floors = floor_costs()
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on
        floors = f"floor costs: {type(exc).__name__}: {exc}"
    report = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}", floors, ""]
    print("\n".join(report), flush=True)
    header = (f"{'codec':9} {'size':>8} {'op':6} {'host us':>9} {'device us':>10} "
              f"{'kernels':>8} {'kernel us':>10} waits/call")
    print(header)
    report.append(header)
    tables = []
    for spec in args.codecs:
        codec = get_codec(spec)
        for n in (1024, int(args.size_mb * 1e6 / 4) // 4096 * 4096):
            x = gaussian(n, seed=0).to("cuda")
            if n > 4096:
                x = x.reshape(-1, 4096)
            ctx = CodecContext(key="profile")
            out = torch.empty_like(x)
            try:
                payload = codec.encode(x, ctx)
                ops: list[tuple[str, Callable[[], object]]] = [
                    ("encode", lambda: codec.encode(x, ctx)),  # noqa: B023
                    ("decode", lambda: codec.decode(payload, ctx, out=out)),  # noqa: B023
                ]
                for op, fn in ops:
                    h, d = host_us(fn), event_us(fn)
                    table, k, kus, waits = per_call_profile(fn, 10)
                    line = (f"{spec:9} {n:8d} {op:6} {h:9.1f} {d:10.1f} {k:8d} {kus:10.1f} "
                            f"{waits}")
                    print(line, flush=True)
                    report.append(line)
                    tables.append(f"\n### {spec} {op} n={n}\n{table}")
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                line = f"{spec:9} {n:8d} error {type(exc).__name__}: {exc}"[:400]
                print(line, flush=True)
                report.append(line)
            with open(args.out, "w") as f:
                f.write("\n".join(report) + "\n" + "\n".join(tables) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
