"""TopKC's fused Triton path (norms, keys and bound in two launches, gather and scatter in one
each, no host sync) against the torch path, bit for bit, under Triton's interpreter (see
tests/test_kernels_triton.py)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from commpress.codecs import CodecContext, get_codec, kernels, simulate  # noqa: E402
from commpress.codecs.topkc import TopKC  # noqa: E402
from test_kernels_triton import DEVICE, DTYPES, sample, tg  # noqa: E402

CONFIGS = [
    "topkc",
    "topkc:norm_dtype=float16,num_chunks=3",
    "topkc:chunk_size=1,value_dtype=bfloat16,chunk_ratio=1.0",
    "topkc:chunk_size=7,chunk_ratio=0.5",
    "topkc:value_dtype=bfloat16,chunk_size=16",
    "topkc:chunk_size=3000,chunk_ratio=0.5",  # beyond ROW_MAX: square sums, then the norms
]


def inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    nan, inf = float("nan"), float("inf")
    specials = sample(1000, 3).float()
    specials[5], specials[700], specials[130] = nan, inf, -inf
    signed_nan = sample(1000, 4).float()
    signed_nan[9] = -nan
    cases = {
        "one": sample(1, 1).float(),
        "odd": sample(4099, 2).float(),
        "specials": specials,
        "signed_nan": signed_nan,
        "zeros": -torch.zeros(300),
        "ties": torch.tensor([1.0, -1.0] * 320),
        "huge": sample(2000, 5).float() * 1e36,  # a nonzero overflow exponent
        "max": torch.full((512,), 3.4e38),
        "tiny": sample(2000, 6).float() * 1e-40,
        "all_nan": torch.full((200,), nan),
    }
    return {k: v.to(dtype).to(DEVICE) for k, v in cases.items()}


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def run(backend: str, codec: TopKC, x: torch.Tensor) -> list[bytes]:
    ctx = CodecContext()
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        p = codec.encode(x, ctx)
        got = [bits(p.parts[k]) for k in ("norms", "values", "bound")]
        got.append(bits(codec.decode(p, ctx)))
        got.append(bits(codec.decode(p, ctx, out=torch.empty_like(x))))
    return got


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, inside the interpreter
@pytest.mark.parametrize("spec", CONFIGS)
def test_payload_and_decode_bytes_match_the_torch_path(spec: str) -> None:
    codec = get_codec(spec)
    assert isinstance(codec, TopKC)
    for dtype in DTYPES:
        for name, x in inputs(dtype).items():
            assert run("triton", codec, x) == run("torch", codec, x), (spec, dtype, name)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("spec", ["topkc", "topkc:norm_dtype=float16,value_dtype=bfloat16"])
def test_all_reduce_matches_the_torch_path(spec: str) -> None:
    codec = get_codec(spec)
    for dtype in DTYPES:
        x = sample(1000, 7, dtype)
        xs = [x, (x * 1e30).to(dtype), (-x).to(dtype)]
        got = {}
        for backend in ("triton", "torch"):
            with kernels.use_backend(backend):  # type: ignore[arg-type]
                sim = simulate(codec, xs, average=True, need_local=True)
            got[backend] = [bits(t) for t in (*sim.totals, *sim.locals)]
        assert got["triton"] == got["torch"], (spec, dtype)


def exponent_reference(bound: float, shift: int, top: float, recip: bool) -> int:
    """TopKC.exponent in Python floats (torch divides a CUDA tensor by a scalar as a
    multiplication by its reciprocal)."""
    ratio = bound * (1.0 / top) if recip else bound / top
    if not (ratio > 0 and math.isfinite(ratio)):
        return 0
    mantissa, exp = math.frexp(ratio)
    return max(0, exp - (mantissa == 0.5) + shift)


@pytest.mark.parametrize("recip", [False, True])
@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bound_dtype", [torch.bfloat16, torch.float32])
def test_exponent_and_factor(recip: bool, value_dtype: torch.dtype,
                             bound_dtype: torch.dtype) -> None:
    top = torch.finfo(value_dtype).max / 4
    vals = [0.0, -0.0, -1.0, float("inf"), float("nan"), 1e-40, 3e-39, 1.0, 2.0**-114,
            2.0**-115, 255 * 2.0**-10, 255 * 2.0**-11, 16376 * 2.0**-128, 3.3e38, 3e5]
    vals += [2.0**k for k in range(-133, 128, 7)] + [1.7 * 2.0**k for k in range(-120, 120, 9)]
    bounds = torch.tensor(vals).to(bound_dtype)
    norms = torch.zeros(3, dtype=torch.bfloat16, device=DEVICE)
    for b in bounds:
        for up in (True, False):
            keys = torch.empty(3, dtype=torch.int64, device=DEVICE)
            e = torch.empty((), dtype=torch.int64, device=DEVICE)
            factor = torch.empty(1, dtype=torch.float32, device=DEVICE)
            bf16 = bound_dtype == torch.bfloat16
            tg._topkc_keys_kernel[(1,)](
                norms.view(torch.int16), keys, 3,
                b.reshape(1).to(DEVICE).view(torch.int16 if bf16 else torch.int32), e, factor,
                128, **tg._topkc_top_bits(top), RECIP=recip, FP16=False,
                BOUND=1 if bf16 else 2, UP=up, BLOCK=1024,
            )
            want = exponent_reference(float(b), 128, top, recip)
            assert int(e) == want, (float(b), recip)
            pow2 = torch.exp2(torch.tensor(float(want if up else -want)))
            assert bits(factor) == bits(pow2.reshape(1)), (float(b), up)
            if not recip:  # the codec's own exponent, on the torch path
                assert int(get_codec("topkc", value_dtype=str(value_dtype)[6:]).exponent(
                    b.reshape(1), torch.float32)) == want


SYNCS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero",
         "aten::masked_select"}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("n", [1024, 20000])
def test_no_host_sync_and_few_ops(n: int) -> None:
    """An encode and a float32 decode on the Triton path make no host synchronization and
    at most a dozen torch operations (the torch path: over 100)."""
    codec = get_codec("topkc")
    ctx = CodecContext()
    x = sample(n, 8)
    with kernels.use_backend("triton"):
        p = codec.encode(x, ctx)
        out = torch.empty_like(x)
        for fn in (lambda: codec.encode(x, ctx), lambda: codec.decode(p, ctx, out=out)):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            names = [e.name for e in prof.events()]
            assert not SYNCS & set(names), names
            top = [e.name for e in prof.events()
                   if e.name.startswith("aten::") and e.cpu_parent is None]
            # the interpreter's own copies in and out of its launches are top-level too
            assert len([t for t in top if t in ("aten::topk", "aten::sort")]) == 2, top


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("limit, fused", [(1200, True), (1199, False)])
def test_padded_length_beyond_int32_indexing_takes_the_torch_path(
    limit: int, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gather and scatter kernels index ``J * chunk`` values in int32 (review rv26b): an
    input of at most TRITON_MAX_ELEMENTS values whose padded chunks go beyond it (a large
    chunk, all chunks sent) takes the torch path for the encode, the decode and the
    all-reduce, with the same bytes; here the limit is lowered to show where it cuts."""
    import commpress.codecs.topkc as topkc_module

    monkeypatch.setattr(topkc_module, "TRITON_MAX_ELEMENTS", limit)
    codec = get_codec("topkc:chunk_size=300,chunk_ratio=1.0")  # 1000 values: 4 x 300 padded
    x = sample(1000, 9)
    calls = []

    def spy(name: str) -> None:
        original = getattr(tg, name)

        def wrapped(*args: object, **kwargs: object) -> object:
            calls.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(tg, name, wrapped)

    for name in ("topkc_norms", "topkc_keys"):
        spy(name)
    assert run("triton", codec, x) == run("torch", codec, x)
    with kernels.use_backend("triton"):
        simulate(codec, [x, -x], average=True)
    assert bool(calls) == fused, calls
