"""Check and time the Triton kernels on a CUDA GPU against the torch path, side by side.

    PYTHONPATH=src python benchmarks/triton_kernels.py [--out FILE] [--quick]

1. correctness: every ``minmax`` bit width (1-8) on fp32/fp16/bf16 inputs of odd sizes and
   chunk lengths (row and atomic-segment reductions), nearest and given-noise rounding, must
   equal the torch path (``quantize.minmax_encode_torch`` & co. on the same GPU) value for
   value; differences only in the sign of a zero chunk minimum are counted apart. Seeded
   stochastic rounding must equal the numba kernels on the CPU copy bit for bit. ``sign``
   likewise. Prints the failures (none expected).
2. speed: CUDA events around one call (so Python launch overhead counts), median of 30 after
   3 warm-ups, for 64 MB fp32 and bf16 inputs and a 4 KB one (the fixed cost), next to a
   device-to-device copy of the same input measured in the same run. GB/s are input bytes
   over the median. "triton" rows call the kernel entry points; "torch-codec" rows run the
   codec with ``COMMPRESS_KERNELS=torch`` (the path CUDA tensors took before the kernels).

The figures in docs/results/triton-kernels-h100.json come from this script.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from commpress.codecs import get_codec, kernels
from commpress.codecs.quantize import (
    minmax_decode_torch,
    minmax_encode_torch,
    sign_decode_torch,
    sign_encode_torch,
)


@triton.jit
def _one_program(x_ptr, n, BLOCK: tl.constexpr):
    # the cost of one launch from Python: a trivial kernel
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1.0, mask=i < n)


def sample(n: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-6, 7, (n,), generator=g).float())
    if n > 4:
        x[1], x[2], x[3] = 0.0, -0.0, x[0]
    return x.to(dtype).to(device)


class Checker:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.zero_signs: list[str] = []

    def same(self, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        a, b = a.cpu(), b.cpu()
        if a.shape != b.shape or a.dtype != b.dtype:
            self.failures.append(f"{what} (shape/dtype)")
            return
        if not a.is_floating_point():
            if not torch.equal(a, b):
                self.failures.append(what)
            return
        na, nb = a.isnan(), b.isnan()
        if not (bool((na == nb).all()) and bool((a[~na] == b[~nb]).all())):
            self.failures.append(what)
        elif not torch.equal(a[~na].view(torch.int32), b[~nb].view(torch.int32)):
            self.zero_signs.append(what)


def correctness(tg: Any, device: torch.device, quick: bool) -> dict[str, object]:
    check = Checker()
    sizes = [1, 9, 1000, 4099] if quick else [1, 7, 9, 1000, 4099, 100003, 3 * 2**20 + 5]
    combos = 0
    for n in sizes:
        for chunk in sorted({min(c, n) for c in (1, 5, 64, 1024, 2500, n)}):
            for bits in range(1, 9):
                for dtype in (torch.float32, torch.float16, torch.bfloat16):
                    x = sample(n, n + bits, dtype, device)
                    got = tg.minmax_encode(x, chunk=chunk, bits=bits, stochastic=False)
                    want = minmax_encode_torch(x.float(), chunk, bits, None)
                    for a, b in zip(got, want, strict=True):
                        check.same(a, b, f"minmax enc n={n} chunk={chunk} bits={bits} {dtype}")
                    check.same(
                        tg.minmax_decode(*got, chunk=chunk, bits=bits, n=n),
                        minmax_decode_torch(*want, chunk, bits, n),
                        f"minmax dec n={n} chunk={chunk} bits={bits}",
                    )
                    combos += 1
                if n > 200000 or not kernels.available():
                    continue
                seed = 2**62 + bits
                with kernels.use_backend("numba"):
                    want = kernels.minmax_encode(x.float().cpu(), chunk=chunk, bits=bits,
                                                 stochastic=True, seed=seed)
                got = tg.minmax_encode(x, chunk=chunk, bits=bits, stochastic=True, seed=seed)
                for a, b in zip(got, want, strict=True):
                    check.same(a, b, f"minmax seeded vs numba n={n} chunk={chunk} bits={bits}")
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = sample(n, n, dtype, device)
            packed, scale = tg.sign_encode_scaled(x)
            packed_t, scale_t = sign_encode_torch(x.float())
            check.same(packed, packed_t, f"sign bits n={n}")
            check.same(scale, scale_t, f"sign scale n={n} {dtype}")
            check.same(tg.sign_decode(packed, scale, n), sign_decode_torch(packed_t, scale_t, n),
                       f"sign dec n={n}")
    print(f"correctness: {combos} minmax combinations, {len(check.failures)} failures "
          f"{check.failures[:10]}; differing only in the sign of a zero chunk minimum: "
          f"{len(check.zero_signs)}", flush=True)
    return {"minmax_combinations": combos, "failures": check.failures[:30],
            "signed_zero_only_differences": len(check.zero_signs)}


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def cases(tg: Any, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    n, chunk = x.numel(), 1024
    out = torch.empty(n, device=x.device)
    dst = torch.empty_like(x)
    enc = tg.minmax_encode(x, chunk=chunk, bits=8, stochastic=False)
    signs = tg.sign_encode_scaled(x)
    torch_codecs = {s: get_codec(s) for s in ("minmax", "minmax:bits=4", "sign", "qsgd",
                                              "terngrad", "fp16")}
    with kernels.use_backend("torch"):
        payloads = {s: c.encode(x) for s, c in torch_codecs.items()}
    triton_codecs = {s: get_codec(s) for s in ("qsgd", "terngrad")}
    with kernels.use_backend("triton"):
        tri_payloads = {s: c.encode(x) for s, c in triton_codecs.items()}

    def torch_codec(spec: str, what: str) -> Callable[[], object]:
        def run() -> object:
            with kernels.use_backend("torch"):
                if what == "enc":
                    return torch_codecs[spec].encode(x)
                return torch_codecs[spec].decode(payloads[spec])
        return run

    def triton_codec(spec: str, what: str) -> Callable[[], object]:
        def run() -> object:
            with kernels.use_backend("triton"):
                if what == "enc":
                    return triton_codecs[spec].encode(x)
                return triton_codecs[spec].decode(tri_payloads[spec], out=dst)
        return run

    return {
        "copy (dst.copy_)": lambda: dst.copy_(x),
        "launch: one-program triton kernel": lambda: _one_program[(1,)](out, 128, BLOCK=128),
        "launch: torch.empty(1024)": lambda: torch.empty(1024, device=x.device),
        "minmax8 chunk=1000 enc triton (3 kernels)": lambda: tg.minmax_encode(
            x, chunk=1000, bits=8, stochastic=False
        ),
        "minmax8 enc triton": lambda: tg.minmax_encode(x, chunk=chunk, bits=8, stochastic=False),
        "minmax8 enc torch-codec": torch_codec("minmax", "enc"),
        "minmax8 dec->buf triton": lambda: tg.minmax_decode(
            *enc, chunk=chunk, bits=8, n=n, out=out
        ),
        "minmax8 dec torch-codec": torch_codec("minmax", "dec"),
        "minmax4 enc triton": lambda: tg.minmax_encode(x, chunk=chunk, bits=4, stochastic=False),
        "minmax4 enc torch-codec": torch_codec("minmax:bits=4", "enc"),
        "minmax2 stochastic enc triton": lambda: tg.minmax_encode(
            x, chunk=chunk, bits=2, stochastic=True, seed=9
        ),
        "sign enc triton": lambda: tg.sign_encode_scaled(x),
        "sign enc torch-codec": torch_codec("sign", "enc"),
        "sign dec->buf triton": lambda: tg.sign_decode(signs[0], signs[1], n, out=out),
        "sign dec torch-codec": torch_codec("sign", "dec"),
        "qsgd enc triton-codec": triton_codec("qsgd", "enc"),
        "qsgd enc torch-codec": torch_codec("qsgd", "enc"),
        "qsgd dec->buf triton-codec": triton_codec("qsgd", "dec"),
        "qsgd dec torch-codec": torch_codec("qsgd", "dec"),
        "terngrad enc triton-codec": triton_codec("terngrad", "enc"),
        "terngrad enc torch-codec": torch_codec("terngrad", "enc"),
        "terngrad dec->buf triton-codec": triton_codec("terngrad", "dec"),
        "terngrad dec torch-codec": torch_codec("terngrad", "dec"),
        "fp16 enc torch-codec": torch_codec("fp16", "enc"),
    }


def speeds(tg: Any, device: torch.device) -> dict[str, dict[str, dict[str, float]]]:
    result = {}
    for label, n, dtype in (("64MB fp32", 16 * 2**20, torch.float32),
                            ("64MB bf16", 32 * 2**20, torch.bfloat16),
                            ("4KB fp32", 1024, torch.float32)):
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
        nbytes = n * x.element_size()
        rows = {}
        for name, fn in cases(tg, x).items():
            med, lo, hi = timed(fn, 30)
            rows[name] = {"median_s": med, "min_s": lo, "max_s": hi, "gbps": nbytes / med / 1e9}
        copy = rows["copy (dst.copy_)"]["gbps"]
        for name, r in rows.items():
            r["vs_copy"] = r["gbps"] / copy
            print(f"{label:10s} {name:32s} {r['median_s'] * 1e6:9.1f} us {r['gbps']:8.1f} GB/s "
                  f"{r['vs_copy']:6.3f} x copy (min {r['min_s'] * 1e6:.1f}, max "
                  f"{r['max_s'] * 1e6:.1f} us)", flush=True)
        result[label] = rows
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="fewer correctness cases")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not kernels.available("triton"):
        print("needs a CUDA GPU and triton")
        return 2
    tg = kernels._load_triton()
    device = torch.device("cuda")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "correctness": correctness(tg, device, args.quick),
        "method": "CUDA events around one call (Python launch overhead included), median of "
                  "30 after 3 warm-ups; GB/s = input bytes / median; copy = dst.copy_(x) of "
                  "the same input in the same run",
        "speeds": speeds(tg, device),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    failures: list[str] = report["correctness"]["failures"]
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
