"""The fused CPU kernels of THC and TopKC (codecs/kernels/numba_transforms.py) against the plain
torch path: bit for bit where the arithmetic is the same (THC's rotation, quantization given
the same noise and decoding; TopKC's payloads and decodings), on odd sizes, empty tensors,
every float dtype and non-contiguous inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from commpress.codecs import get_codec, kernels
from commpress.codecs.base import CodecContext, saturating_cast
from commpress.codecs.kernels import numba_transforms as kernels_extra
from commpress.codecs.thc import Thc, _lane_dtype, hadamard_transform

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason="numba kernels unavailable"
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (0, 1, 7, 100, 1000, 4096, 5000, 70001)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, NaNs included (any NaN payload counts as the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        a, b = a[~nan], b[~nan]
        ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def _input(n: int, dtype: torch.dtype, seed: int, *, strided: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2 * n if strided else n, generator=g) * 3).to(dtype)
    return x[::2] if strided else x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block_log2", [0, 3, 8, 12, "full"])
def test_thc_kernel_rotation_quantization_and_decode_match_torch(
    dtype: torch.dtype, n: int, block_log2: int | str
) -> None:
    codec = Thc(block_log2=block_log2)  # type: ignore[arg-type]
    x = _input(n, dtype, seed=n, strided=n % 2 == 1)
    ctx = CodecContext(key="k", step=3)
    lay = codec.layout(n)
    with kernels.use_backend("torch"):
        y = codec._wire_rotate(x, ctx, lay)
        ranges = codec.block_ranges(y, lay)
    if n == 0:
        assert codec.decode(codec.encode(x, ctx), ctx).shape == (0,)
        return
    seed = codec._sign_seed(ctx)
    y2, r2 = kernels_extra.thc_rotate(
        x, block=lay.block, padded=lay.padded, sign_seed=seed, scale=codec._wire_scale(lay)
    )
    assert _same(y, y2) and _same(ranges, r2)
    noise = torch.rand(lay.padded, generator=torch.Generator().manual_seed(1))
    want = codec.quantize_with(y, ranges, lay, noise, torch.int8)
    got = kernels_extra.thc_quantize(
        y2, codec.steps(r2), block=lay.block, levels=codec.levels, seed=0, lane=torch.int8,
        noise=noise,
    )
    assert torch.equal(want, got)
    r3, c3 = kernels_extra.thc_encode(
        x, block=lay.block, padded=lay.padded, sign_seed=seed, scale=codec._wire_scale(lay),
        levels=codec.levels, seed=0, lane=torch.int8, noise=noise,
    )
    assert _same(r3, ranges) and torch.equal(c3, want)
    payload = codec.encode(x, ctx)
    fused = codec.decode(payload, ctx)
    with kernels.use_backend("torch"):
        plain = codec.decode(payload, ctx)
    assert fused.dtype == dtype and _same(fused, plain)
    out = torch.full_like(x.contiguous(), math.nan)
    assert codec.decode(payload, ctx, out=out) is out and _same(out, fused)


def test_thc_signs_are_the_same_on_both_paths_and_per_key() -> None:
    """The torch path's sign bytes are the kernels' SplitMix64 words: a rotation by the
    kernel and by torch agree, and another key draws other signs."""
    codec = Thc(block_log2=6)
    x = torch.randn(1000)
    a, b = CodecContext(key="a"), CodecContext(key="b")
    with kernels.use_backend("torch"):
        ya = codec.rotate(x, a)
        yb = codec.rotate(x, b)
    lay = codec.layout(1000)
    scale = 1.0 / math.sqrt(lay.block)
    y, _ = kernels_extra.thc_rotate(
        x, block=lay.block, padded=lay.padded, sign_seed=codec._sign_seed(a), scale=scale
    )
    assert _same(y, ya) and not torch.equal(ya, yb)


def test_thc_kernel_noise_is_unbiased_and_bounded() -> None:
    """The kernel's own noise: codes in [-L, L] and mean code / (y / step) close to 1."""
    codec = Thc(bits=3, block_log2=10)
    x = torch.randn(1 << 16)
    lay = codec.layout(x.numel())
    y, ranges = kernels_extra.thc_rotate(
        x, block=lay.block, padded=lay.padded, sign_seed=1, scale=codec._wire_scale(lay)
    )
    step = codec.steps(ranges).repeat_interleave(lay.block)
    codes = kernels_extra.thc_quantize(
        y, codec.steps(ranges), block=lay.block, levels=codec.levels, seed=99,
        lane=_lane_dtype(3),
    )
    assert int(codes.abs().max()) <= codec.levels
    err = codes.double() - (y / step).double()
    assert float(err.abs().max()) < 1.0
    # unbiased: the mean error of 65536 draws is ~N(0, 0.29 / 256); 6 sigma
    assert abs(float(err.mean())) < 6 * 0.29 / 256
    again = kernels_extra.thc_quantize(
        y, codec.steps(ranges), block=lay.block, levels=codec.levels, seed=99,
        lane=_lane_dtype(3),
    )
    assert torch.equal(codes, again)


def _signed(y: torch.Tensor, seed: int) -> torch.Tensor:
    """``y`` with the sign bit flipped where THC's shared sign of the coordinate is negative."""
    signs = kernels_extra.sign_bytes(seed, y.numel(), torch.device("cpu")).to(torch.int32)
    bits = (signs.unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1
    flip = bits.reshape(-1)[: y.numel()].bool()
    return torch.where(flip, -y, y)


@pytest.mark.parametrize("block", [16, 32, 64, 128, 256, 512, 2048, 4096, 1 << 15])
def test_thc_kernel_rotation_of_every_block_size_matches_torch(block: int) -> None:
    """Whole blocks (the vector sweeps: load, signs, scale and the stages inside a vector at
    once, then 4, 2 or 1 stages between vectors) and a short last block, float32 and
    bfloat16 inputs with zeros, signed zeros, huge values, infinities and NaN, against the
    torch path's butterflies: bit for bit."""
    g = torch.Generator().manual_seed(block)
    n = 3 * block - 5
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    x[:7] = torch.tensor([0.0, -0.0, 3e38, -3e38, math.inf, 1e-40, 2.0])
    if block >= 64:
        x[block + 3] = math.nan  # the second block: NaN, its range +inf
    padded = 3 * block
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        want = hadamard_transform(
            _signed(torch.nn.functional.pad(xs.float(), (0, padded - n)), 11) * 0.125, block
        )
        y, ranges = kernels_extra.thc_rotate(
            xs, block=block, padded=padded, sign_seed=11, scale=0.125
        )
        assert _same(y, want)
        peak = want.view(-1, block).abs().amax(dim=1)
        assert _same(ranges, torch.where(torch.isnan(peak), math.inf, peak))


@pytest.mark.parametrize("block", [16, 64, 256, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thc_kernel_decode_saturates_and_keeps_nan_as_torch(
    block: int, dtype: torch.dtype
) -> None:
    """The decode's fused store (signs, factor, the saturating bfloat16 rounding) against the
    torch reference, with blocks whose values overflow bfloat16's range, an infinite step
    (NaN), an overflowing one (infinities) and a NaN factor; whole blocks and a short last one."""
    g = torch.Generator().manual_seed(block + 1)
    blocks = 6
    codes = torch.randint(-7, 8, (blocks * block,), generator=g, dtype=torch.int8)
    steps = torch.rand(blocks, generator=g) + 0.5
    codes[block : 2 * block] = 0  # block 1: +-3.4e38 everywhere, beyond bfloat16's largest
    codes[block] = 7
    steps[1] = 3.4e38 / 7  # (rounds to +-inf unless saturated)
    steps[2] = math.inf  # NaN everywhere (0 * inf)
    codes[5 * block : 6 * block] = 0  # block 5: +-inf everywhere (7e38 overflows)
    codes[5 * block] = 7
    steps[5] = 1e38
    factors = torch.rand(blocks, generator=g) + 0.5
    factors[1] = 1.0
    factors[3] = math.nan
    factors[4] = 1e-45  # subnormal products
    numel = blocks * block - 3
    y = hadamard_transform(codes.float() * steps.repeat_interleave(block), block)
    y = _signed(y, 5) * factors.repeat_interleave(block)
    want = saturating_cast(y[:numel], dtype)
    out = torch.full((numel,), 1.0, dtype=dtype)
    kernels_extra.thc_decode(
        codes, block=block, numel=numel, sign_seed=5, steps=steps, factors=factors, out=out
    )
    assert _same(out, want)
    if dtype == torch.bfloat16 and block >= 64:  # the cases happened
        assert torch.isnan(out).any() and torch.isinf(out).any()
        assert (out.float().abs() == torch.finfo(torch.bfloat16).max).any()


def test_thc_kernel_nonfinite_block_decodes_to_nan() -> None:
    codec = Thc(block_log2=4)
    x = torch.randn(64)
    x[20] = math.inf
    ctx = CodecContext()
    out = codec.decode(codec.encode(x, ctx), ctx)
    assert torch.isnan(out[16:32]).all() and torch.isfinite(out[:16]).all()


@pytest.mark.parametrize(
    "spec",
    ["topkc", "topkc:chunk_size=7,chunk_ratio=0.3", "topkc:norm_dtype=float16",
     "topkc:value_dtype=bfloat16"],
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_topkc_kernel_payloads_and_decode_match_torch(
    spec: str, dtype: torch.dtype, n: int
) -> None:
    codec = get_codec(spec)
    x = _input(n, dtype, seed=n + 7, strided=n % 2 == 1)
    if n > 10:
        x[3] = math.nan
        x[5] = -math.inf
    ctx = CodecContext(key="k")
    fused = codec.encode(x, ctx)
    with kernels.use_backend("torch"):
        plain = codec.encode(x, ctx)
    assert sorted(fused.parts) == sorted(plain.parts)
    for name, part in fused.parts.items():
        assert _same(part, plain.parts[name]), name
    got = codec.decode(fused, ctx)
    with kernels.use_backend("torch"):
        want = codec.decode(fused, ctx)
    assert _same(got, want)
    out = torch.full_like(x.contiguous(), 5.0)
    assert codec.decode(fused, ctx, out=out) is out and _same(out, want)


def test_top_keys_ties_go_to_the_lowest_indices_and_nan_ranks_first() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        norms = torch.tensor([3, 7, 7, 1, 7, math.inf, 0, 7, math.nan], dtype=dtype)
        assert kernels_extra.top_keys(norms, 3).tolist() == [1, 5, 8]
        assert kernels_extra.top_keys(norms, 1).tolist() == [8]
        assert kernels_extra.top_keys(norms, 0).tolist() == []
        assert kernels_extra.top_keys(norms, 9).tolist() == list(range(9))


def test_chunk_norms_match_float64_sums() -> None:
    x = torch.randn(1001) * 1e30
    x[70] = math.inf
    for dtype in (torch.float32, torch.bfloat16):
        v = x.to(dtype)
        got, largest = kernels_extra.chunk_norms(v, 64, 3e38)
        want = torch.nn.functional.pad(v.double(), (0, 1024 - 1001)).view(16, 64)
        want = want.square().sum(dim=1)
        assert torch.isnan(got[1]) and not torch.isnan(got[[0, *range(2, 16)]]).any()
        finite = torch.isfinite(want)
        assert torch.equal(got[finite], want[finite].clamp(max=3e38).float())
        assert math.isclose(float(largest), float(want[finite].max()), rel_tol=1e-14)


def _lane_order_squares(v: torch.Tensor, chunk: int) -> np.ndarray:
    """The chunk kernel's stated sums in numpy: per chunk, eight float64 lanes (lane ``j``
    adds the squares of elements ``8g + j`` in order), added in lane order from 0.0, then
    the squares of the chunk's tail past its whole groups of eight, in order."""
    x = v.double().numpy()
    nchunks = -(-x.size // chunk)
    x = np.concatenate([x, np.zeros(nchunks * chunk - x.size)]).reshape(nchunks, chunk)
    full = chunk // 8 * 8
    groups = x[:, :full].reshape(nchunks, chunk // 8, 8)
    lanes = np.zeros((nchunks, 8))
    for g in range(chunk // 8):
        lanes = lanes + groups[:, g, :] * groups[:, g, :]
    acc = np.zeros(nchunks)
    for j in range(8):
        acc = acc + lanes[:, j]
    for k in range(full, chunk):
        acc = acc + x[:, k] * x[:, k]
    return acc


@pytest.mark.parametrize("chunk", [1, 8, 13, 64, 72, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_norms_follow_their_stated_order_with_any_thread_count(
    chunk: int, dtype: torch.dtype
) -> None:
    # eight whole chunks at a time, a partial batch, a short last chunk, several work items
    # (_ITEM values each), a NaN and an Inf chunk, values whose squares round
    gen = torch.Generator().manual_seed(chunk)
    n = 2 * kernels_extra._ITEM + 40 * chunk + 5
    x = (torch.randn(n, generator=gen) * torch.exp(8 * torch.randn(n, generator=gen))).to(dtype)
    x[3 * chunk + 1] = math.nan
    x[11 * chunk] = math.inf
    x[20 * chunk : 29 * chunk] = 0.0
    sums = _lane_order_squares(x, chunk)
    q = np.sqrt(sums) ** 2
    finite = np.isfinite(q)
    want = np.where(finite, np.minimum(q, 3e38), np.nan).astype(np.float32)
    threads = torch.get_num_threads()
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            got, largest = kernels_extra.chunk_norms(x, chunk, 3e38)
            assert _same(got, torch.from_numpy(want)), count
            assert float(largest) == float(q[finite].max()), count
    finally:
        torch.set_num_threads(threads)
    # the float64 sums themselves (the float32 norms rarely show their order): the largest
    # chunk's, exactly, with each of 24 chunks made the largest in turn
    y = x[: 24 * chunk].nan_to_num(0.0, 0.0, 0.0)
    for i in range(24):
        z = y.clone()
        z[i * chunk : (i + 1) * chunk] *= 64
        sums = _lane_order_squares(z, chunk)
        _, largest = kernels_extra.chunk_norms(z, chunk, 3e38)
        assert float(largest) == float(np.sqrt(sums.max()) ** 2), i


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 5, 1001, 70001])
def test_top16_matches_the_torch_selection(dtype: torch.dtype, n: int) -> None:
    """16-bit keys read in place select what the torch path selects: NaN ranks as +Inf,
    ties (many, from repeated values) go to the lowest indices."""
    from commpress.codecs.sparse import exact_top, magnitudes, top_magnitudes

    x = _input(n, dtype, seed=n)
    if n > 10:
        x[: n // 3] = x[n // 3 : 2 * (n // 3)]
        x[2], x[7], x[9] = math.nan, -math.inf, math.inf
    for k in sorted({1, max(1, n // 100), n // 2, n - 1}):
        if 0 < k < n:
            assert torch.equal(top_magnitudes(x, k), exact_top(magnitudes(x), k))


@pytest.mark.parametrize("spec", ["topk", "thc", "topkc", "dgc", "netzip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_numba_kernel_module_counts_its_dispatches(spec: str, dtype: torch.dtype) -> None:
    """`bench codecs` names the backend that ran from the dispatch counts: the kernels of
    numba_transforms and numba_netzip count too (their codecs once showed '-')."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    with kernels.use_backend("numba"):
        before = kernels.dispatch_counts()["numba"]
        get_codec(spec).encode(x)
        assert kernels.dispatch_counts()["numba"] > before, spec
