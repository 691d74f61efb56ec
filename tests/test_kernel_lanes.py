"""The numba kernels' hot loops run on lanes as narrow as their data.

numba computes arithmetic on small integers (``int16``, ``uint16``, ``int32``, ``uint32``) in
64 bits unless every intermediate is cast back; LLVM then vectorizes the loop on 64-bit lanes,
2-4x fewer values per vector (the 16-bit order keys of minmax's bfloat16 encode ran 4x
slower, float32's order keys 2x, the sign bits of ``sign`` 3.8x). These tests compile the
loops afresh and read their optimized LLVM IR: a vector of 64-bit integers there means a loop
widened again. Sign bits are also checked against numpy's ``packbits``."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from commpress.codecs import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")


def _vector_types(name: str, *argtypes: object) -> set[tuple[int, str]]:
    """The vector types ``(lanes, element)`` in the optimized LLVM IR of numba_cpu's helper
    ``name`` compiled afresh (no disk cache) for ``argtypes``."""
    import numba

    from commpress.codecs.kernels import numba_cpu

    kernels.load_numba("numba_cpu")  # binds the module's intrinsics
    helper = getattr(numba_cpu, name)  # a helper's dispatcher or a kernel's Python function
    fresh = numba.njit(tuple(argtypes), cache=False, fastmath=False, error_model="numpy")(
        getattr(helper, "py_func", helper)
    )
    ir = fresh.inspect_llvm(fresh.signatures[0])
    return {(int(n), t) for n, t in re.findall(r"<(\d+) x (i\d+|float|double)>", ir)}


def _array(dtype: object) -> object:
    from numba import types

    return types.Array(dtype, 1, "C")


@pytest.mark.parametrize(
    ("name", "args", "lane"),
    [
        ("_nb_minmax_keys", ("int32",), "i32"),
        ("_nb_minmax_keys16", ("int16",), "i16"),
        ("_nb_max_key16", ("uint16",), "i16"),
    ],
)
def test_order_key_loops_vectorize_on_their_own_width(
    name: str, args: tuple[str, ...], lane: str
) -> None:
    from numba import types

    found = _vector_types(name, *(_array(getattr(types, a)) for a in args))
    assert any(t == lane and n >= 4 for n, t in found), found  # vectorized at all
    assert not any(t == "i64" for _, t in found), found


def test_float16_widening_has_no_64_bit_lanes() -> None:
    from numba import types

    found = _vector_types(
        "_nb_widen", _array(types.float32), _array(types.uint16), types.int64, types.int64,
        types.int64, _array(types.float32),
    )
    assert any(t == "i32" and n >= 4 for n, t in found), found
    assert not any(t == "i64" for _, t in found), found


def test_sign_bits_compare_whole_vectors() -> None:
    from numba import types

    found = _vector_types("_nb_sign_bits", _array(types.float32), _array(types.uint8))
    assert (32, "i1") in found, found  # one compare per 32 values, its lanes the word's bits
    # bfloat16 bits compared as 16-bit integers, 32 at a time, never widened to float32
    found = _vector_types("_nb_sign_bits_bf16", _array(types.uint16), _array(types.uint8))
    assert (32, "i16") in found and (32, "i1") in found, found
    assert not any(t in ("float", "i32") for _, t in found), found


@pytest.mark.parametrize("offset", [0, 1, 5, 31])
def test_bfloat16_sign_bits_of_every_pattern(offset: int) -> None:
    """Every bfloat16 bit pattern (both NaN signs, which a cast from float32 never gives:
    torch turns every NaN into 0xFFFF), in order and shuffled, starting ``offset`` values
    into the tensor so that groups and tails fall elsewhere: the kernel reads the bits in
    place and compares them as integers."""
    g = torch.Generator().manual_seed(offset)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for bits in (every, every[torch.randperm(every.numel(), generator=g)]):
        x = bits[offset:].view(torch.bfloat16)
        with kernels.use_backend("numba"):
            packed, _ = kernels.load_numba("numba_cpu").sign_encode(x)
        expected = np.packbits((x.float() >= 0).numpy(), bitorder="little")
        assert packed.numpy().tobytes() == expected.tobytes()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 31, 32, 33, 63, 64, 100, 2048, 2049, 16384 + 45])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sign_bits_equal_numpy_packbits(n: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    specials = torch.tensor([float("nan"), -float("nan"), -0.0, 0.0, float("inf"), -float("inf")])
    x[: min(n, 6)] = specials[: min(n, 6)]
    if n > 40:
        x[33:39] = specials  # in a whole vector group, not only the scalar tail
    x = x.to(dtype)
    with kernels.use_backend("numba"):
        packed, _ = kernels.load_numba("numba_cpu").sign_encode(x)
    expected = np.packbits((x.float() >= 0).numpy(), bitorder="little")
    assert packed.numpy().tobytes() == expected.tobytes()


@pytest.mark.parametrize("n", [1, 2, 31, 1000, 70001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["plain", "specials", "all_nonfinite", "zeros", "subnormal"])
def test_finite_max_abs_kernel_equals_the_torch_path(n: int, dtype: torch.dtype, case: str) -> None:
    from commpress.codecs.common import finite_max_abs

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 1e3).to(dtype)
    if case == "specials":
        x[torch.randperm(n, generator=g)[: max(1, n // 10)]] = float("inf")
        x[torch.randperm(n, generator=g)[: max(1, n // 10)]] = -float("nan")
        x[0] = -torch.finfo(dtype).max if n > 1 else x[0]
    elif case == "all_nonfinite":
        x[:] = float("nan")
        x[::2] = -float("inf")
    elif case == "zeros":
        x[:] = -0.0
    elif case == "subnormal":
        x = torch.full((n,), torch.finfo(dtype).tiny / 4, dtype=dtype) * -1
    with kernels.use_backend("torch"):
        expected = finite_max_abs(x)
    with kernels.use_backend("numba"):
        got = finite_max_abs(x)
    assert got.dtype == expected.dtype and got.shape == expected.shape == ()
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    assert got.view(ints).item() == expected.view(ints).item(), (got, expected)


def test_finite_max_loops_vectorize_on_their_own_width() -> None:
    from numba import types

    found16 = _vector_types("_nb_finite_max16", _array(types.uint16), types.uint16)
    found32 = _vector_types("_nb_finite_max32", _array(types.int32))
    assert any(t == "i16" and n >= 8 for n, t in found16), found16
    assert any(t == "i32" and n >= 4 for n, t in found32), found32
    assert not any(t == "i64" for _, t in found16 | found32), (found16, found32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_finite_max_abs_kernel_path_takes_any_layout(dtype: torch.dtype) -> None:
    """common.finite_max_abs hands the kernel a flat contiguous copy: 0-d, transposed and
    strided inputs give the torch path's bits; float64 keeps the torch path (no dispatch)."""
    from commpress.codecs.common import finite_max_abs

    g = torch.Generator().manual_seed(3)
    base = (torch.randn(40, 30, generator=g) * 100).to(dtype)
    base[3, 7] = float("inf")
    base[5, 2] = float("nan")
    base[11, 1] = -70000.0 if dtype == torch.float16 else -5e4  # -inf in float16
    strided = base.reshape(4, 10, 30)[:, ::2].transpose(0, 2)
    inputs = [base.t(), base[::3, 1::2], base[2, 5], strided]
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}.get(dtype, torch.int16)
    for x in inputs:
        with kernels.use_backend("torch"):
            expected = finite_max_abs(x)
        before = kernels.dispatch_counts()["numba"]
        with kernels.use_backend("numba"):
            got = finite_max_abs(x)
        dispatched = kernels.dispatch_counts()["numba"] - before
        assert dispatched == (0 if dtype == torch.float64 else 1), (dtype, x.shape)
        assert got.dtype == expected.dtype and got.shape == expected.shape == ()
        assert got.view(ints).item() == expected.view(ints).item(), (x.shape, got, expected)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 2049])
def test_max_keys_equal_numpy(n: int) -> None:
    """TernGrad's maxima (``_nb_max_key16`` of 16-bit float bits, ``_nb_max_key`` of float32
    bits) take whole 64-byte groups in vector code (``_vector_max_key``, which also asks for
    lines ahead) and the rest in numba's loop: the largest magnitude key equals numpy's
    ``max(bits & 0x7FFF...)`` with the largest key at every position (in a group or in the
    tail), among NaNs, infinities, zeros of both signs, subnormals and negative values."""
    from commpress.codecs.kernels import numba_cpu

    kernels.load_numba("numba_cpu")
    rng = np.random.default_rng(n)
    specials16 = np.array([0x7FC1, 0xFF80, 0x8000, 0x0001, 0x8001, 0x7F80], np.uint16)
    specials32 = np.array(
        [np.nan, -np.inf, -0.0, 1e-45, -1e-40, np.inf], np.float32
    ).view(np.int32)
    for trial in range(max(1, n)):
        # small keys everywhere (both signs), one larger key at position ``trial``
        b16 = rng.integers(0, 0x3F80, n).astype(np.uint16) | (
            rng.integers(0, 2, n).astype(np.uint16) << np.uint16(15)
        )
        b32 = (rng.standard_normal(n).astype(np.float32) * 1e-3).view(np.int32)
        if n:
            b16[trial] = np.uint16(0xBF90 if trial % 2 else 0x3F90)  # +-1.125
            b32[trial] = np.float32(-2.5 if trial % 2 else 2.5).view(np.int32)
        want16 = int((b16 & np.uint16(0x7FFF)).max()) if n else 0
        want32 = int((b32 & np.int32(0x7FFFFFFF)).max()) if n else 0
        assert int(numba_cpu._nb_max_key16(b16)) == want16, trial
        assert int(numba_cpu._nb_max_key(b32)) == want32, trial
    if n:  # NaNs and infinities rank above every finite key, as the bits do
        at = rng.choice(n, size=min(n, specials16.size), replace=False)
        b16 = rng.integers(0, 1 << 16, n).astype(np.uint16)
        b16[at] = specials16[: at.size]
        assert int(numba_cpu._nb_max_key16(b16)) == int((b16 & np.uint16(0x7FFF)).max())
        b32 = rng.integers(-(1 << 31), 1 << 31, n).astype(np.int32)
        b32[at] = specials32[: at.size]
        assert int(numba_cpu._nb_max_key(b32)) == int((b32 & np.int32(0x7FFFFFFF)).max())
