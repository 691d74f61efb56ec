"""Lossless compression of gradients on a GPU: nvCOMP's own codecs against byte / exponent
grouping followed by nvCOMP's ANS stage, and commpress ``netzip`` on the same tensors.

Run on a machine with a CUDA GPU and nvCOMP's Python package (``pip install
nvidia-nvcomp-cu13``, or ``-cu12``)::

    python benchmarks/nvcomp_compare.py --json nvcomp.json

For every tensor (Gaussian values, and a ResNet-18's gradients after one backward pass on a
random batch when torchvision is installed), in float32 and bfloat16, it prints the ratio (raw
bytes over compressed bytes) and encode / decode speed (input bytes over the wall time of one
call, the device synchronized before and after; median of ``--repeat`` after a warm-up) of:

* nvCOMP's codecs on the raw bytes (``ANS``, ``Cascaded``, ``Bitcomp``, ``LZ4``, ``Zstd``,
  ``GDeflate``, ``Deflate``, ``Snappy``; each one that the installed nvCOMP offers);
* ``bytes+ANS``: the bytes of each value regrouped into planes (byte ``i`` of every value
  together, a torch transpose on the GPU), each plane through nvCOMP's ANS;
* ``exponent+ANS``: the exponent field of every value in one plane (8 bits), the sign and
  mantissa bits in the others, each plane through nvCOMP's ANS (NetZIP's regrouping, the
  split done by torch on the GPU);
* commpress ``netzip`` (``get_codec('netzip')``) on the CUDA tensor: its grouping runs in
  torch on the GPU, its entropy stage on the CPU (the figures say what that costs).

Every round trip is checked bit for bit; a codec that fails to load or round-trip is
reported as an error row, not skipped silently. Beside them: a device-to-device copy of the
same tensor in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

NVCOMP_ALGOS = ("ANS", "Cascaded", "Bitcomp", "LZ4", "Zstd", "GDeflate", "Deflate", "Snappy")
WORD = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# (exponent shift, exponent mask) of each float layout
EXP_FIELD = {torch.float32: (23, 0xFF), torch.bfloat16: (7, 0xFF), torch.float16: (10, 0x1F)}


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median wall seconds of ``fn`` over ``repeat`` runs after one warm-up; its last result."""
    out = fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def byte_planes(x: torch.Tensor) -> list[torch.Tensor]:
    """Byte ``i`` of every value, one contiguous plane per byte (little-endian)."""
    b = x.contiguous().view(torch.uint8).view(-1, x.element_size())
    return [b[:, i].contiguous() for i in range(x.element_size())]


def from_byte_planes(planes: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.stack(planes, dim=1).contiguous().view(-1).view(dtype)


def exponent_planes(x: torch.Tensor) -> list[torch.Tensor]:
    """The exponent field in one uint8 plane; sign and mantissa with the exponent cleared, as
    byte planes (the bytes that hold no mantissa bit go as zeros: ANS codes them to nearly
    nothing, and the layout stays a plain byte split)."""
    shift, mask = EXP_FIELD[x.dtype]
    w = x.contiguous().view(WORD[x.dtype])
    exp = ((w >> shift) & mask).to(torch.uint8)
    rest = (w & ~(mask << shift)).view(x.dtype)
    return [exp, *byte_planes(rest)]


def from_exponent_planes(planes: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    shift, _ = EXP_FIELD[dtype]
    itype = WORD[dtype]
    rest = from_byte_planes(planes[1:], dtype).view(itype)
    return (rest | (planes[0].to(itype) << shift)).view(dtype)


def gradients(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    out = {"gaussian": (torch.randn(16 << 20, generator=g) * 1e-3).to(device)}
    try:
        import torchvision  # type: ignore[import-untyped]
    except ImportError:
        print("torchvision is not installed: no ResNet-18 gradients")
        return out
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=1000).to(device)
    x = torch.randn(32, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (32,), device=device)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    out["resnet18-grads"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return out


class Nv:
    """nvCOMP through its Python package; raises ImportError where it is missing."""

    def __init__(self) -> None:
        from nvidia import nvcomp  # type: ignore[import-not-found]

        self.nvcomp = nvcomp
        self.version = getattr(nvcomp, "__version__", "?")

    def codec(self, algo: str) -> Any:
        return self.nvcomp.Codec(algorithm=algo)

    def encode(self, codec: Any, planes: list[torch.Tensor]) -> list[Any]:
        return [codec.encode(self.nvcomp.as_array(p)) for p in planes]

    def decode(self, codec: Any, encoded: list[Any]) -> list[torch.Tensor]:
        return [torch.as_tensor(codec.decode(e), device="cuda").view(torch.uint8).reshape(-1)
                for e in encoded]

    @staticmethod
    def size(encoded: list[Any]) -> int:
        return sum(int(e.buffer_size) for e in encoded)


def run_nv(nv: Nv, algo: str, x: torch.Tensor, split: str, repeat: int) -> dict[str, Any]:
    codec = nv.codec(algo)
    if split == "raw":
        def planes_of(t: torch.Tensor) -> list[torch.Tensor]:
            return [t.contiguous().view(torch.uint8).reshape(-1)]

        def join(p: list[torch.Tensor]) -> torch.Tensor:
            return p[0].view(x.dtype)
    elif split == "bytes":
        planes_of = byte_planes

        def join(p: list[torch.Tensor]) -> torch.Tensor:
            return from_byte_planes(p, x.dtype)
    else:
        planes_of = exponent_planes

        def join(p: list[torch.Tensor]) -> torch.Tensor:
            return from_exponent_planes(p, x.dtype)
    t_enc, enc = timed(lambda: nv.encode(codec, planes_of(x)), repeat)
    t_dec, dec = timed(lambda: join(nv.decode(codec, enc)), repeat)
    if not torch.equal(dec.view(torch.uint8), x.contiguous().view(torch.uint8).reshape(-1)):
        raise AssertionError("round trip differs")
    return {"ratio": x.numel() * x.element_size() / nv.size(enc), "enc_s": t_enc, "dec_s": t_dec}


def run_netzip(x: torch.Tensor, repeat: int) -> dict[str, Any]:
    from commpress.codecs import get_codec

    codec = get_codec("netzip")
    t_enc, payload = timed(lambda: codec.encode(x), repeat)
    t_dec, dec = timed(lambda: codec.decode(payload), repeat)
    if not torch.equal(dec.reshape(-1).view(WORD[x.dtype]), x.reshape(-1).view(WORD[x.dtype])):
        raise AssertionError("round trip differs")
    return {"ratio": x.numel() * x.element_size() / payload.nbytes, "enc_s": t_enc,
            "dec_s": t_dec, "device": str(dec.device)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="write the rows as JSON")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("nvcomp_compare needs a CUDA GPU")
    dev = torch.device("cuda")
    try:
        nv: Nv | None = Nv()
        print(f"nvCOMP {nv.version}")
    except ImportError as exc:
        nv = None
        print(f"nvCOMP is not installed ({exc}): netzip rows only")
    rows: list[dict[str, Any]] = []
    print(f"{'tensor':16} {'dtype':9} {'codec':18} {'ratio':>7} {'enc GB/s':>9} {'dec GB/s':>9}")
    for name, base in gradients(dev).items():
        for dtype in (torch.float32, torch.bfloat16):
            x = base.to(dtype)
            nbytes = x.numel() * x.element_size()
            dst = torch.empty_like(x)
            t_copy, _ = timed(lambda: dst.copy_(x), args.repeat)  # noqa: B023
            cases: list[tuple[str, str, str]] = []  # (label, what, nvCOMP algorithm / split)
            if nv is not None:
                cases += [(f"nvcomp {a}", a, "raw") for a in NVCOMP_ALGOS]
                cases += [("bytes+ANS", "ANS", "bytes"), ("exponent+ANS", "ANS", "exponent")]
            cases += [("commpress netzip", "netzip", ""), ("d2d copy", "copy", "")]
            for label, what, split in cases:
                row: dict[str, Any] = {"tensor": name, "dtype": str(dtype).split(".")[1],
                                       "codec": label, "bytes": nbytes}
                try:
                    if what == "copy":
                        row.update(ratio=1.0, enc_s=t_copy, dec_s=t_copy)
                    elif what == "netzip":
                        row.update(run_netzip(x, args.repeat))
                    else:
                        assert nv is not None
                        row.update(run_nv(nv, what, x, split, args.repeat))
                    row["enc_GBps"] = nbytes / row["enc_s"] / 1e9
                    row["dec_GBps"] = nbytes / row["dec_s"] / 1e9
                    print(f"{name:16} {row['dtype']:9} {label:18} {row['ratio']:7.4f} "
                          f"{row['enc_GBps']:9.2f} {row['dec_GBps']:9.2f}", flush=True)
                except Exception as exc:  # noqa: BLE001 - reported as a row
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    print(f"{name:16} {row['dtype']:9} {label:18} error: {row['error']}",
                          flush=True)
                rows.append(row)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "nvcomp": nv.version if nv else None, "date": time.strftime("%Y-%m-%d"),
                "timing": f"wall time of one call, device synchronized, median of {args.repeat}"}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
