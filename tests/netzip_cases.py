"""Shared inputs and checks of the netzip tests (tests/test_netzip_*.py)."""

from __future__ import annotations

import struct
from typing import Any

import torch

from commpress.codecs.netzip import grouping as gr
from commpress.codecs.netzip.framing import checksum
from commpress.testing import gaussian

KERNELS = ["numba", "torch"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def bits_of(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(gr.layout(x.dtype).int_dtype)


def assert_bit_exact(out: torch.Tensor, x: torch.Tensor) -> None:
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(bits_of(out), bits_of(x)), "round trip changed bits"


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Every awkward bit pattern: signed zeros, infinities, NaNs with payloads, subnormals,
    extremes, plus some ordinary values around them."""
    lay = gr.layout(dtype)
    w, man = lay.bits, lay.man_bits
    sign = 1 << (w - 1)
    exp_all = lay.emask << man
    patterns = [
        0, sign,                                  # +0, -0
        exp_all, sign | exp_all,                  # +-Inf
        exp_all | 1, exp_all | (1 << (man - 1)),  # signalling / quiet NaN
        sign | exp_all | ((1 << man) - 1),        # negative NaN, all payload bits
        exp_all | 0x5,                            # NaN with an odd payload
        1, sign | 1,                              # smallest subnormals
        (1 << man) - 1, sign | ((1 << man) - 1),  # largest subnormals
        1 << man,                                 # smallest normal
        exp_all - 1, sign | (exp_all - 1),        # largest finite
    ]
    words = torch.tensor(
        [p - (1 << w) if p >= (1 << (w - 1)) else p for p in patterns], dtype=torch.int64
    )
    words = words.to(lay.int_dtype) if w < 64 else words
    specials = words.view(dtype)
    return torch.cat([specials, gaussian(50, seed=3).to(dtype), specials.flip(0)])


CONFIGS: list[dict[str, Any]] = [
    {},
    {"context": "none"},
    {"context": "row"},
    {"grouping": "byte"},
    {"grouping": "bitplane"},
    {"grouping": "none"},
    {"grouping": "auto", "delta": "auto"},
    {"delta": "min"},
    {"delta": "mean"},
    {"delta": "median", "delta_op": "xor"},
    {"grouping": "byte", "delta": "min", "backend": "lz4"},
    {"backend": "ans", "mantissa_backend": "zstd", "level": 1},
    {"backend": "raw", "mantissa_backend": "raw", "zeros": False},
]


def stream_of(payload: Any) -> torch.Tensor:
    return payload.parts["stream"]


def with_stream(payload: Any, data: torch.Tensor) -> Any:
    return payload.replace(parts={"stream": data})


def recrc(data: bytes) -> torch.Tensor:
    """``data`` with its trailing checksum recomputed (a forged but well-formed stream)."""
    body = data[:-4]
    return torch.tensor(list(body + struct.pack("<I", checksum(body))), dtype=torch.uint8)
