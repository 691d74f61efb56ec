"""The quantizers' encodes into payload memory kept across calls (``encode(x, ctx,
scratch=pool)``, :attr:`Codec.encodes_into`): the same payload bytes as a fresh encode, one
buffer reused call after call (a large fresh payload is page-faulted anew at every call on a
CPU), a new one when the size changes; and the kernels' ``codes=`` argument they use, with
its refusals."""

from __future__ import annotations

import pytest
import torch

from commpress.codecs import CodecContext, get_codec, kernels
from commpress.errors import CommpressError

SPECS = ["minmax", "minmax:bits=3,chunk_size=100", "minmax:rounding=stochastic,bits=2",
         "qsgd", "qsgd:levels=3,chunk_size=64", "terngrad", "terngrad:chunk_size=50", "sign"]
CODES = {"sign": "signs"}


def _input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-8, 8, (n,), generator=g).float())
    if n > 3:
        x[0], x[1], x[2] = 0.0, -0.0, float("nan") if dtype != torch.float32 else 1e30
    return x.to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", SPECS)
def test_encode_into_kept_codes_sends_the_same_bytes(
    spec: str, dtype: torch.dtype, backend: str
) -> None:
    codec = get_codec(spec)
    assert codec.encodes_into
    part = CODES.get(codec.codec_id, "codes")
    pool: dict[str, torch.Tensor] = {}
    ptrs = set()
    with kernels.use_backend(backend):  # type: ignore[arg-type]
        for step, n in enumerate((4099, 4099, 4099, 777, 0, 777)):
            x = _input(n, dtype, seed=step)
            ctx = CodecContext(rank=1, world_size=2, step=step, key="w")
            plain = codec.encode(x, ctx)
            into = codec.encode(x, ctx, scratch=pool)
            assert plain.parts.keys() == into.parts.keys()
            for name in plain.parts:
                assert _bits(into.parts[name]) == _bits(plain.parts[name]), (name, step)
            if n and backend == "numba":
                # the packed codes live in the kept buffer: one per size
                assert into.parts[part].data_ptr() == pool["codes"].data_ptr()
                ptrs.add((n, pool["codes"].data_ptr()))
            # the decode of a payload in kept memory is the decode of a fresh one
            assert _bits(codec.decode(into, ctx)) == _bits(codec.decode(plain, ctx))
    if backend == "numba":
        assert len({p for n, p in ptrs if n == 4099}) == 1
        assert pool["codes"].numel() == -(-777 * _code_bits(codec) // 8)
    else:  # the torch path makes its payload as it goes and keeps nothing
        assert pool == {}


def _code_bits(codec: object) -> int:
    return {"minmax": getattr(codec, "bits", 8), "qsgd": getattr(codec, "code_bits", 8),
            "terngrad": 2, "sign": 1}[codec.codec_id]  # type: ignore[attr-defined]


def test_a_kept_payload_is_overwritten_by_the_next_encode() -> None:
    """What the docs of ``encode(scratch=)`` say: the payload is valid until the next encode
    with the same dict (callers copy or send it before)."""
    codec = get_codec("qsgd")
    pool: dict[str, torch.Tensor] = {}
    with kernels.use_backend("numba"):
        first = codec.encode(_input(1000, torch.float32, 1), scratch=pool)
        kept = first.parts["codes"].clone()
        codec.encode(_input(1000, torch.float32, 2), scratch=pool)
    assert not torch.equal(first.parts["codes"], kept)


@pytest.mark.parametrize("op", ["minmax", "qsgd", "terngrad", "sign"])
def test_kernel_codes_argument_refuses_a_wrong_buffer(op: str) -> None:
    x = torch.randn(100)
    bits = {"minmax": 8, "qsgd": 8, "terngrad": 2, "sign": 1}[op]
    nbytes = -(-100 * bits // 8)

    def run(codes: object) -> tuple[torch.Tensor, ...]:
        with kernels.use_backend("numba"):
            if op == "minmax":
                return kernels.minmax_encode(x, chunk=100, bits=8, stochastic=False,
                                             codes=codes)  # type: ignore[arg-type]
            if op == "qsgd":
                return kernels.qsgd_encode(x, chunk=100, levels=127, bits=8, clamp=1e30,
                                           codes=codes)  # type: ignore[arg-type]
            if op == "terngrad":
                return kernels.terngrad_encode(x, chunk=100, codes=codes)  # type: ignore[arg-type]
            return kernels.sign_encode_scaled(x, codes=codes)  # type: ignore[arg-type]

    good = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    assert run(good)[0].data_ptr() == good.data_ptr()
    assert torch.equal(good, run(None)[0])  # every byte written, none left from before
    for bad in (torch.empty(nbytes + 1, dtype=torch.uint8), torch.empty(nbytes - 1,
                dtype=torch.uint8), torch.empty(nbytes, dtype=torch.int8),
                torch.empty(2 * nbytes, dtype=torch.uint8)[::2],
                torch.empty(1, nbytes, dtype=torch.uint8), "codes"):
        with pytest.raises(CommpressError, match="codes must"):
            run(bad)
    # codes inside the input's memory would be overwritten while it is read
    with pytest.raises(CommpressError, match="overlap"):
        run(x.view(torch.uint8)[:nbytes])


@pytest.mark.parametrize("spec", [f"minmax:bits={b},chunk_size=7" for b in range(1, 9)]
                         + [f"minmax:bits={b}" for b in (3, 5, 6, 7)]
                         + [f"qsgd:levels={s},chunk_size=5" for s in (1, 2, 4, 8, 16, 32, 64)]
                         + ["qsgd:levels=15", "terngrad:chunk_size=3", "sign"])
def test_encode_into_a_dirty_kept_buffer_writes_every_byte(spec: str) -> None:
    """A kept buffer holds the last payload's bytes: an encode into it must write every byte
    (no bit ORed into a byte assumed zero), for every code width and odd sizes."""
    codec = get_codec(spec)
    part = CODES.get(codec.codec_id, "codes")
    g = torch.Generator().manual_seed(5)
    with kernels.use_backend("numba"):
        for n in (1, 3, 7, 9, 17, 33, 127, 1001, 16391):
            x = _input(n, torch.float32, seed=n)
            ctx = CodecContext(rank=0, world_size=2, step=n, key="d")
            plain = codec.encode(x, ctx)
            nbytes = plain.parts[part].numel()
            for dirty in (torch.full((nbytes,), 0xFF, dtype=torch.uint8),
                          torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)):
                pool = {"codes": dirty}
                into = codec.encode(x, ctx, scratch=pool)
                assert into.parts[part].data_ptr() == dirty.data_ptr()
                assert _bits(into.parts[part]) == _bits(plain.parts[part]), (spec, n)
