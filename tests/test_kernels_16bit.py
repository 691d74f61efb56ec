"""The numba kernels on float16 and bfloat16 tensors, read and written in their own dtype.

The kernels widen 16-bit inputs in cache (exactly) and round 16-bit outputs themselves, so a
16-bit input must give the payload that its float32 widening gives, bit for bit, and a decode
into a 16-bit tensor must equal the float32 decoding converted by torch (``.to`` or
``saturating_cast``, as the codec specifies). NaN payload bits are not compared: torch's own
conversions give different NaN bits on different CPUs (``_same`` compares NaN positions).
"""

from __future__ import annotations

import pytest
import torch

from commpress.codecs import get_codec, kernels
from commpress.codecs.base import CodecContext, saturating_cast
from float_cases import all_16bit

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")

HALF = (torch.bfloat16, torch.float16)
SIZES = (1, 7, 1000, 16385, 70001)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality of two tensors, NaNs compared by position only."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a[~nan].contiguous().view(ints), b[~nan].contiguous().view(ints))


def _input(n: int, dtype: torch.dtype, seed: int, *, nonfinite: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3
    if n > 10:
        x[n // 3] = 0.0
        x[n // 2] = -0.0
        x[-1] = 1e-41 if dtype == torch.bfloat16 else 3e-6  # a subnormal of the dtype
    if nonfinite and n > 10:
        x[5] = float("nan")
        x[n - 3] = float("-inf")
    return x.to(dtype)


def _float_bits(count: int, seed: int) -> torch.Tensor:
    """Random float32 bit patterns plus the rounding boundaries of both 16-bit formats."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (count,), generator=g, dtype=torch.int64)
    edges = torch.tensor(
        [0.0, 65504.0, 65519.996, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25,
         2.0**-14, 0.99999 * 2.0**-14, 3.3895314e38, 3.3896e38, 3.4e38, float("inf"),
         float("nan"), 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11],
        dtype=torch.float32,
    )
    scaled = torch.randn(20000, generator=g) * torch.logspace(-9, 6, 20000)
    return torch.cat([bits.to(torch.int32).view(torch.float32), edges, -edges, scaled])


@pytest.mark.parametrize("src", [torch.float32, *HALF])
@pytest.mark.parametrize("dst", [torch.float32, *HALF])
@pytest.mark.parametrize("saturate", [False, True])
def test_convert_rounds_like_torch(src: torch.dtype, dst: torch.dtype, saturate: bool) -> None:
    x = _float_bits(200_001, seed=1) if src == torch.float32 else all_16bit(src)
    want = saturating_cast(x, dst) if saturate else x.to(dst)
    got = kernels.convert(x, torch.empty(x.numel(), dtype=dst), saturate=saturate)
    assert _same(got, want)


@pytest.mark.parametrize("saturate", [False, True])
def test_float16_to_bfloat16_vector_groups_equal_the_scalar_rounding_bit_for_bit(
    saturate: bool,
) -> None:
    """float16 -> bfloat16 (the fp16 cast's decode into a bfloat16 buffer) converts whole
    groups of 16 with F16C where the CPU has it and the rest of a work item in scalar code:
    every one of the 65,536 float16 bit patterns, NaN payloads included, gets the scalar
    definition's bits, in one call (vector groups) and in calls of 15 values (scalar only)."""
    import numba
    import numpy as np

    from commpress.codecs.kernels import numba_cpu

    kernels.load_numba("numba_cpu")
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    bits = x.view(torch.int16).numpy().view(np.uint16)
    scalar = numba.njit(lambda s: [numba_cpu._nb_bf16(numba_cpu._nb_f16_value(v),
                                                      numba_cpu._INF_BITS) for v in s])
    want = torch.from_numpy(np.array(scalar(bits), np.uint16).view(np.int16))
    whole = kernels.convert(x, torch.empty(x.numel(), dtype=torch.bfloat16), saturate=saturate)
    assert torch.equal(whole.view(torch.int16), want)
    parts = torch.cat([
        kernels.convert(p, torch.empty(p.numel(), dtype=torch.bfloat16), saturate=saturate)
        for p in x[:15 * 400].split(15)
    ])
    assert torch.equal(parts.view(torch.int16), want[:15 * 400])
    assert (numba_cpu._vhalf_widen is not None) == kernels._load().vector_half  # type: ignore[union-attr]


def test_convert_rejects_a_wrong_output() -> None:
    x = torch.ones(10, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.convert(x, torch.empty(9), saturate=False)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        kernels.convert(x.double(), torch.empty(10), saturate=False)


DIVISORS = (1, 2, 3, 4, 7, 8, 12, 1000, 1024, 2**20)


@pytest.mark.parametrize("src", [torch.float32, *HALF])
@pytest.mark.parametrize("dst", HALF)
def test_convert_divide_is_torchs_cast_then_division(src: torch.dtype, dst: torch.dtype) -> None:
    """One pass, the bits of ``out.copy_(x)`` then ``out.div_(d)`` (the 16-bit casts' mean
    before the sum): every 16-bit input, float32 bit patterns and rounding edges, divisors
    that are powers of two (float32 -> float16 multiplies by the exact reciprocal) and not,
    and ones that push results into the subnormals."""
    x = _float_bits(200_001, seed=3) if src == torch.float32 else all_16bit(src)
    for d in DIVISORS:
        want = torch.empty(x.numel(), dtype=dst)
        want.copy_(x)
        want.div_(d)
        got = kernels.convert_divide(x, torch.empty(x.numel(), dtype=dst), d)
        assert _same(got, want), (src, dst, d)


def test_convert_divides_the_vector_groups_and_the_tail_alike() -> None:
    """float32 -> float16 converts whole groups of 16 in vector code where the CPU has F16C
    and the rest of a work item in scalar code: calls of 15 values (all scalar) give the bits
    of one call over all of them."""
    x = _float_bits(0, seed=4)[: 15 * 300]
    for d in (2, 3):
        whole = kernels.convert_divide(x, torch.empty(x.numel(), dtype=torch.float16), d)
        parts = torch.cat([
            kernels.convert_divide(p, torch.empty(p.numel(), dtype=torch.float16), d)
            for p in x.split(15)
        ])
        assert _same(whole, parts)


def test_a_prepared_convert_divide_converts_what_the_memory_holds_at_each_call() -> None:
    x = _float_bits(0, seed=5)[:70001]
    out = torch.empty(x.numel(), dtype=torch.float16)
    run = kernels.prepare_convert_divide(x, out, 3)
    for step in range(3):
        x.mul_(-2.0 if step else 1.0)  # new values in the same memory
        run()
        assert _same(out, kernels.convert_divide(x, torch.empty_like(out), 3)), step
    with pytest.raises(ValueError, match="contiguous"):
        kernels.prepare_convert_divide(x[::2], out[: x[::2].numel()], 2)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        kernels.prepare_convert_divide(x, torch.empty(x.numel()), 2)


@pytest.mark.parametrize("src", [torch.float32, *HALF])
def test_add_widened_is_torchs_widening_add(src: torch.dtype) -> None:
    """``acc += x`` widened, one pass: every 16-bit pattern (float32: random bit patterns and
    rounding edges) added to float32 accumulators of random bits and edges (NaNs compared by
    position: which of two NaN operands an addition keeps is the CPU's choice), in a
    contiguous accumulator and through views; with ``first`` the accumulator's old content
    is ignored and the result is zeroing and adding (``-0.0`` gives ``+0.0``); an
    accumulator that is not float32 or not contiguous is refused."""
    x = all_16bit(src).repeat(4) if src != torch.float32 else _float_bits(100_000, seed=8)
    acc = _float_bits(x.numel(), seed=6)[: x.numel()].clone()
    want = acc.clone().add_(x.float())
    kernels.add_widened(x, acc)
    assert _same(acc, want)
    garbage = _float_bits(x.numel(), seed=9)[: x.numel()].clone()
    kernels.add_widened(x, garbage, first=True)
    want = torch.zeros(x.numel()).add_(x.float())
    assert _same(garbage, want)
    assert torch.equal(torch.signbit(garbage[x == 0]), torch.zeros(int((x == 0).sum()),
                                                                   dtype=torch.bool))
    odd = torch.randn(16385, dtype=torch.float32)
    want = odd.clone().add_(x[:16385].float())
    kernels.add_widened(x[:16385], odd)  # a view of part of x, an odd size
    assert _same(odd, want)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.add_widened(x[:10], torch.zeros(20)[::2])
    with pytest.raises(ValueError, match="to float32, not to"):
        kernels.add_widened(x[:10], torch.zeros(10, dtype=torch.bfloat16))


@pytest.mark.parametrize("dst", HALF)
def test_narrow_sum_is_torchs_division_and_saturating_cast(dst: torch.dtype) -> None:
    """``acc / d`` saturated to 16 bits in one pass, bit for bit ``acc / d`` then
    :func:`saturating_cast` for finite quotients (float32 bit patterns, rounding edges, the
    16-bit values themselves), divisors powers of two and not; ``False`` exactly where a
    quotient is not finite, and ``acc`` left as it was."""
    x = _float_bits(200_001, seed=7)
    finite = x[torch.isfinite(x)].contiguous()
    for d in DIVISORS:
        before = finite.clone()
        out = torch.empty(finite.numel(), dtype=dst)
        quotient = finite / d if d > 1 else finite.clone()
        assert kernels.narrow_sum(finite, out, divisor=d) == bool(
            torch.isfinite(quotient).all())
        assert torch.equal(finite.view(torch.int32), before.view(torch.int32))
        ok = torch.isfinite(quotient)
        assert _same(out[ok], saturating_cast(quotient, dst)[ok]), (dst, d)
    wide = all_16bit(dst).float()
    for d in (1, 3):
        part = wide[torch.isfinite(wide)].contiguous()
        out = torch.empty(part.numel(), dtype=dst)
        assert kernels.narrow_sum(part, out, divisor=d)
        assert _same(out, saturating_cast(part / d, dst)), d
    for bad in (float("nan"), float("inf"), float("-inf")):
        acc = torch.ones(70001)
        acc[40000] = bad
        assert not kernels.narrow_sum(acc, torch.empty(70001, dtype=dst), divisor=2)
    with pytest.raises(ValueError, match="float32 to bfloat16 or float16"):
        kernels.narrow_sum(torch.ones(4), torch.empty(4), divisor=1)
    with pytest.raises(ValueError, match="positive count"):
        kernels.narrow_sum(torch.ones(4), torch.empty(4, dtype=dst), divisor=0)


def test_convert_divide_pays_only_where_it_runs_as_vector_code() -> None:
    x = torch.ones(40)
    half = torch.empty(40, dtype=torch.float16)
    fast = kernels.convert_divide_pays(x, half)
    assert fast == kernels._load().vector_half  # type: ignore[union-attr]
    assert not kernels.convert_divide_pays(x, torch.empty(40, dtype=torch.bfloat16))
    assert not kernels.convert_divide_pays(x.double(), half)
    with kernels.use_backend("torch"):
        assert not kernels.convert_divide_pays(x, half)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        kernels.convert_divide(x, torch.empty(40), 2)


DETERMINISTIC = ("minmax", "minmax:bits=3,chunk_size=100", "minmax:chunk_size=0", "sign")
STOCHASTIC = (
    "minmax:rounding=stochastic", "qsgd", "qsgd:chunk_size=0", "terngrad",
    "terngrad:chunk_size=333", "minmax:bits=2,chunk_size=20000,rounding=stochastic",
)


def _payload(spec: str, x: torch.Tensor, backend: str) -> dict[str, torch.Tensor]:
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        return dict(get_codec(spec).encode(x, CodecContext(key="k", step=2)).parts)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spec", DETERMINISTIC + STOCHASTIC)
@pytest.mark.parametrize("nonfinite", [False, True])
def test_16bit_inputs_give_the_payload_of_their_float32_widening(
    dtype: torch.dtype, n: int, spec: str, nonfinite: bool
) -> None:
    x = _input(n, dtype, seed=n, nonfinite=nonfinite)
    got = _payload(spec, x, "numba")
    want = _payload(spec, x.float(), "numba")
    assert got.keys() == want.keys()
    for name in got:
        assert _same(got[name], want[name]), name
    if spec in DETERMINISTIC:
        reference = _payload(spec, x, "torch")  # the plain-torch path, same arithmetic
        for name in got:
            # a chunk whose minimum is a zero may send -0.0 here, +0.0 there (docs/kernels.md):
            # equal values, NaN where the reference has NaN
            a, b = got[name], reference[name]
            nan = torch.isnan(a) if a.dtype.is_floating_point else torch.zeros_like(a, dtype=bool)
            assert torch.equal(nan, torch.isnan(b) if b.dtype.is_floating_point else nan), name
            assert torch.equal(a[~nan], b[~nan]), name


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spec", ("minmax", "minmax:bits=1,chunk_size=0", "qsgd", "terngrad",
                                  "sign", "qsgd:levels=1"))
@pytest.mark.parametrize("nonfinite", [False, True])
def test_16bit_decodes_equal_the_torch_path(
    dtype: torch.dtype, n: int, spec: str, nonfinite: bool
) -> None:
    codec = get_codec(spec)
    ctx = CodecContext(key="k", step=2)
    x = _input(n, dtype, seed=n + 1, nonfinite=nonfinite)
    payload = codec.encode(x, ctx)
    with kernels.use_backend("torch"):
        want = codec.decode(payload, ctx)
    with kernels.use_backend("numba"):
        fresh = codec.decode(payload, ctx)
        into = torch.full_like(x, 7.0)
        returned = codec.decode(payload, ctx, out=into)
    assert returned is into
    assert _same(fresh, want) and _same(into, want)


def test_16bit_decode_rounds_ties_to_even_and_saturates_where_the_codec_does() -> None:
    # values just past bfloat16's largest: qsgd saturates them (saturating_cast), terngrad's
    # .to rounds them to Inf, as the torch path does
    big = torch.tensor([3.3895e38, -3.3895e38, 3.0e38, 1.0] * 4, dtype=torch.float32)
    for spec in ("qsgd:chunk_size=4", "terngrad:chunk_size=4"):
        codec = get_codec(spec)
        ctx = CodecContext(key="k")
        payload = codec.encode(big.to(torch.bfloat16), ctx)
        payload = payload.replace(parts={**payload.parts, next(
            k for k in payload.parts if k != "codes"): torch.full((4,), 3.3950e38)})
        with kernels.use_backend("torch"):
            want = codec.decode(payload, ctx)
        with kernels.use_backend("numba"):
            got = codec.decode(payload, ctx, out=torch.empty(16, dtype=torch.bfloat16))
        assert _same(got, want), spec


@pytest.mark.parametrize("src", HALF)
@pytest.mark.parametrize("spec", ("fp16", "bf16"))
@pytest.mark.parametrize("n", (0, *SIZES))
def test_casts_between_16bit_formats_equal_torch(src: torch.dtype, spec: str, n: int) -> None:
    codec = get_codec(spec)
    ctx = CodecContext(key="k")
    x = _input(n, src, seed=3, nonfinite=True)
    with kernels.use_backend("torch"):
        want = codec.encode(x, ctx)
        want_out = codec.decode(want, ctx)
    with kernels.use_backend("numba"):
        got = codec.encode(x, ctx)
        out = codec.decode(got, ctx)
        into = codec.decode(got, ctx, out=torch.empty_like(x))
    assert _same(got.parts["values"], want.parts["values"])
    assert _same(out, want_out) and _same(into, want_out)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_randomk_payload_is_the_torch_paths(dtype: torch.dtype) -> None:
    codec = get_codec("randomk:ratio=0.1")
    ctx = CodecContext(key="k", step=5)
    for nonfinite in (False, True):
        x = _input(70001, dtype, seed=9, nonfinite=nonfinite)
        with kernels.use_backend("torch"):
            want = codec.encode(x, ctx).parts["values"]
        with kernels.use_backend("numba"):
            got = codec.encode(x, ctx).parts["values"]
        assert _same(got, want)
        assert bool(torch.isnan(got).all()) == nonfinite


def test_chunk_range_matches_aminmax() -> None:
    for dtype in (torch.float32, *HALF):
        for chunk in (1, 5, 16384, 20000, 70001):
            x = _input(70001, dtype, seed=chunk)
            lo, hi = kernels.chunk_range(x, chunk)
            pad = (-x.numel()) % chunk
            view = torch.cat([x.float(), x.float()[-1:].expand(pad)]).view(-1, chunk)
            want_lo, want_hi = torch.aminmax(view, dim=1)
            assert torch.equal(lo, want_lo) and torch.equal(hi, want_hi)
    x = _input(1000, torch.bfloat16, seed=1, nonfinite=True)
    lo, hi = kernels.chunk_range(x, 100)
    assert torch.isnan(lo[0]) and torch.isnan(hi[0])  # x[5] is NaN
    assert lo[-1] == -torch.inf and torch.isfinite(hi[1:]).all()  # x[997] is -inf
    assert torch.isfinite(lo[1:-1]).all()


def test_bfloat16_chunk_range_in_place_equals_its_widening_bit_for_bit() -> None:
    # the bfloat16 segments are scanned on their 16-bit order keys: every pattern (both
    # zeros, NaNs of either sign, infinities, subnormals) gives the float32 path's bits
    patterns = all_16bit(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    shuffled = patterns[torch.randperm(patterns.numel(), generator=g)]
    for x in (patterns, shuffled, _input(70001, torch.bfloat16, seed=2)):
        for chunk in (1, 7, 512, 16384, 16385, 40000, x.numel()):
            lo, hi = kernels.chunk_range(x, chunk)
            lo32, hi32 = kernels.chunk_range(x.float(), chunk)
            assert torch.equal(lo.view(torch.int32), lo32.view(torch.int32)), chunk
            assert torch.equal(hi.view(torch.int32), hi32.view(torch.int32)), chunk


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_fused_qsgd_and_terngrad_encodes_equal_the_two_step_kernels(
    dtype: torch.dtype, nonfinite: bool
) -> None:
    # one launch (statistics, multipliers and codes) against the separate kernels the codecs
    # called before: the chunk statistics, the multiplier as the codec computes it in torch,
    # then stochastic_encode, for the same seed; chunks below, at and above kernels.UNIT
    from commpress.codecs.quantize import _NORM_CLAMP, _safe_reciprocal

    x = _input(70001, dtype, seed=11, nonfinite=nonfinite)
    x[100:612] = 0.0  # a zero chunk (norm 0, multiplier 0) at chunk 512
    for chunk in (1, 5, 512, 16384, 20000, 70001):
        for levels, bits in ((127, 8), (7, 4), (1, 2)):
            codes, norm = kernels.qsgd_encode(
                x, chunk=chunk, levels=levels, bits=bits, clamp=_NORM_CLAMP, seed=42
            )
            want_norm = kernels.chunk_norms(x, chunk, _NORM_CLAMP)
            valid = (want_norm > 0) & torch.isfinite(want_norm)
            inv = torch.where(valid, float(levels) / want_norm, torch.zeros_like(want_norm))
            want = kernels.stochastic_encode(
                x, inv, kind="qsgd", chunk=chunk, levels=levels, bits=bits, seed=42
            )
            assert _same(norm, want_norm) and torch.equal(codes, want), (chunk, levels)
        codes, m = kernels.terngrad_encode(x, chunk=chunk, seed=7)
        lo, hi = kernels.chunk_range(x, chunk)
        want_m = torch.maximum(lo.neg_(), hi).abs_()
        want = kernels.stochastic_encode(
            x, _safe_reciprocal(want_m), kind="terngrad", chunk=chunk, levels=1, bits=2, seed=7
        )
        # NaN chunks: the kernel sends the quiet NaN 0x7FC00000, torch's maximum of two NaNs
        # gave 0x7FFFFFFF here (NaN bits are not stable in torch: compared by position)
        assert _same(m, want_m), chunk
        assert bool(torch.isnan(m).any()) == nonfinite
        assert torch.equal(codes, want), chunk


@pytest.mark.parametrize("preset", [None, "ACTIVE"])
def test_numba_pool_starts_passive_and_leaves_the_environment_as_it_was(
    preset: str | None,
) -> None:
    # in a fresh process: loading the kernels starts numba's OpenMP pool with a passive wait
    # policy (set only while it starts), and keeps a policy the user chose
    import os
    import subprocess
    import sys

    script = (
        "import os, torch\n"
        "from commpress.codecs import kernels\n"
        "assert kernels.available()\n"
        "x = torch.randn(100000).bfloat16()\n"
        "kernels.chunk_range(x, 1000)\n"
        "from numba.np.ufunc import parallel\n"
        "print(parallel._is_initialized, os.environ.get('OMP_WAIT_POLICY'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
        check=True,
    )
    assert done.stdout.split() == ["True", str(preset)]


@pytest.mark.parametrize("preset", [None, "ACTIVE"])
def test_starting_numba_keeps_torchs_thread_count(preset: str | None) -> None:
    """numba's pool start sets the OpenMP thread count to the number of cores, which torch
    reads as its own: a process limited to one thread ran torch's matmuls on every core
    afterwards (and got other reduction orders: DDP with netzip drifted from plain DDP by an
    ulp). The count is put back, with either way of starting the pool."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "before = torch.get_num_threads()\n"
        "import commpress\n"
        "commpress.get_codec('minmax').encode(torch.randn(100000))\n"
        "print(before, torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_NUM_THREADS"] = "1"
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
        check=True,
    )
    assert done.stdout.split() == ["1", "1"]
