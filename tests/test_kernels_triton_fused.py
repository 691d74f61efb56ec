"""The fused Triton encodes of QSGD and TernGrad (statistics + quantize in at most two passes
over the input) against the numba kernels and the torch path, under Triton's interpreter
(see tests/test_kernels_triton.py, whose helpers and device choice this module shares).

Chunk lengths cover the three layouts: a power of two from 8 to 2048 (one fused pass), other
lengths up to 2048 (a statistics kernel, one row per chunk, then the quantize kernel) and
longer chunks (per-segment partials combined per chunk in a fixed order, then the quantize
kernel).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from commpress.codecs import CodecContext, get_codec, kernels  # noqa: E402
from commpress.codecs.kernels import numba_transforms as kernels_extra  # noqa: E402
from commpress.codecs.quantize import _NORM_CLAMP, _max_abs, _safe_reciprocal  # noqa: E402
from commpress.errors import CommpressError  # noqa: E402
from test_kernels_triton import DEVICE, DTYPES, _stochastic_torch, same, sample, tg  # noqa: E402

CHUNKS = (1, 7, 64, 300, 2500)  # 2500: two segments of 2048 per chunk (n = 3001)
KINDS = (("qsgd", 127, 8), ("qsgd", 3, 3), ("terngrad", 1, 2))


def fused(x: torch.Tensor, kind: str, chunk: int, levels: int, bits: int, **kw):  # type: ignore[no-untyped-def]
    if kind == "qsgd":
        return tg.qsgd_encode(x, chunk=chunk, levels=levels, bits=bits, clamp=_NORM_CLAMP,
                              **kw)
    return tg.terngrad_encode(x, chunk=chunk, **kw)


def wide_norms(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-chunk L2 norms summed in float64, rounded to float32 (the kernels' definition)."""
    return torch.stack([c.double().norm() for c in x.split(chunk)]).float()


def inv_of(stat: torch.Tensor, kind: str, levels: int) -> torch.Tensor:
    """The codec's multiplier of ``|x|`` from what a chunk sends (QSGD._encode's ``s / norm``,
    TernGrad's safe reciprocal)."""
    if kind == "qsgd":
        valid = (stat > 0) & torch.isfinite(stat)
        return torch.where(valid, float(levels) / stat, torch.zeros_like(stat))
    return _safe_reciprocal(stat)


@pytest.mark.parametrize("n", [1, 9, 3001])
def test_fused_encode_with_given_noise_matches_torch(n: int) -> None:
    """Given the noise, the codes equal the torch path's for the statistic sent; the max is
    torch's bit for bit, the norm the float64 norm rounded (within one float32 rounding of
    the torch path's float32 norm)."""
    x = sample(n, seed=n)
    for chunk in CHUNKS:
        chunk = min(chunk, n)
        noise = torch.rand(n, generator=torch.Generator().manual_seed(chunk)).to(DEVICE)
        for kind, levels, bits in KINDS:
            packed, stat = fused(x, kind, chunk, levels, bits, noise=noise)
            if kind == "qsgd":
                same(stat, wide_norms(x, chunk))
            else:
                same(stat, torch.cat([_max_abs(c.view(1, -1)) for c in x.split(chunk)]))
            want = _stochastic_torch(x, inv_of(stat, kind, levels), kind, chunk, levels, bits,
                                     noise)
            same(packed, want)


def edge_noise(x: torch.Tensor, inv: torch.Tensor, kind: str, chunk: int) -> torch.Tensor:
    """Uniforms that put every element on its rounding edge for the multiplier ``inv``:
    ``|x| inv + u`` an integer (qsgd), ``u = |x| inv`` (terngrad), so that a multiplier one
    float32 step off changes codes."""
    a = x.abs() * inv.repeat_interleave(chunk)[: x.numel()]
    u = torch.ceil(a) - a if kind == "qsgd" else a
    return torch.where((u >= 0) & (u < 1), u, torch.zeros_like(u))


def test_fused_encode_multiplier_is_the_codecs_to_the_last_bit() -> None:
    """With noise on the rounding edges, the codes pin the multiplier down: QSGD's is
    ``f32(1 / norm) * s`` (torch's ``s / norm``), not the correctly rounded quotient, and
    TernGrad's the correctly rounded ``1 / m``."""
    x = sample(3001, seed=8)
    told = 0
    for chunk in (64, 300, 2500):
        for kind, levels, bits in KINDS:
            _, stat = fused(x, kind, chunk, levels, bits, seed=1)
            inv = inv_of(stat, kind, levels)
            noise = edge_noise(x, inv, kind, chunk)
            packed, _ = fused(x, kind, chunk, levels, bits, noise=noise)
            same(packed, _stochastic_torch(x, inv, kind, chunk, levels, bits, noise))
            other = (levels / stat.double()).float()  # the correctly rounded quotient
            if kind == "qsgd" and not torch.equal(other, inv):
                # where the two roundings differ, the edge noise tells them apart
                assert not torch.equal(
                    packed, _stochastic_torch(x, other, kind, chunk, levels, bits, noise)
                )
                told += 1
    assert told >= 3


@pytest.mark.skipif(not kernels.available() or DEVICE.type != "cpu",
                    reason="numba is not installed, or the kernels run on CUDA tensors")
def test_fused_encode_equals_the_numba_path() -> None:
    """Same seed: the codes and statistics the numba kernels give on the codec's CPU path
    (numba's float64 norms summed in another order agree here after rounding)."""
    x = sample(3001, seed=4)
    for chunk in (*CHUNKS, 3001):
        for kind, levels, bits in KINDS:
            with kernels.use_backend("numba"):
                if kind == "qsgd":
                    stat = kernels.chunk_norms(x, chunk, _NORM_CLAMP)
                else:
                    stat = torch.cat([_max_abs(c.view(1, -1)) for c in x.split(chunk)])
                want = kernels.stochastic_encode(
                    x, inv_of(stat, kind, levels), kind=kind, chunk=chunk,  # type: ignore[arg-type]
                    levels=levels, bits=bits, seed=2**62 + 3,
                )
            got, got_stat = fused(x, kind, chunk, levels, bits, seed=2**62 + 3)
            same(got_stat, stat)
            same(got, want)


def test_fused_encode_widens_16_bit_inputs_in_kernel() -> None:
    for dtype in DTYPES[1:]:
        x = sample(1001, seed=9, dtype=dtype)
        for chunk in (64, 100, 1001):
            for kind, levels, bits in KINDS[::2]:
                got = fused(x, kind, chunk, levels, bits, seed=5)
                want = fused(x.float(), kind, chunk, levels, bits, seed=5)
                for a, b in zip(got, want, strict=True):
                    same(a, b)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, inside the interpreter
def test_fused_encode_extreme_and_nonfinite_chunks() -> None:
    """Zero, huge (norm beyond float32: clamped), Inf and NaN chunks, as the codecs define
    them: a zero chunk sends the middle code, a non-finite one a non-finite statistic."""
    zero = torch.zeros(8)
    huge = torch.tensor([3.4e38, -3.4e38, 3.3e38, 1.0, -2.0, 3e38, 0.0, 1e38])
    inf = torch.tensor([1.0, float("inf"), 2.0, -3.0, 0.5, 0.0, -1.0, 4.0])
    nan = torch.tensor([1.0, -2.0, float("nan"), 3.0, 0.5, 0.0, -1.0, 4.0])
    x = torch.cat([zero, huge, inf, nan]).to(DEVICE)
    noise = torch.rand(32, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for chunk in (8, 12):  # the fused pass, and the statistics + quantize kernels
        for kind, levels, bits in KINDS[::2]:
            packed, stat = fused(x, kind, chunk, levels, bits, noise=noise)
            want = _stochastic_torch(x, inv_of(stat, kind, levels), kind, chunk, levels, bits,
                                     noise)
            same(packed, want)
    # the statistics themselves, chunk by chunk, for chunk 8
    packed, norm = fused(x, "qsgd", 8, 127, 8, noise=noise)
    assert norm[0].item() == 0.0 and bool((packed[:8] == 127).all())  # the middle code
    if kernels.available() and DEVICE.type == "cpu":
        with kernels.use_backend("numba"):
            same(norm, kernels.chunk_norms(x, 8, _NORM_CLAMP))
    assert float(norm[1]) == pytest.approx(_NORM_CLAMP, rel=2**-23)
    assert norm[2].item() == float("inf") and torch.isnan(norm[3])
    _, m = fused(x, "terngrad", 8, 1, 2, noise=noise)
    assert m[0].item() == 0.0
    assert m[1].item() == pytest.approx(3.4e38) and m[2].item() == float("inf")
    assert torch.isnan(m[3])


def test_fused_encode_empty() -> None:
    empty = torch.empty(0, device=DEVICE)
    for kind, levels, bits in KINDS:
        packed, stat = fused(empty, kind, 1, levels, bits)
        assert packed.numel() == stat.numel() == 0


@pytest.mark.parametrize("spec", ["qsgd", "qsgd:levels=3,chunk_size=100", "terngrad",
                                  "terngrad:chunk_size=64", "qsgd:levels=200"])
def test_codecs_use_the_fused_encode(spec: str) -> None:
    """QSGD and TernGrad on the Triton backend call the fused encode (one dispatch each for
    8-bit-or-narrower codes; QSGD's wider codes stay on the torch path), and their payloads
    decode alike on every path, for 0-d, empty, odd and non-contiguous inputs."""
    codec = get_codec(spec)
    ctx = CodecContext(rank=0, world_size=2, step=1, key="f")
    base = sample(2 * 37 * 11, seed=3)
    inputs = [base[:1001], base[5].reshape(()), base[:0], base.view(37, 22)[:, ::2]]
    for x in inputs:
        with kernels.use_backend("triton"):
            before = kernels.dispatch_counts()["triton"]
            p = codec.encode(x, ctx)
            calls = kernels.dispatch_counts()["triton"] - before
            dec = codec.decode(p)
        wide = spec == "qsgd:levels=200"
        assert calls == (0 if wide or x.numel() == 0 else 1), (spec, calls)
        with kernels.use_backend("torch"):
            same(codec.decode(p), dec)
        assert dec.shape == x.shape and dec.dtype == x.dtype


@pytest.mark.parametrize("spec", ["minmax", "minmax:bits=3,rounding=stochastic", "qsgd",
                                  "terngrad:chunk_size=64", "sign"])
def test_encodes_into_kept_codes_on_the_triton_path(spec: str) -> None:
    """With ``scratch=`` the Triton encodes write their packed codes into the buffer kept
    there (the same one call after call) and send the bytes of a fresh encode."""
    codec = get_codec(spec)
    part = "signs" if spec == "sign" else "codes"
    pool: dict[str, torch.Tensor] = {}
    ptrs = set()
    for step, dtype in enumerate(DTYPES):
        x = sample(1001, seed=step, dtype=dtype)
        ctx = CodecContext(rank=0, world_size=2, step=step, key="k")
        with kernels.use_backend("triton"):
            plain = codec.encode(x, ctx)
            into = codec.encode(x, ctx, scratch=pool)
        for name in plain.parts:
            same(into.parts[name], plain.parts[name])
        assert into.parts[part].data_ptr() == pool["codes"].data_ptr()
        ptrs.add(pool["codes"].data_ptr())
    assert len(ptrs) == 1


# ---------------------------------------------------------------------- THC's rotation
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, inside the interpreter
@pytest.mark.parametrize("spec", ["thc", "thc:block_log2=0", "thc:block_log2=3",
                                  "thc:block_log2=11"])
def test_thc_rotation_is_the_torch_paths(spec: str) -> None:
    """Signs, scale and butterflies in registers: the rotation (NaN payloads included) and
    block ranges of the torch path bit for bit, for every dtype, padded tails and
    non-finite blocks."""
    codec = get_codec(spec)
    ctx = CodecContext(key="r", step=4)
    for n in (1, 7, 1000, 5001):
        for dtype in DTYPES:
            x = sample(n, seed=n, dtype=dtype)
            if n > 100:
                x[50], x[90] = float("nan"), float("-inf")
            lay = codec.layout(n)
            y, ranges = tg.thc_rotate(x, block=lay.block, padded=lay.padded,
                                      sign_seed=codec._sign_seed(ctx),
                                      scale=codec._wire_scale(lay))
            want = codec._wire_rotate(x, ctx, lay)
            same(y.view(torch.int32), want.view(torch.int32))
            same(ranges, codec.block_ranges(want, lay))


def test_thc_rotation_refuses_blocks_beyond_its_tile() -> None:
    with pytest.raises(CommpressError, match="blocks up to 4096"):
        tg.thc_rotate(torch.ones(8192, device=DEVICE), block=8192, padded=8192, sign_seed=1,
                      scale=1.0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec", ["thc", "thc:block_log2=0", "thc:bits=2,block_log2=3",
                                  "thc:bits=8,block_log2=11"])
def test_thc_codes_match_numba_and_torch(spec: str) -> None:
    """The one-pass encode and the quantize kernel: the numba kernels' codes for the same
    seed, and the torch path's (``quantize_with``) for given noise."""
    codec = get_codec(spec)
    for n in (1, 7, 5001):
        for dtype in DTYPES[::2]:
            x = sample(n, seed=n + 1, dtype=dtype)
            if n > 100:
                x[50], x[90] = float("nan"), float("-inf")
            lay = codec.layout(n)
            rot = dict(block=lay.block, padded=lay.padded, sign_seed=77,
                       scale=codec._wire_scale(lay))
            quant = dict(levels=codec.levels, lane=torch.int8)
            ranges, codes = tg.thc_encode(x, **rot, **quant, seed=2**62 + 5)
            y, _ = tg.thc_rotate(x, **rot)
            steps = codec.steps(ranges)
            requant = tg.thc_quantize(y, steps, block=lay.block, **quant, seed=9)
            noise = torch.rand(lay.padded, generator=torch.Generator().manual_seed(n))
            given = tg.thc_encode(x, **rot, **quant, seed=0, noise=noise.to(DEVICE))[1]
            same(given, codec.quantize_with(y, ranges, lay, noise.to(DEVICE), torch.int8))
            same(tg.thc_quantize(y, steps, block=lay.block, **quant, seed=0,
                                 noise=noise.to(DEVICE)), given)
            if DEVICE.type == "cpu" and kernels.available():
                with kernels.use_backend("numba"):
                    same(codes, kernels_extra.thc_encode(x, **rot, **quant, seed=2**62 + 5)[1])
                    same(requant, kernels_extra.thc_quantize(y, steps, block=lay.block,
                                                             **quant, seed=9))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # 0 / 0 of zero blocks, in numpy
@pytest.mark.parametrize("spec", ["thc", "thc:bits=2,block_log2=5", "thc:block_log2=13"])
def test_thc_codec_on_the_triton_kernels(spec: str) -> None:
    """THC encodes in one Triton kernel (blocks up to 4096; larger ones take the torch path):
    the numba kernels' payload for the same context, decoding alike on every path; its
    reduce protocol's quantize kernel too."""
    from commpress.codecs.simulate import simulate

    codec = get_codec(spec)
    ctx = CodecContext(rank=1, world_size=2, step=3, key="t")
    base = sample(2 * 37 * 111, seed=5)
    for dtype in DTYPES:
        for x in (base[:8191], base[5].reshape(()), base[:0], base.view(74, 111)[:, ::2]):
            x = x.to(dtype)
            tiled = spec != "thc:block_log2=13" or x.numel() <= 4096
            with kernels.use_backend("triton"):
                before = kernels.dispatch_counts()["triton"]
                p = codec.encode(x, ctx)
                used = kernels.dispatch_counts()["triton"] - before
                dec = codec.decode(p, ctx)
            assert used == (1 if x.numel() and tiled else 0), (spec, x.numel(), used)
            with kernels.use_backend("torch"):
                same(codec.decode(p, ctx), dec)
                if not tiled:
                    q = codec.encode(x, ctx)
            if tiled and DEVICE.type == "cpu" and kernels.available():
                with kernels.use_backend("numba"):
                    q = codec.encode(x, ctx)
            elif tiled:
                continue
            assert p.parts.keys() == q.parts.keys()
            for part in p.parts:
                same(p.parts[part], q.parts[part])
    if DEVICE.type == "cpu" and kernels.available() and codec.layout(5000).block <= 4096:
        xs = [sample(5000, seed=r) for r in range(2)]
        results = {}
        for backend in ("triton", "numba"):
            with kernels.use_backend(backend):  # type: ignore[arg-type]
                results[backend] = simulate(codec, xs, key="s", step=1).totals
        for a, b in zip(results["triton"], results["numba"], strict=True):
            same(a, b)
