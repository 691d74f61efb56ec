"""netzip's grouping and exponent model and their numba kernels
(commpress.codecs.netzip.grouping / exponent / kernels): the kernels and the torch paths write
the same planes and streams, the bf16 kernels equal the general ones, the fast path equals the
general path, byte-residual fallback, scratch buffers."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from commpress.codecs import CodecContext, get_codec
from commpress.codecs.kernels import numba_netzip as nk
from commpress.codecs.kernels import use_backend
from commpress.codecs.netzip import exponent as ex
from commpress.codecs.netzip import grouping as gr
from netzip_cases import DTYPES, assert_bit_exact, bits_of


def test_numba_and_torch_paths_write_identical_streams() -> None:
    """The fused kernels and the torch reference produce the same bytes, in dense, sparse
    (zero bitmap), byte-residual (many escapes) and leftover-bit (fp16/fp64) cases."""
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(300, 130, generator=g) * torch.logspace(-3, 3, 130)
    sparse = dense.clone()
    sparse[::3] = 0.0
    wide = torch.randn(5000, generator=g) * torch.logspace(-30, 30, 5000)  # escapes galore
    cases = [dense, sparse, wide, dense[:7, :5]]
    for dtype in DTYPES:
        for x in cases:
            for config in ({}, {"context": "none"}, {"delta": "min"}):
                codec = get_codec("netzip", **config)
                y = x.to(dtype)
                with use_backend("numba"):
                    a = codec.encode(y).parts["stream"]
                with use_backend("torch"):
                    b = codec.encode(y).parts["stream"]
                    assert_bit_exact(codec.decode(codec.encode(y)), y)
                assert torch.equal(a, b), f"{dtype} {tuple(x.shape)} {config}"


def _bf16_cases() -> list[torch.Tensor]:
    """bf16 tensors that exercise every branch of the narrow-lane bf16 kernels: dense rows,
    zero rows and partly-zero rows (zero bitmap), a few escapes, many escapes (byte-mode
    fallback), predictions outside the 8-bit-safe range (subnormal rows), special values,
    odd column counts, flat tensors with a partial last block, and tiny tensors."""
    g = torch.Generator().manual_seed(11)
    dense = torch.randn(96, 70, generator=g) * torch.logspace(-4, 2, 70)
    sparse = dense.clone()
    sparse[::4] = 0.0
    sparse[1::5, ::3] = 0.0
    few_zeros = dense.clone()
    few_zeros.view(-1)[::90] = 0.0  # below 1/64: no bitmap, but row means skip zeros
    subnormal = torch.randn(64, 80, generator=g) * 1e-39  # rows predicted near exponent 0
    subnormal[::7] *= 1e38
    special = dense.clone()
    special.view(-1)[::397] = float("nan")
    special.view(-1)[5::401] = float("-inf")
    special.view(-1)[7::409] = -0.0
    special.view(-1)[11::419] = 1e-40  # subnormal
    wide = torch.randn(3000, generator=g) * 2.0 ** torch.randint(-60, 60, (3000,), generator=g)
    flat = torch.randn(1000, generator=g) * 1e-3
    flat[300:700] = 0.0
    return [t.to(torch.bfloat16) for t in (
        dense, sparse, few_zeros, subnormal, special, wide, flat, flat[:5], dense[:1, :1],
        torch.zeros(64, 64),
    )]


def _bf16_kernel_takes(x: torch.Tensor) -> bool:
    """Whether the narrow-lane bf16 encoder handles ``x`` itself (no hand-over)."""
    n = x.numel()
    rows, cols, _ = gr.matrix_view(tuple(x.shape), n)
    buf = np.empty(ex.bf16_layout(n, rows, cols)[-1], dtype=np.uint8)
    with use_backend("numba"):
        nk.use_kernels(x)
        result = nk.kernel("encode_bf16_buf")(bits_of(x).numpy(), cols, 7, max(1, rows // 64), buf)
    return bool(result[0])


def test_bf16_fast_kernels_equal_the_general_ones() -> None:
    """The bf16 kernels (encode and decode) write/read exactly the planes of the general
    kernels, including the cases where they hand over (byte residuals)."""
    lay = gr.layout(torch.bfloat16)
    cases = _bf16_cases()
    # the fast kernel really runs on all but the spread-exponent case (so the comparison
    # below is not vacuous)
    assert [_bf16_kernel_takes(x) for x in cases[:6]] == [True] * 5 + [False]
    for x in cases:
        words = bits_of(x)
        for use_row, use_col in ((True, True), (True, False), (False, False)):
            with use_backend("numba"):
                fast, cx_f = ex.encode_exponent(words, lay, tuple(x.shape), use_row=use_row,
                                                use_col=use_col, allow_mask=True, fast=True)
                fast_arrays = {k: None if v is None else np.array(v, copy=True)
                               for k, v in vars_of(fast).items()}
                slow, cx_s = ex.encode_exponent(words, lay, tuple(x.shape), use_row=use_row,
                                                use_col=use_col, allow_mask=True, fast=False)
            for key, value in vars_of(slow).items():
                other = fast_arrays[key]
                if isinstance(value, np.ndarray) or other is not None and hasattr(other, "shape"):
                    assert np.array_equal(np.asarray(value), other), (tuple(x.shape), key)
                else:
                    assert value == other, (tuple(x.shape), key)
            assert cx_f.g4 == cx_s.g4
            cx_s.r4 = slow.r4  # the decoder gets the row statistics from the stream
            n = words.numel()
            if not n:
                continue
            for fast_decode in (True, False):
                with use_backend("numba"):
                    out = ex.decode_exponent(
                        lay, n, cx_s, kept=slow.kept, byte_mode=slow.byte_mode, codes=slow.codes,
                        codes_hi=slow.codes_hi, escapes=slow.escapes, nesc=slow.nesc,
                        mant=slow.mant, rem=slow.rem, mask=slow.mask,
                        device=torch.device("cpu"), fast=fast_decode,
                    )
                assert torch.equal(out, words), (tuple(x.shape), fast_decode)


def vars_of(planes: ex.ExponentPlanes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("kept", "byte_mode", "nesc", "codes", "codes_hi", "escapes", "rem", "mask",
                "r4"):
        out[key] = getattr(planes, key)
    for q, plane in enumerate(planes.mant):
        out[f"mant{q}"] = plane
    return out


def test_fast_path_writes_the_general_paths_stream() -> None:
    """The default codec's fast path (plan cache, inlined framing, bf16 kernels) and the
    general path (torch transforms, generic framing) write the same bytes, and both decoders
    return the input bit for bit from either stream."""
    codec = get_codec("netzip")
    for x in _bf16_cases() + [t.to(dtype) for t in _bf16_cases()[:3]
                              for dtype in (torch.float16, torch.float32)]:
        with use_backend("numba"):
            fast = codec.encode(x)
            assert_bit_exact(codec.decode(fast), x)
            general = codec._encode_general(x, CodecContext())  # generic framing, kernels on
            assert torch.equal(fast.parts["stream"], general.parts["stream"]), tuple(x.shape)
        with use_backend("torch"):
            slow = codec.encode(x)
            assert_bit_exact(codec.decode(fast), x)
        assert torch.equal(fast.parts["stream"], slow.parts["stream"]), tuple(x.shape)


def test_byte_mode_fallback_is_used_when_exponents_spread() -> None:
    # Exponents spread over 60 binades with no row/column structure: most residuals fall
    # outside the 15-value window, so the stream must switch to byte residuals (and stay
    # lossless).
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(20000, generator=g) * 2.0 ** torch.randint(-30, 30, (20000,), generator=g))
    codec = get_codec("netzip")
    payload = codec.encode(x)
    assert payload.parts["stream"][6] & 8, "byte-mode flag not set"  # header byte 6: flags
    assert_bit_exact(codec.decode(payload), x)


def test_growing_a_scratch_buffer_drops_the_cached_views_of_the_old_one() -> None:
    """Per-thread scratch buffers grow with the tensors; kernel bundles cached for smaller
    sizes view the old buffer and must not keep it alive (memory would pile up per thread)."""
    from concurrent.futures import ThreadPoolExecutor


    def run() -> None:
        ex.buffers(1000, 2, 0)
        assert len(ex._scratch.bundles) == 1
        old = ex._scratch.pool["t"]
        ex.scratch("t", 10 * old.size, np.uint8)  # outgrows it
        assert ex._scratch.pool["t"] is not old
        assert ex._scratch.bundles == {}
        again = ex.buffers(1000, 2, 0)  # rebuilt on the new buffer
        assert np.shares_memory(again[0], ex._scratch.pool["t"])
        assert not np.shares_memory(again[0], old)

    # A fresh thread: its own, empty scratch state; result() re-raises a failed assertion.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(run).result()
