"""Every codec on CUDA tensors, as ``commpress bench codecs --device cuda`` measures them, plus
the fixed cost of one call on a small tensor; a codec that fails is an error row, and the run
goes on (``commpress bench codecs`` stops at the first failure).

    python benchmarks/gpu_codecs.py --json gpu-codecs.json [--size-mb 64] [--repeat 5]

Per codec and dtype (float32, bfloat16): the columns of ``commpress bench codecs`` (input bytes
per second of one call, the device synchronized around it, best of ``--repeat``; the ratios
``enc_vs_copy`` / ``dec_into_vs_copy`` are against the better of the two hot device-to-device
copies sampled right before and right after the codec's timings, ``bench_codec``'s row
ceiling since branch mc23: the committed runs docs/results/codecs-h100-*.json predate it and
used the copy just before) and ``fixed_us``: the median wall time
of one encode and of one decode of a 1024-element tensor (the launch and Python cost a call
pays whatever its size), median of 50 after 5 warm-ups.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict
from typing import Any

import torch

from commpress.bench.codecs import bench_codec, gaussian, heavy_tailed
from commpress.codecs import CodecContext, get_codec, kernels
from commpress.codecs.registry import codec_ids


def fixed_cost_us(spec: str, dtype: torch.dtype, device: str, n: int = 1024
                  ) -> tuple[float, float]:
    codec = get_codec(spec)
    ctx = CodecContext(key="fixed")
    x = gaussian(n, seed=2).to(dtype=dtype, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    out = torch.empty_like(x)

    def med(fn: Any) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(50):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    payload = codec.encode(x, ctx)
    return med(lambda: codec.encode(x, ctx)), med(lambda: codec.decode(payload, ctx, out=out))


def write_json(path: str | None, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Rewritten after every row, so a run stopped at its time limit keeps what it measured."""
    if not path:
        return
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__,
            "triton": _version("triton"), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                time.gmtime()),
            "size_mb": args.size_mb, "repeat": args.repeat,
            "switch": kernels.requested_backend()}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=float, default=64.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--codecs", nargs="*", default=None)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_codecs needs a CUDA GPU for --device cuda "
                         "(torch.cuda.is_available() is False; --device cpu runs on the CPU)")
    specs = args.codecs or codec_ids()
    rows: list[dict[str, Any]] = []
    for dname in args.dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dname]
        numel = int(args.size_mb * 1e6 / torch.empty(0, dtype=dtype).element_size())
        cols = 4096
        n = numel // cols * cols
        x = gaussian(n, seed=0).reshape(-1, cols).to(dtype=dtype, device=args.device)
        heavy = heavy_tailed(n, seed=1).reshape(x.shape).to(dtype=dtype, device=args.device)
        print(f"{args.size_mb:g} MB {dname} on {args.device}, "
              f"{kernels.ENV_VAR}={kernels.requested_backend()}", flush=True)
        for spec in specs:
            row: dict[str, Any] = {"spec": spec, "dtype": dname}
            t0 = time.perf_counter()
            try:
                r = bench_codec(get_codec(spec), x, heavy, args.repeat)
                row.update({k: None if isinstance(v, float) and math.isnan(v) else v
                            for k, v in asdict(r).items()})
                row["enc_vs_copy"] = r.encode_vs_memcpy
                row["dec_into_vs_copy"] = r.decode_vs_memcpy
                row["fixed_enc_us"], row["fixed_dec_us"] = fixed_cost_us(spec, dtype, args.device)
                print(f"{spec:10} {dname} kernels={r.kernels:24} enc {r.encode_gbps:8.1f} "
                      f"dec->buf {r.decode_into_gbps:8.1f} copy {r.hot_memcpy_gbps:7.1f} GB/s "
                      f"enc/copy {r.encode_vs_memcpy:.3f} dec/copy {r.decode_vs_memcpy:.3f} "
                      f"fixed {row['fixed_enc_us']:.0f}/{row['fixed_dec_us']:.0f} us "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
            except Exception as exc:  # noqa: BLE001 - an error row, the run goes on
                row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                print(f"{spec:10} {dname} ERROR {row['error'][:600]}", flush=True)
            rows.append(row)
            write_json(args.json, args, rows)
    return 0


def _version(name: str) -> str | None:
    try:
        module = __import__(name)
    except ImportError:
        return None
    return str(getattr(module, "__version__", "?"))


if __name__ == "__main__":
    raise SystemExit(main())
