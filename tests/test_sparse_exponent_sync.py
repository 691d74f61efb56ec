"""Top-K's and DGC's exponent scaling off the CPU (review rv26b): no host read of the
exponent, and the same values as :func:`scale_values`.

The device branch of :func:`commpress.codecs.sparse.encode_values` runs on CUDA only; meta
tensors take it here and fail on any ``.item()`` (which on CUDA would sync the host)."""

from __future__ import annotations

import math

import pytest
import torch

from commpress.codecs import get_codec, sparse
from commpress.codecs.common import scale_values

_PAIRS = [
    (xd, vd)
    for xd in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    for vd in (torch.float16, torch.bfloat16, torch.float32)
    if sparse.needs_exponent(xd, vd)
]


@pytest.mark.parametrize("input_dtype, value_dtype", _PAIRS)
def test_device_branch_reads_nothing_on_the_host(
    input_dtype: torch.dtype, value_dtype: torch.dtype
) -> None:
    codec = get_codec("topk")
    x = torch.empty(64, dtype=input_dtype, device="meta")
    parts = sparse.encode_values(codec, x, x[:9], value_dtype)  # .item() raises on meta
    assert parts["values"].shape == (9,) and parts["values"].dtype == value_dtype
    assert parts["exponent"].shape == (1,)
    assert parts["exponent"].dtype == sparse.exponent_dtype(input_dtype)


@pytest.mark.parametrize("input_dtype, value_dtype", _PAIRS)
def test_table_scaling_equals_scale_values(
    input_dtype: torch.dtype, value_dtype: torch.dtype
) -> None:
    _, factors = sparse._exponent_tables(torch.device("cpu"), input_dtype, value_dtype)
    g = torch.Generator().manual_seed(7)
    top = torch.finfo(input_dtype).max
    base = torch.randn(301, generator=g, dtype=torch.float64)
    specials = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, top, -top, torch.finfo(input_dtype).tiny,
         torch.finfo(input_dtype).tiny / 4, 1.0, -1.0], dtype=torch.float64,
    )
    for scale in (1.0, 1e-30, 1e4, 6e4, 1e30, 1e38, 3e38, 1e300):
        selected = torch.cat([base * scale, specials]).to(input_dtype)
        for e in sorted({0, 1, 2, 17, factors.numel() - 1}):
            if e >= factors.numel():
                continue
            et = torch.tensor(e)
            want = scale_values(selected, value_dtype, et)
            got = sparse._scale_by_table(selected, factors, et, value_dtype)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.int16 if got.itemsize == 2 else torch.int32),
                               want.view(torch.int16 if want.itemsize == 2 else torch.int32)), (
                scale, e)
