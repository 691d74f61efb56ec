"""Baseline codecs: identity, fp16, bf16."""

from __future__ import annotations

import pytest
import torch

from commpress.codecs import get_codec, simulate
from commpress.testing import (
    check_aggregate,
    check_order_independent,
    check_round_trip,
    check_wire_bits,
    gaussian,
    heavy_tailed,
    run_all_contract_checks,
)


@pytest.mark.parametrize("codec_id", ["identity", "fp16", "bf16"])
def test_contract(codec_id: str) -> None:
    run_all_contract_checks(get_codec(codec_id))


def test_identity_is_bit_exact_for_special_values() -> None:
    x = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45])
    _, out = check_round_trip(get_codec("identity"), x)
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize(("codec_id", "bits", "unit_roundoff"), [
    ("fp16", 16, 2.0**-11), ("bf16", 16, 2.0**-8), ("identity", 32, 0.0),
])
def test_wire_size_and_error_bound(codec_id: str, bits: int, unit_roundoff: float) -> None:
    codec = get_codec(codec_id)
    x = gaussian(4096)
    check_wire_bits(codec, x, bits * 4096)
    # Round-to-nearest: each value's relative error is at most the unit roundoff u, so the
    # NMSE is at most u^2 (values stay inside the normal range for N(0,1) samples here).
    check_round_trip(codec, x, max_nmse=unit_roundoff**2)
    check_round_trip(codec, heavy_tailed(4096), max_nmse=unit_roundoff**2)


def test_fp16_overflow_becomes_inf() -> None:
    out = get_codec("fp16").decode(get_codec("fp16").encode(torch.tensor([1e6, -1e6, 1.0])))
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2] == 1.0


def test_fp16_average_matches_pytorch_hook_arithmetic() -> None:
    """fp16 with average: cast, divide by the world size in fp16, sum in fp16, cast back --
    the order of PyTorch's fp16_compress_hook -- so the result is bit-identical to it."""
    inputs = [gaussian(1000, seed=s) * 1000 for s in range(3)]
    sim = simulate(get_codec("fp16"), inputs, average=True)
    expected = inputs[0].half() / 3
    for x in inputs[1:]:
        expected += x.half() / 3
    assert sim.total.dtype == torch.float32
    assert torch.equal(sim.total, expected.float())
    # Without the pre-division these fp16 sums (values ~ 3 * 1000 * 4 sigma) stay finite too,
    # but the average path must not be the sum divided afterwards:
    summed = simulate(get_codec("fp16"), inputs).total
    assert not torch.equal(summed / 3, sim.total)


@pytest.mark.parametrize("codec_id", ["identity", "fp16", "bf16"])
def test_aggregate_of_four_workers(codec_id: str) -> None:
    inputs = [gaussian(2048, seed=s) for s in range(4)]
    # Casting each input costs relative error <= u per element and each of the 3 additions in
    # the wire format rounds again with relative error <= u on partial sums of similar size,
    # so the per-element relative error is <= ~(1 + 3) u and the NMSE <= 16 u^2:
    # fp16 (u = 2^-11): 3.8e-6; bf16 (u = 2^-8): 2.4e-4. Bounds below add a factor ~2.5-4.
    bound = {"identity": 1e-12, "fp16": 1e-5, "bf16": 1e-3}[codec_id]
    check_aggregate(get_codec(codec_id), inputs, max_nmse=bound)


def test_identity_sum_is_exact_for_integers_in_any_order() -> None:
    inputs = [torch.randint(-100, 100, (500,), generator=torch.Generator().manual_seed(s)).float()
              for s in range(5)]
    check_order_independent(get_codec("identity"), inputs)


def test_bf16_decode_saturates_instead_of_overflowing_float16() -> None:
    """bfloat16 rounds fp16's largest value 65504 up to 65536, which used to decode to +Inf in
    a float16 output; decoding now saturates finite values at 65504 and keeps NaN/Inf."""
    codec = get_codec("bf16")
    x = torch.tensor([65504.0, -65504.0, 1.0, float("inf"), float("nan")], dtype=torch.float16)
    out = codec.decode(codec.encode(x))
    assert out.dtype == torch.float16
    assert out[:3].tolist() == [65504.0, -65504.0, 1.0]
    assert out[3] == float("inf") and bool(torch.isnan(out[4]))
    total = simulate(codec, [x[:3], x[:3]], average=True).total
    assert total.tolist() == [65504.0, -65504.0, 1.0]


def test_fp16_overflow_is_documented_and_detected() -> None:
    """The fp16 cast of a float32 value beyond 65504 is +-Inf by definition (as in PyTorch's
    fp16 hook): the output is non-finite, so AMP-style checks see it."""
    codec = get_codec("fp16")
    out = codec.decode(codec.encode(torch.tensor([1e5, -1e5, 1.0])))
    assert out.tolist() == [float("inf"), float("-inf"), 1.0]
    assert "65504" in codec.nonfinite
