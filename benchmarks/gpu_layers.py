"""Where one small call's host time goes on a GPU, layer by layer (no profiler attached).

    python benchmarks/gpu_layers.py [--out gpu-layers.txt] [--calls 300]

For codecs with one or two Triton launches per call, on a float32 CUDA tensor (``--numel``,
default 1024 elements: a call's fixed cost), the host time of one call (the mean over
``--calls`` back-to-back calls, the device synchronized only before and after them, best of
5 such runs) at each layer, outermost first:

* ``codec``: ``codec.encode`` / ``codec.decode(out=)`` as users call it;
* ``entry``: the kernel module's entry point (``kernels.minmax_encode`` ...: the backend
  switch, then the Triton wrapper's allocations and launch);
* ``launch``: the Triton kernel launched as the wrapper launches it (``kernel[grid](...)``:
  Triton's argument binding, specialization and cache lookup, then the native launch);
* ``compiled``: the same compiled kernel launched from its ``CompiledKernel`` handle
  (``compiled[grid](*args)``: no binding or lookup, the floor of a Python launch).

The launches are recorded from the wrapper's own call (a hook on ``JITFunction.run``) and
replayed with the same arguments, so each layer runs exactly what the codec runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from commpress.codecs import CodecContext, get_codec, kernels
from commpress.metrics import gaussian


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn: Callable[[], object], calls: int, runs: int = 5) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(runs):
        _sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
        _sync()
    return best * 1e6


def record_launches(fn: Callable[[], object]) -> list[tuple[Any, tuple, dict, Any, Any]]:
    """The Triton launches ``fn`` makes: (JITFunction, args, kwargs, grid, compiled kernel)
    each (none under Triton's interpreter, which launches through another class)."""
    from triton.runtime.jit import JITFunction

    seen: list[tuple[Any, tuple, dict, Any, Any]] = []
    original = JITFunction.run

    def hook(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        seen.append((self, args, dict(kwargs), grid, kernel))
        return kernel

    JITFunction.run = hook  # type: ignore[method-assign]
    try:
        fn()
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    return seen


def replays(seen: list) -> dict[str, Callable[[], None]]:
    """Callables that replay the recorded launches: through Triton's JIT launch (``launch``)
    and through the compiled kernels' handles (``compiled``)."""
    jit_calls = []
    compiled_calls = []
    for jit_fn, args, kwargs, grid, compiled in seen:
        jit_calls.append((jit_fn[grid], args, kwargs))
        device = torch.cuda.current_device()
        binder = jit_fn.device_caches[device][4]
        bound, _spec, _opts = binder(*args, **kwargs)
        g = tuple(grid) + (1,) * (3 - len(grid))
        compiled_calls.append((compiled[g], tuple(bound.values())))

    def via_jit() -> None:
        for launch, args, kwargs in jit_calls:
            launch(*args, **kwargs)

    def via_compiled() -> None:
        for runner, args in compiled_calls:
            runner(*args)

    return {"launch": via_jit, "compiled": via_compiled}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-layers.txt")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--numel", type=int, default=1024,
                    help="elements of the float32 input (1024: a call's fixed cost)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke test under TRITON_INTERPRET=1 COMMPRESS_KERNELS=triton "
                         "(codec and entry columns only)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_layers needs a CUDA GPU (torch.cuda.is_available() is False)")
    n = args.numel
    x = gaussian(n, seed=0).to(args.device)
    out = torch.empty_like(x)
    ctx = CodecContext(key="layers")
    entries: dict[str, Callable[[], object]] = {}
    for spec in ("minmax", "sign", "qsgd", "terngrad", "thc"):
        codec = get_codec(spec)
        payload = codec.encode(x, ctx)
        entries[f"{spec} encode"] = lambda c=codec: c.encode(x, ctx)  # type: ignore[misc]
        entries[f"{spec} decode"] = (  # type: ignore[misc]
            lambda c=codec, p=payload: c.decode(p, ctx, out=out))
    tg = kernels._load_triton()
    assert tg is not None, kernels._triton_error
    flat = x.reshape(-1)
    entry_fns: dict[str, Callable[[], object]] = {
        "minmax encode": lambda: kernels.minmax_encode(flat, chunk=min(n, 1024), bits=8,
                                                       stochastic=False),
        "sign encode": lambda: kernels.sign_encode_scaled(flat),
        "qsgd encode": lambda: kernels.qsgd_encode(flat, chunk=512, levels=127, bits=8,
                                                   clamp=0.0, seed=5),
        "terngrad encode": lambda: kernels.terngrad_encode(flat, chunk=n, seed=5),
    }
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)"
    lines = [f"{where}, torch {torch.__version__}, "
             f"{n} float32 elements, host us per call (mean of {args.calls}, best of 5)",
             f"{'call':18} {'codec':>8} {'entry':>8} {'launch':>8} {'compiled':>8} "
             f"{'launches':>9}"]
    print("\n".join(lines), flush=True)
    for name, codec_fn in entries.items():
        row = {"codec": host_us(codec_fn, args.calls)}
        entry = entry_fns.get(name)
        if entry is not None:
            row["entry"] = host_us(entry, args.calls)
        seen = record_launches(entry or codec_fn)
        try:
            for col, replay in replays(seen).items() if seen else ():
                row[col] = host_us(replay, args.calls)
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            lines.append(f"{name}: replay failed: {type(exc).__name__}: {exc}"[:300])
            print(lines[-1], flush=True)
        cells = " ".join(f"{row[k]:8.1f}" if k in row else f"{'-':>8}"
                         for k in ("codec", "entry", "launch", "compiled"))
        lines.append(f"{name:18} {cells} {len(seen):9d}")
        print(lines[-1], flush=True)
    floors = {
        "torch.empty(n)": lambda: torch.empty(n, device=args.device),
        "x.add(1.0)": lambda: x.add(1.0),
    }
    for name, fn in floors.items():
        lines.append(f"{name:18} {host_us(fn, args.calls):8.1f}")
        print(lines[-1], flush=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
