"""The Triton kernels (commpress.codecs.kernels.triton_gpu) against the torch reference path.

Without a GPU they run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1`` must be
in the environment when the kernels are defined (the module's first import), so this module
sets it before anything loads them. On a machine with CUDA where the kernels were already
loaded compiled, the same tests run on CUDA tensors instead. The interpreter is slow (numpy
per program), so shapes stay small; they include odd sizes, empty and 0-d tensors,
non-contiguous inputs and every floating dtype a codec widens from.

Deterministic codecs must agree with the torch path bit for bit (same float32 operations, no
fused multiply-add). Stochastic rounding draws its noise from the numba kernels' generator:
given the same ``noise`` tensor the kernels equal the torch path bit for bit, given the same
seed they equal the numba kernels bit for bit, and the decodings are unbiased.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (see above)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from commpress.codecs import CodecContext, get_codec, kernels  # noqa: E402
from commpress.codecs.base import saturating_cast  # noqa: E402
from commpress.codecs.bitpack import pack_bits, unpack_bits  # noqa: E402
from commpress.codecs.quantize import (  # noqa: E402
    minmax_decode_torch,
    minmax_encode_torch,
    sign_decode_torch,
    sign_encode_torch,
)
from commpress.errors import CommpressError  # noqa: E402

tg = kernels._load_triton()
if tg is None:  # pragma: no cover - triton imports but the module does not load
    pytest.skip(f"the Triton kernels do not load: {kernels._triton_error}", allow_module_level=True)
if tg.INTERPRETED:
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():  # pragma: no cover - only on a GPU machine
    DEVICE = torch.device("cuda")
else:  # pragma: no cover - loaded compiled before this module set TRITON_INTERPRET
    pytest.skip("Triton kernels were loaded without the interpreter and there is no GPU",
                allow_module_level=True)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)




def test_the_interpreter_passes_floats_as_float32() -> None:
    """A Python float argument reaches a kernel rounded to float32, as on a GPU (the session
    applies ``triton_interp.floats_as_compiled``: tests/conftest.py)."""
    if not tg.INTERPRETED:  # pragma: no cover - on a GPU the compiled kernel does it
        pytest.skip("compiled kernels round float arguments themselves")
    import triton
    import triton.language as tl

    @triton.jit
    def echo(out_ptr, value):
        tl.store(out_ptr + tl.arange(0, 1), tl.zeros((1,), tl.float64) + value)

    out = torch.empty(1, dtype=torch.float64)
    echo[(1,)](out, 0.1)
    assert out.item() == float(torch.tensor(0.1, dtype=torch.float32)) != 0.1


def sample(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gaussian values with a few ties, zeros of both signs and a wide range of scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-6, 7, (n,), generator=g).float())
    if n > 4:
        x[1], x[2], x[3] = 0.0, -0.0, x[0]
    return x.to(dtype).to(DEVICE)


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal values (NaNs equal to NaNs of any payload; ``assert_close`` with zero tolerance
    also counts -0.0 equal to +0.0)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------- kernels vs torch
@pytest.mark.parametrize("n", [1, 7, 9, 1000, 4099])
@pytest.mark.parametrize("chunk", [1, 5, 64, 2048, 2500, 0])
def test_minmax_nearest_and_given_noise_match_torch(n: int, chunk: int) -> None:
    # chunks of 8 to 2048 (a power of two): one fused pass; else a range kernel (one row per
    # chunk, or atomic segments beyond 2048: 2500 < 4099) + parameters + quantize
    chunk = n if chunk == 0 or chunk > n else chunk
    for bits in (1, 3, 4, 8):
        x = sample(n, seed=n + bits)
        noise = torch.rand(n, generator=torch.Generator().manual_seed(bits)).to(DEVICE)
        for given in (None, noise):
            got = tg.minmax_encode(x, chunk=chunk, bits=bits, stochastic=given is not None,
                                   noise=given)
            want = minmax_encode_torch(x.float(), chunk, bits, given)
            for a, b in zip(got, want, strict=True):
                same(a, b)
            same(tg.minmax_decode(*got, chunk=chunk, bits=bits, n=n),
                 minmax_decode_torch(*want, chunk, bits, n))


@pytest.mark.parametrize("bits", range(1, 9))
def test_minmax_every_bit_width_and_dtype(bits: int) -> None:
    for dtype in DTYPES:
        x = sample(203, seed=bits, dtype=dtype)
        got = tg.minmax_encode(x, chunk=16, bits=bits, stochastic=False)  # widened in-kernel
        want = minmax_encode_torch(x.float(), 16, bits, None)
        for a, b in zip(got, want, strict=True):
            same(a, b)
        out = torch.full((203,), 7.0, device=DEVICE)
        result = tg.minmax_decode(*got, chunk=16, bits=bits, n=203, out=out)
        assert result.data_ptr() == out.data_ptr()
        same(out, minmax_decode_torch(*want, 16, bits, 203))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, inside the interpreter
def test_minmax_extreme_and_nonfinite_chunks_match_torch() -> None:
    """Tiny (subnormal), huge (near float32's max), constant and non-finite chunks: the
    power-of-two pre-scaling, the rounded-up scale and NaN ranges as on the torch path."""
    tiny = torch.tensor([1e-45, 3e-45, 0.0, -1e-44, 2e-40, 5e-39, -3e-39, 1e-38])
    huge = torch.tensor([3.4e38, -3.4e38, 1e38, -2e37, 0.0, 3.3e38, -1.0, 2.0])
    const = torch.full((8,), 0.75)
    bad = torch.tensor([1.0, float("nan"), 2.0, 3.0, float("inf"), -1.0, 0.5, 0.25])
    neg_inf = torch.tensor([float("-inf"), 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    x = torch.cat([tiny, huge, const, bad, neg_inf]).to(DEVICE)
    for bits in (1, 2, 4, 8):
        for chunk in (8, 40):
            got = tg.minmax_encode(x, chunk=chunk, bits=bits, stochastic=False)
            want = minmax_encode_torch(x, chunk, bits, None)
            same(got[0], want[0])
            for a, b in zip(got[1:], want[1:], strict=True):
                same(a, b)
            same(tg.minmax_decode(*got, chunk=chunk, bits=bits, n=40),
                 minmax_decode_torch(*want, chunk, bits, 40))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 2049, 5000])
def test_sign_matches_torch(n: int) -> None:
    for dtype in DTYPES:
        x = sample(n, seed=n, dtype=dtype)
        packed, scale = tg.sign_encode_scaled(x)
        packed_t, scale_t = sign_encode_torch(x.float())
        same(packed, packed_t)
        # both sum |x| in float64 (in another order): equal after rounding to float32 unless
        # the sum lies within ~1e-15 of a rounding boundary (not so for these inputs)
        same(scale, scale_t)
        same(tg.sign_decode(packed, scale, n), sign_decode_torch(packed_t, scale_t, n))


def test_float32_constants_round_as_torch_and_keep_the_sign_of_zero() -> None:
    """The wrappers' cached float32 rounding of a codec's constants: torch's, and -0.0 is
    not served from 0.0's cache entry."""
    import math

    for v in (0.0, -0.0, 0.1, -1e-46, 3.5e38, 1e40, float("inf"), 2.0**-149):
        tg._float32(v)
        want = float(torch.tensor(v, dtype=torch.float32))
        got = tg._float32(v)  # cached now
        assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want), v
    assert math.isnan(tg._float32(float("nan")))


def test_sign_scale_kernel_sums_many_partials_as_torch() -> None:
    """sign's scale is finished on the device by one program (no torch ops after the
    encode): partial sums beyond one pass of its lanes, a masked tail, the float64 mean
    rounded once to float32 as torch's ``(sum / n).to(float32)``; an empty input sends 0."""
    g = torch.Generator().manual_seed(3)
    for nparts in (1, tg.SIGN_LANES - 1, 2 * tg.SIGN_LANES + 5):
        partial = (torch.rand(nparts, generator=g, dtype=torch.float64) * 1e4).to(DEVICE)
        n = 2048 * nparts - 7
        scale = torch.empty(1, dtype=torch.float32, device=DEVICE)
        tg._sign_scale_kernel[(1,)](partial, scale, nparts, n, LANES=tg.SIGN_LANES)
        # another order of the float64 sum: equal after rounding to float32 (not near a
        # rounding boundary for these inputs)
        same(scale, (partial.sum() / n).to(torch.float32).reshape(1))
    packed, scale = tg.sign_encode_scaled(torch.empty(0, device=DEVICE))
    assert packed.numel() == 0 and scale.tolist() == [0.0]


@pytest.mark.parametrize("kind", ["qsgd", "terngrad"])
@pytest.mark.parametrize("n", [1, 9, 1000, 3001])
def test_stochastic_kernels_with_given_noise_match_torch(kind: str, n: int) -> None:
    """The codec's torch path with the noise the kernel is given: codes bit for bit."""
    x = sample(n, seed=n)
    levels, bits = (127, 8) if kind == "qsgd" else (1, 2)
    for chunk in (1, 7, 256, n):
        chunk = min(chunk, n)
        inv = torch.rand(-(-n // chunk), generator=torch.Generator().manual_seed(n)).to(DEVICE)
        inv[0] = 0.0  # a zero-norm chunk: every code is the middle one
        noise = torch.rand(n, generator=torch.Generator().manual_seed(chunk)).to(DEVICE)
        got = tg.stochastic_encode(x, inv, kind=kind, chunk=chunk, levels=levels, bits=bits,
                                   noise=noise)
        want = _stochastic_torch(x, inv, kind, chunk, levels, bits, noise)
        same(got, want)
        step = torch.rand(inv.numel(), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        decoded = tg.offset_decode(got, step, chunk=chunk, bits=bits, offset=float(levels), n=n)
        codes = unpack_bits(got, bits, n).float() - levels
        same(decoded, codes * step.repeat_interleave(chunk)[:n])


def _stochastic_torch(
    x: torch.Tensor, inv: torch.Tensor, kind: str, chunk: int, levels: int, bits: int,
    noise: torch.Tensor,
) -> torch.Tensor:
    """The torch path's codes (quantize.QSGD / TernGrad._encode) for given ``inv``."""
    n = x.numel()
    inv_e = inv.repeat_interleave(chunk)[:n]
    a = x.abs() * inv_e
    if kind == "qsgd":
        t = torch.floor(a + noise)
        t = torch.fmax(t, torch.zeros(())).clamp(max=levels).to(torch.int32)
        codes = torch.where(x < 0, levels - t, levels + t)
    else:
        codes = torch.where(noise < a, torch.where(x < 0, 0, 2), 1)
    return pack_bits(codes, bits)


def test_chunk_norms_within_one_rounding_of_torch() -> None:
    x = sample(1001, seed=3)
    got = tg.chunk_norms(x, 100, 1e30)
    want = torch.stack([c.norm() for c in x.split(100)])
    torch.testing.assert_close(got, want, rtol=2**-23, atol=0)
    huge = torch.full((4,), 3e38, device=DEVICE)
    assert tg.chunk_norms(huge, 4, 1e38).item() == pytest.approx(1e38)


def test_empty_inputs() -> None:
    empty = torch.empty(0, device=DEVICE)
    packed, lo, scale = tg.minmax_encode(empty, chunk=1, bits=4, stochastic=False)
    assert packed.numel() == lo.numel() == scale.numel() == 0
    assert tg.minmax_decode(packed, lo, scale, chunk=1, bits=4, n=0).numel() == 0
    assert tg.stochastic_encode(empty, empty, kind="qsgd", chunk=1, levels=1, bits=2).numel() == 0
    assert tg.sign_decode(torch.empty(0, dtype=torch.uint8), torch.ones(1), 0).numel() == 0


def test_bad_output_buffer_is_refused() -> None:
    packed, lo, scale = tg.minmax_encode(sample(10, 1), chunk=4, bits=4, stochastic=False)
    for bad in (torch.empty(10, dtype=torch.float64, device=DEVICE),
                torch.empty(11, device=DEVICE), torch.empty(20, device=DEVICE)[::2]):
        with pytest.raises(CommpressError, match="10 contiguous float32, bfloat16 or float16"):
            tg.minmax_decode(packed, lo, scale, chunk=4, bits=4, n=10, out=bad)


def _conversion_cases() -> torch.Tensor:
    """float32 values whose conversion to bfloat16 / float16 is easy to get wrong: ties of
    both types (to even, up and down), values just below, at and beyond each type's largest,
    float16 subnormals and their ties, float32 subnormals (bfloat16's, ties among them), +-0,
    +-Inf, NaNs of both signs, and random values of every scale."""
    bits = [0x3F808000, 0x3F818000, 0xBF808000, 0x3F801000, 0x3F803000,  # ties
            0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7F8000,  # bfloat16's top
            0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000, 0xC77FF000,  # float16's top
            0x33800000, 0x33C00000, 0x34000000, 0x387FC000, 0x38800000,  # float16 subnormals
            0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x807F8000,  # float32 subnormals
            0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001,
            0x7F800001]
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([special.to(DEVICE), sample(1000, seed=5) * 1e4, sample(500, seed=6) * 1e-4])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal 16-bit patterns, NaN where the other is NaN (of any sign or payload)."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape
    nan = torch.isnan(a)
    assert torch.equal(nan, torch.isnan(b))
    assert torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("saturate", [False, True])
def test_decodes_write_16bit_outputs_as_torch_converts(dtype: torch.dtype, saturate: bool) -> None:
    """The minmax, offset (QSGD / TernGrad) and sign decodes store a 16-bit ``out`` in the
    kernel (no float32 intermediate): the same bits as their float32 result converted by
    torch, ``saturating_cast`` with ``saturate`` and ``.to`` without (round to nearest even,
    overflow to Inf)."""
    values = _conversion_cases().to(DEVICE)
    n = values.numel()

    def check(decode) -> None:  # type: ignore[no-untyped-def]
        wide = decode(None)
        assert wide.dtype == torch.float32
        out = torch.full((n,), 7.0, dtype=dtype, device=DEVICE)
        assert decode(out).data_ptr() == out.data_ptr()
        _same_bits(out, saturating_cast(wide, dtype) if saturate else wide.to(dtype))

    # offset decode with codes 1 - 0: each value is its chunk's step, exactly
    ones = torch.ones(n, dtype=torch.uint8, device=DEVICE)
    check(lambda out: tg.offset_decode(ones, values, chunk=1, bits=8, offset=0.0, n=n,
                                       out=out, saturate=saturate))
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(DEVICE)
    steps = (values * 1e-2).nan_to_num(nan=1.0)
    check(lambda out: tg.offset_decode(codes, steps, chunk=1, bits=8, offset=127.0, n=n,
                                       out=out, saturate=saturate))
    # minmax: lo the values, scales small, odd chunks
    scale = sample(n, seed=8).abs() * 1e-3
    check(lambda out: tg.minmax_decode(codes, values, scale.to(DEVICE), chunk=1, bits=8, n=n,
                                       out=out, saturate=saturate))
    # sign: one scale per call, the largest finite values, Inf and NaN among them
    signs = torch.randint(0, 256, (n // 8 + 1,), generator=g, dtype=torch.uint8).to(DEVICE)
    for scale_value in values[:31].tolist() + [0.1, 70000.0]:
        one = torch.tensor([scale_value], dtype=torch.float32, device=DEVICE)
        check(lambda out, one=one: tg.sign_decode(signs, one, n, out=out, saturate=saturate))


@pytest.mark.parametrize("spec", ["fp16", "bf16", "topkc"])
def test_16bit_conversions_on_the_triton_backend(spec: str) -> None:
    """On the Triton backend the casts between float16 and bfloat16 keep torch's copy (as
    fast on an H100, without a Triton launch): no conversion kernel is dispatched (TopKC's
    decode dispatches its one fused path, which scales in float32 and leaves the 16-bit
    cast to torch); all give the torch path's values."""
    codec = get_codec(spec)
    for dtype in (torch.float16, torch.bfloat16):
        x = sample(1001, seed=12, dtype=dtype)
        with kernels.use_backend("triton"):
            p = codec.encode(x)
            before = kernels.dispatch_counts().get("triton", 0)
            out = torch.empty_like(x)
            codec.decode(p, out=out)
            dispatched = kernels.dispatch_counts().get("triton", 0) - before
        with kernels.use_backend("torch"):
            q = codec.encode(x)
            want = codec.decode(q)
        _payloads_equal(p, q)
        same(out, want)
        assert dispatched == (1 if spec == "topkc" else 0)


@pytest.mark.parametrize("spec", ["minmax", "qsgd", "terngrad", "sign"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16bit_decodes_into_out_need_no_scratch(spec: str, dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16-bit payload decoded into a 16-bit ``out`` on the Triton backend is written by
    the kernel itself: no float32 scratch buffer, no converting copy afterwards."""
    codec = get_codec(spec)
    x = sample(1001, seed=9, dtype=dtype)
    with kernels.use_backend("triton"):
        p = codec.encode(x)
        want = codec.decode(p)

        def no_scratch(*args, **kwargs):  # type: ignore[no-untyped-def]
            raise AssertionError("a float32 scratch buffer was asked for")

        monkeypatch.setattr(kernels, "scratch32", no_scratch)
        monkeypatch.setattr(torch.Tensor, "copy_", no_scratch)
        out = torch.empty(x.shape, dtype=dtype, device=DEVICE)
        assert codec.decode(p, out=out) is out
    monkeypatch.undo()
    same(out, want)
    with kernels.use_backend("torch"):
        same(codec.decode(p), want)


def test_tensors_beyond_the_size_limit_take_the_torch_path() -> None:
    """A tensor past the kernels' int32 indexing limit is not dispatched to them (it would
    raise there): ``use_kernels`` answers no and the codec runs its torch path. (A strided
    view of one element stands for it: no memory is allocated.)"""
    from commpress.codecs.kernels.common import TRITON_MAX_ELEMENTS

    big = torch.zeros(1, device=DEVICE).expand(TRITON_MAX_ELEMENTS + 1)
    small = torch.zeros(4, device=DEVICE)
    with kernels.use_backend("triton"):
        assert kernels.use_kernels(small, "minmax_encode")
        assert kernels.use_kernels(small, "gather_finite")
        assert not kernels.use_kernels(big, "minmax_encode")
        assert not kernels.use_kernels(big, "gather_finite")
        with pytest.raises(CommpressError, match="at most"):
            tg.minmax_encode(big, chunk=1024, bits=4, stochastic=False)


# ---------------------------------------------------------------------- same seed as numba
@pytest.mark.skipif(not kernels.available(), reason="numba is not installed")
def test_stochastic_noise_equals_the_numba_kernels() -> None:
    """Same generator, same seed: the Triton and numba kernels send the same codes."""
    x = sample(3001, seed=5)
    inv = torch.rand(12, generator=torch.Generator().manual_seed(2))
    cpu = x.cpu()
    with kernels.use_backend("numba"):
        for bits in (2, 3, 8):
            seed = 2**62 + 7
            want = kernels.minmax_encode(cpu, chunk=256, bits=bits, stochastic=True, seed=seed)
            got = tg.minmax_encode(x, chunk=256, bits=bits, stochastic=True, seed=seed)
            for a, b in zip(got, want, strict=True):
                same(a, b)
        for kind, levels, bits in (("qsgd", 127, 8), ("qsgd", 3, 3), ("terngrad", 1, 2)):
            want_c = kernels.stochastic_encode(
                cpu, inv, kind=kind, chunk=256, levels=levels, bits=bits, seed=12345  # type: ignore[arg-type]
            )
            got_c = tg.stochastic_encode(
                x, inv.to(DEVICE), kind=kind, chunk=256, levels=levels, bits=bits, seed=12345  # type: ignore[arg-type]
            )
            same(got_c, want_c)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the golden payloads are CPU runs")
def test_golden_simulated_payloads_through_the_triton_kernels() -> None:
    """Every codec's simulated protocol with the quantizers on the Triton kernels sends the
    golden payload bytes (recorded with the numba kernels: same arithmetic, same noise)."""
    import test_golden_payloads as golden

    with kernels.use_backend("triton"):
        before = kernels.dispatch_counts()["triton"]
        got = golden.collect_sim()
        assert kernels.dispatch_counts()["triton"] > before
        golden._compare(got, "sim/")


# ---------------------------------------------------------------------- through the codecs
DETERMINISTIC = ["minmax", "minmax:bits=3,chunk_size=5", "minmax:bits=1,chunk_size=0", "sign"]
STOCHASTIC = ["minmax:bits=2,rounding=stochastic,chunk_size=64", "qsgd", "qsgd:levels=3",
              "terngrad", "terngrad:chunk_size=100"]


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    base = sample(2 * 37 * 11, seed=7, dtype=dtype)
    return {
        "odd": base[:1001],
        "0-d": base[5].reshape(()),
        "empty": base[:0],
        "non-contiguous": base.view(37, 22)[:, ::2],  # 37 x 11 with stride 2
        "transposed": base[:37 * 11].view(37, 11).t(),
    }


def _payloads_equal(a, b) -> None:  # type: ignore[no-untyped-def]
    assert a.parts.keys() == b.parts.keys()
    for name in a.parts:
        same(a.parts[name], b.parts[name])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", DETERMINISTIC)
def test_deterministic_codecs_send_the_torch_payload(spec: str, dtype: torch.dtype) -> None:
    codec = get_codec(spec)
    for name, x in _inputs(dtype).items():
        with kernels.use_backend("triton"):
            assert x.numel() == 0 or kernels.backend_for(x) == "triton"
            p = codec.encode(x)
            dec = codec.decode(p)
            into = torch.empty(x.shape, dtype=x.dtype, device=DEVICE)
            codec.decode(p, out=into)
        with kernels.use_backend("torch"):
            q = codec.encode(x)
            ref = codec.decode(q)
            cross = codec.decode(p)  # a Triton payload on the torch path
        _payloads_equal(p, q)
        same(dec, ref)
        same(into, ref)
        same(cross, ref)
        assert dec.shape == x.shape and dec.dtype == x.dtype, name


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_stochastic_codecs_decode_on_every_path(spec: str) -> None:
    """A Triton payload decodes to the same values on the Triton, numba and torch paths, and
    equals the numba kernels' payload for the same context (same generator and seed)."""
    codec = get_codec(spec)
    ctx = CodecContext(rank=1, world_size=2, step=3, key="w")
    for dtype in DTYPES:
        for name, x in _inputs(dtype).items():
            with kernels.use_backend("triton"):
                p = codec.encode(x, ctx)
                dec = codec.decode(p)
            with kernels.use_backend("torch"):
                same(codec.decode(p), dec)
            if DEVICE.type == "cpu" and kernels.available():
                with kernels.use_backend("numba"):
                    same(codec.decode(p), dec)
                    if not spec.startswith("qsgd"):
                        # qsgd's norms: torch's float64 norm vs numba's float64 sums may
                        # differ in the last bit; codes compared in the kernel test above
                        _payloads_equal(codec.encode(x, ctx), p)
            assert dec.shape == x.shape and dec.dtype == x.dtype, name


@pytest.mark.parametrize("spec", ["minmax:bits=2,rounding=stochastic,chunk_size=64",
                                  "qsgd:levels=3,chunk_size=64", "terngrad:chunk_size=64"])
def test_stochastic_rounding_is_unbiased(spec: str) -> None:
    """Mean of T decodings (steps 0..T-1 draw independent noise) is within 6 standard
    errors of the input for every element. Each decoding lies in an interval of one step
    (the chunk's quantization step) around x, so Hoeffding bounds the chance that any of the
    256 elements misses by 256 * 2 exp(-18) < 1e-5."""
    codec = get_codec(spec)
    x = sample(256, seed=11)
    trials = 80
    total = torch.zeros(256, dtype=torch.float64, device=DEVICE)
    with kernels.use_backend("triton"):
        for step in range(trials):
            p = codec.encode(x, CodecContext(step=step, key="u"))
            total += codec.decode(p).double()
        width = _step_width(codec.codec_id, p.parts, x)
    mean = total / trials
    bound = 6 * width / (2 * trials**0.5)
    assert bool(((mean - x.double()).abs() <= bound).all())
    assert bool(((mean - x.double()).abs() > 0).any())  # the noise does move the codes


def _step_width(codec_id: str, parts: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Per element, the width of the interval its decoding lies in."""
    if codec_id == "minmax":
        per_chunk = parts["scale"].double()
    elif codec_id == "qsgd":
        per_chunk = parts["norm"].double() / 3
    else:
        per_chunk = parts["scale"].double()
    return per_chunk.repeat_interleave(64)[: x.numel()]


# ---------------------------------------------------------------------- the switch
def test_switch_and_operations_without_a_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    x = sample(10, seed=1)
    with kernels.use_backend("triton"):
        assert kernels.use_kernels(x, "minmax_encode")
        assert not kernels.use_kernels(x)  # without an operation: the numba kernels only
        assert not kernels.use_kernels(x, "topk_select")
        assert not kernels.use_kernels(x, "first_distinct")
        with pytest.raises(CommpressError, match="no kernel for topk_select"):
            kernels.topk_select(x, 3)
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    assert kernels.requested_backend() == "triton"
    monkeypatch.setattr(kernels, "_triton", None)
    monkeypatch.setattr(kernels, "_triton_error", "ModuleNotFoundError: No module named 'triton'")
    assert not kernels.available("triton")
    if DEVICE.type == "cpu":
        with pytest.raises(CommpressError, match="Triton kernels are unavailable: Module"):
            kernels.backend_for(x)
    with kernels.use_backend("auto"):
        assert kernels.backend_for(x) == ("numba" if x.is_cpu and kernels.available() else
                                          "torch")
    meta = torch.empty(3, device="meta")
    with kernels.use_backend("numba"):
        assert kernels.backend_for(meta) == "torch"  # devices without kernels: plain torch


def test_bench_labels_triton_rows() -> None:
    from commpress.bench.codecs import run_bench

    with kernels.use_backend("triton"):
        rows = run_bench(["sign", "fp16"], size_mb=0.004, repeat=1, progress=False,
                         device=DEVICE.type)
    assert [r.kernels for r in rows] == ["triton", "-"]
