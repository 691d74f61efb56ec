"""The 16-bit casts' in-place path (``_FloatCast.reduce`` with ``out=`` and ``scratch=``,
``AllReduce.scratch``, the DDP bucket's reused payload): the same requests and totals, bit for
bit, as the plain protocol, with nothing the caller still needs overwritten."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from commpress.codecs import get_codec
from commpress.codecs.base import CodecContext
from commpress.codecs.protocol import AllReduce
from commpress.codecs.simulate import drive
from dist_utils import run_workers

WORLD = 2


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # magnitudes from subnormal fp16 to beyond fp16's range, and a NaN: every rounding case
    xs = [torch.randn(4, 257, generator=g) * torch.logspace(-9, 5.5, 257) for _ in range(WORLD)]
    xs[1][0, 3] = float("nan")
    return [x.to(dtype) for x in xs]


def _requests(codec_id: str, x: torch.Tensor, ctx: CodecContext, **kw: Any) -> list[bytes]:
    gen = get_codec(codec_id).reduce_into(x, ctx, **kw)
    req = next(gen)
    assert isinstance(req, AllReduce)
    return [req.tensors["values"].clone().view(torch.uint8).numpy().tobytes()]


@pytest.mark.parametrize("codec_id", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("need_local", [False, True])
def test_out_and_scratch_give_the_plain_results(
    codec_id: str, dtype: torch.dtype, average: bool, need_local: bool
) -> None:
    codec = get_codec(codec_id)
    xs = _inputs(dtype)
    kept = [x.clone() for x in xs]
    ctxs = [CodecContext(rank=r, world_size=WORLD, average=average, need_local=need_local)
            for r in range(WORLD)]
    plain = drive([codec.reduce(x, c) for x, c in zip(xs, ctxs, strict=True)])
    for r in range(WORLD):
        assert torch.equal(xs[r].view(torch.uint8), kept[r].view(torch.uint8)), "input changed"
    outs = [torch.full_like(x, 3.0) for x in xs]
    scratch: list[dict[str, torch.Tensor]] = [{} for _ in range(WORLD)]
    for _ in range(2):  # the second call reuses the scratch buffers
        ptrs = [s["values"].data_ptr() if s else None for s in scratch]
        into = drive([
            codec.reduce_into(x, c, out=o, scratch=s)
            for x, c, o, s in zip(xs, ctxs, outs, scratch, strict=True)
        ])
        for r in range(WORLD):
            a, b = plain.totals[r], into.totals[r]
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (r, "total differs")
            if need_local:
                la, lb = plain.locals[r], into.locals[r]
                assert la is not None and lb is not None
                assert torch.equal(la.view(torch.uint8), lb.view(torch.uint8))
            fresh = dtype != codec.wire_dtype  # type: ignore[attr-defined]
            # The total lands in ``out`` when the request was a tensor of the codec's own (the
            # cast's, or the mean's division of the input), and ``local`` is not the input.
            expect_out = fresh or (average and not need_local)
            assert (into.totals[r].data_ptr() == outs[r].data_ptr()) == expect_out
            if fresh and ptrs[r] is not None:
                assert scratch[r]["values"].data_ptr() == ptrs[r], "scratch not reused"
            assert torch.equal(xs[r].view(torch.uint8), kept[r].view(torch.uint8))
        # The requests are the same bytes whichever path made them.
        ctx = ctxs[0]
        assert _requests(codec_id, xs[0], ctx) == _requests(
            codec_id, xs[0], ctx, out=torch.empty_like(xs[0]), scratch={}
        )


def test_out_may_be_the_input_itself() -> None:
    """The DDP bucket: sent from and decoded into the same memory."""
    codec = get_codec("fp16")
    xs = _inputs(torch.float32)
    ctxs = [CodecContext(rank=r, world_size=WORLD, average=True) for r in range(WORLD)]
    plain = drive([codec.reduce(x.clone(), c) for x, c in zip(xs, ctxs, strict=True)])
    into = drive([
        codec.reduce_into(x, c, out=x, scratch={})
        for x, c in zip(xs, ctxs, strict=True)
    ])
    for r in range(WORLD):
        assert into.totals[r].data_ptr() == xs[r].data_ptr()
        assert torch.equal(xs[r].view(torch.uint8), plain.totals[r].view(torch.uint8))


def _scratch_worker(rank: int, world: int) -> dict[str, Any]:
    from commpress.codecs.protocol import Protocol, Reduced
    from commpress.collectives.driver import execute

    out: dict[str, Any] = {}
    for scratch in (False, True):
        t = torch.arange(6.0) + rank
        keep = t.clone()

        def protocol(t: torch.Tensor = t, scratch: bool = scratch) -> Protocol:
            reply = yield AllReduce(tensors={"v": t}, scratch=scratch)
            return Reduced(total=reply["v"])

        total = execute(protocol()).total
        out[str(scratch)] = (total.data_ptr() == t.data_ptr(), torch.equal(t, keep),
                             total.tolist())
    return out


def test_driver_reduces_scratch_requests_in_place() -> None:
    results = run_workers(_scratch_worker, WORLD, timeout=120)
    want = [float(2 * i + 1) for i in range(6)]
    for out in results:
        same, untouched, values = out["False"]
        assert not same and untouched and values == want  # requests are never written to
        same, untouched, values = out["True"]
        assert same and not untouched and values == want  # the codec's scratch is the reply


def _train(
    rank: int, codec: str, steps: int, after_step: Any = None, **register: Any
) -> tuple[torch.Tensor, list[Any]]:
    """A small MLP trained ``steps`` steps under DDP with commpress's hook (``codec``,
    ``register``'s keywords); its parameters, and ``after_step(state)`` after each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress.ddp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    model = DDP(net, bucket_cap_mb=0.05)
    state = commpress.ddp.register(model, codec, **register)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    seen = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(8, 64, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if after_step is not None:
            seen.append(after_step(state))
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]), seen


def _ddp_scratch_worker(rank: int, world: int) -> dict[str, Any]:
    def kept(state: Any) -> list[tuple[str, int, int]]:
        return sorted(
            (k, s["values"].data_ptr(), s["values"].numel()) for k, s in state._scratch.items()
        )

    params, ptrs = _train(rank, "fp16", 4, kept)
    return {"ptrs": ptrs, "params": params}


def test_ddp_bucket_payloads_are_reused_across_steps() -> None:
    results = run_workers(_ddp_scratch_worker, WORLD, timeout=120)
    for out in results:
        ptrs = out["ptrs"]
        assert ptrs[1], "no buffer kept"
        # from the step after DDP rebuilt its buckets on, the same buffers every step
        assert ptrs[1] == ptrs[2] == ptrs[3]
        # one fp16 element per gradient element
        assert sum(n for _, _, n in ptrs[3]) == out["params"].numel()
    assert torch.equal(results[0]["params"], results[1]["params"])


@pytest.mark.parametrize("codec_id", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_encode_into_scratch_reuses_one_buffer_bit_for_bit(
    codec_id: str, dtype: torch.dtype
) -> None:
    codec = get_codec(codec_id)
    assert codec.encodes_into
    ctx = CodecContext(key="scratch")
    pool: dict[str, torch.Tensor] = {}
    first, second = _inputs(dtype)
    ptrs = set()
    for x in (first, second, first):
        plain = codec.encode(x, ctx).parts["values"]
        into = codec.encode(x, ctx, scratch=pool).parts["values"]
        assert into.dtype == plain.dtype and into.shape == plain.shape
        assert torch.equal(into.view(torch.int16), plain.view(torch.int16))  # NaN bits too
        if dtype != codec.wire_dtype:  # type: ignore[attr-defined]
            ptrs.add(into.data_ptr())
            assert into.data_ptr() == pool["values"].data_ptr()
    # one buffer for the three calls (none when the input is already the wire dtype)
    assert len(ptrs) == (0 if dtype == codec.wire_dtype else 1)  # type: ignore[attr-defined]
    # another size replaces the buffer
    if dtype != codec.wire_dtype:  # type: ignore[attr-defined]
        small = codec.encode(first[:2], ctx, scratch=pool).parts["values"]
        assert small.numel() == 2 * 257 and pool["values"].numel() == 2 * 257


def test_encode_scratch_is_ignored_by_codecs_without_encodes_into() -> None:
    codec = get_codec("topk")
    assert not codec.encodes_into
    x = _inputs(torch.float32)[0]
    pool: dict[str, torch.Tensor] = {}
    payload = codec.encode(x, scratch=pool)
    assert pool == {}
    for name, part in codec.encode(x).parts.items():
        assert torch.equal(payload.parts[name], part), name


def _scaled_fp16() -> Any:
    """A cast that sends ``2 x`` in float16 and halves the sum (a user's subclass of Fp16,
    not registered)."""
    from dataclasses import dataclass

    from commpress.codecs.cast import Fp16

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Scaled(Fp16):
        def _encode(self, x: torch.Tensor, ctx: CodecContext,
                    scratch: dict[str, torch.Tensor] | None = None) -> Any:
            return self.make_payload(x, {"values": (x.reshape(-1) * 2).to(self.wire_dtype)})

        def _decode(self, payload: Any, ctx: CodecContext,
                    out: torch.Tensor | None = None) -> torch.Tensor:
            half = Fp16._decode(self, payload, ctx, out) / 2
            return out.copy_(half) if out is not None else half

    return Scaled()


@pytest.mark.parametrize("which", ["fp16", "bf16", "scaled fp16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_bound_cast_sends_what_its_protocol_requests(which: str, dtype: torch.dtype) -> None:
    """``bind``'s encode writes into its wire buffer what the codec's own ``reduce`` asks to
    all-reduce (bit for bit); a codec whose encoding differs from the plain cast (a subclass)
    or an input already of the wire dtype has no bound form."""
    codec = _scaled_fp16() if which == "scaled fp16" else get_codec(which)
    x = _inputs(dtype)[1].reshape(-1)
    ctx = CodecContext(rank=1, world_size=WORLD, key="k", need_local=False, average=True)
    bound = codec.bind(x, ctx, out=x, scratch={})
    if which == "scaled fp16" or dtype == codec.wire_dtype:
        assert bound is None
        return
    assert bound is not None
    gen = codec.reduce_into(x.clone(), ctx, out=x.clone(), scratch={})
    request = next(gen)
    gen.close()
    assert isinstance(request, AllReduce) and not request.saturate
    bound.encode(ctx)
    want = request.tensors["values"]
    assert bound.wire.dtype == want.dtype and bound.wire_bytes == request.wire_bytes
    assert bound.wire.view(torch.int16).equal(want.reshape(-1).view(torch.int16))


@pytest.mark.parametrize("shape", [(4099,), (97, 43)])
def test_a_bound_fp16_mean_follows_the_backend_at_each_encode(shape: tuple[int, ...]) -> None:
    """A lane bound while the numba kernels run (its cast and division possibly fused,
    kernels.convert_divide) still encodes, with the same bits, when a later step runs under
    another backend (``use_backend("torch")``): the backend is read per call, as
    ``_cast_into`` reads it, not fixed when the lane was bound."""
    from commpress.codecs import kernels

    x = torch.randn(shape) * 1000
    ctx = CodecContext(rank=1, world_size=3, key="k", need_local=False, average=True)
    bound = get_codec("fp16").bind(x, ctx, out=x, scratch={})
    assert bound is not None
    want = torch.empty(x.numel(), dtype=torch.float16)
    want.copy_(x.reshape(-1))
    want.div_(3)
    bound.encode(ctx)
    assert bound.wire.view(torch.int16).equal(want.view(torch.int16))
    bound.wire.zero_()
    from commpress.codecs.kernels import numba_cpu

    launches = []
    real_launch = numba_cpu._launch

    def counted() -> Any:
        launches.append(1)
        return real_launch()

    numba_cpu._launch = counted  # type: ignore[assignment]
    try:
        with kernels.use_backend("torch"):
            bound.encode(ctx)
    finally:
        numba_cpu._launch = real_launch  # type: ignore[assignment]
    assert bound.wire.view(torch.int16).equal(want.view(torch.int16))
    assert not launches  # the torch backend's cast, not a numba kernel prepared at bind


def _ddp_gathered_worker(rank: int, world: int) -> dict[str, Any]:
    from commpress.codecs.base import Codec

    out: dict[str, Any] = {}
    plain_sum = Codec.sum_decoded
    into = []

    def counted(self: Codec, payloads: Any, ctx: Any, **kw: Any) -> torch.Tensor:
        total = plain_sum(self, payloads, ctx, **kw)
        into.append(kw.get("out") is not None and total is kw["out"])
        return total

    Codec.sum_decoded = counted  # type: ignore[method-assign]
    for codec in ("qsgd", "minmax:bits=4"):
        for strategy in ("auto", "allgather"):
            params, _ = _train(rank, codec, 3, strategy=strategy, error_feedback=False)
            out[f"{codec} {strategy}"] = (params, list(into))
            into.clear()
    Codec.sum_decoded = plain_sum  # type: ignore[method-assign]
    return out


def test_ddp_gathered_buckets_are_summed_into_the_bucket() -> None:
    """QSGD and minmax through the hook's codec protocol (``auto``: every gradient's mean
    summed into its own memory in the bucket, ``sum_decoded(out=...)``) train to the same
    parameters, bit for bit, as the ``allgather`` strategy (new totals, copied back)."""
    results = run_workers(_ddp_gathered_worker, WORLD, timeout=180)
    for out in results:
        for codec in ("qsgd", "minmax:bits=4"):
            (auto, into), (gather, fresh) = out[f"{codec} auto"], out[f"{codec} allgather"]
            assert torch.equal(auto, gather), codec
            assert len(into) == 3 * 4 and all(into), codec  # 4 parameters, 3 steps
            assert len(fresh) == 3 * 4 and not any(fresh), codec
    assert torch.equal(results[0]["qsgd auto"][0], results[1]["qsgd auto"][0])
