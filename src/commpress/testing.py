"""Shared checks for codecs, used by commpress's own tests and by anyone writing a codec.

Each ``check_*`` function raises ``AssertionError`` with a message that says what failed. They
use fixed seeds, so a failure reproduces.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from commpress.codecs.base import Codec, CodecContext, Payload
from commpress.codecs.registry import get_codec
from commpress.codecs.simulate import simulate
from commpress.errors import CommpressError

# Sample inputs and the error metric live in commpress.metrics (the performance model and the
# benchmarks use them too); re-exported here for the tests and for codec authors.
from commpress.metrics import gaussian as gaussian
from commpress.metrics import heavy_tailed as heavy_tailed
from commpress.metrics import nmse as nmse

#: Shapes every codec must handle, including 0-d and empty tensors.
EDGE_SHAPES: tuple[tuple[int, ...], ...] = (
    (),
    (0,),
    (1,),
    (7,),
    (3, 5),
    (2, 0, 3),
    (2, 3, 4, 5),
    (1000,),
    (33, 65),
)
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def check_config_round_trip(codec: Codec) -> None:
    """The config survives JSON and rebuilds an equal codec with the same fingerprint."""
    config = codec.get_config()
    text = json.dumps(config)
    rebuilt = get_codec(json.loads(text))
    assert type(rebuilt) is type(codec), f"{config} rebuilt as {type(rebuilt).__name__}"
    assert rebuilt == codec, f"{config} rebuilt as {rebuilt.get_config()}"
    assert rebuilt.fingerprint() == codec.fingerprint()
    assert type(codec).from_config(config) == codec


def check_round_trip(
    codec: Codec,
    x: torch.Tensor,
    *,
    max_nmse: float | None = None,
    ctx: CodecContext | None = None,
) -> tuple[Payload, torch.Tensor]:
    """Encode then decode ``x``: shape, dtype and device are kept; lossless codecs are
    bit-exact; lossy ones stay within ``max_nmse`` when given. Returns payload and output."""
    payload = codec.encode(x, ctx)
    assert payload.codec == codec.codec_id
    assert tuple(payload.shape) == tuple(x.shape)
    assert payload.dtype == x.dtype
    counted = sum(
        -(-t.numel() * payload.lane_bits.get(k, t.element_size() * 8) // 8)
        for k, t in payload.parts.items()
    )
    assert payload.nbytes == counted, f"{codec}: nbytes {payload.nbytes} != parts {counted}"
    out = codec.decode(payload, ctx, shape=x.shape)
    assert out.shape == x.shape, f"{codec}: decoded shape {out.shape} != {x.shape}"
    assert out.dtype == x.dtype, f"{codec}: decoded dtype {out.dtype} != {x.dtype}"
    assert out.device == x.device, f"{codec}: decoded on {out.device}, input on {x.device}"
    if codec.lossless:
        same = torch.equal(out.view(-1).view(torch.uint8), x.reshape(-1).view(torch.uint8)) if (
            x.numel()
        ) else True
        assert same, f"{codec} claims lossless but the round trip changed bits"
    if max_nmse is not None and x.numel():
        err = nmse(out, x)
        assert err <= max_nmse, f"{codec}: NMSE {err:.4g} > bound {max_nmse:.4g}"
    return payload, out


def check_edge_shapes_and_dtypes(
    codec: Codec,
    *,
    shapes: Sequence[tuple[int, ...]] = EDGE_SHAPES,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    device: str | torch.device = "cpu",
) -> None:
    """Every shape (0-d and empty included) and dtype round-trips with shape/dtype/device kept,
    and a single simulated worker's reduction returns a tensor of the right kind too."""
    for dtype in dtypes:
        for i, shape in enumerate(shapes):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
            try:
                check_round_trip(codec, x)
                sim = simulate(codec, [x, x.clone()], need_local=True)
            except CommpressError as exc:  # pragma: no cover - makes the failure readable
                raise AssertionError(f"{codec} failed on shape {shape} {dtype}: {exc}") from exc
            for total in sim.totals:
                assert total.shape == x.shape and total.dtype == dtype, (
                    f"{codec}: reduce returned {total.shape} {total.dtype} for {shape} {dtype}"
                )
            assert torch.equal(sim.totals[0], sim.totals[1]), f"{codec}: workers disagree"
    # float64 and non-contiguous layouts (transposed, strided, channels_last) on a few shapes.
    g = torch.Generator().manual_seed(123)
    base = torch.randn(6, 8, 5, 4, generator=g).to(device=device)
    odd_layouts = {
        "float64": base.double(),
        "transposed": base[0, :, :, 0].t(),
        "strided": base[:, ::2, 1:, ::3],
        "channels_last": base.contiguous(memory_format=torch.channels_last),
    }
    for name, x in odd_layouts.items():
        try:
            _, out = check_round_trip(codec, x)
            sim = simulate(codec, [x, x.clone()])
        except CommpressError as exc:  # pragma: no cover - makes the failure readable
            raise AssertionError(f"{codec} failed on a {name} input: {exc}") from exc
        assert sim.total.shape == x.shape and sim.total.dtype == x.dtype, (codec, name)
        if codec.lossless:
            assert torch.equal(out, x), f"{codec}: {name} input not reproduced exactly"


def check_rejects_bad_input(codec: Codec, other: Codec | None = None) -> None:
    """Non-float input, a foreign payload, a wrong expected shape and a corrupted payload all
    raise :class:`CommpressError`."""
    x = gaussian(64)
    for bad in (torch.arange(10), torch.ones(3, dtype=torch.bool), [1.0, 2.0], None):
        try:
            codec.encode(bad)  # type: ignore[arg-type]
        except CommpressError:
            pass
        else:
            raise AssertionError(f"{codec} accepted {bad!r}")
    payload = codec.encode(x)
    try:
        codec.decode(payload, shape=(65,))
    except CommpressError:
        pass
    else:
        raise AssertionError(f"{codec} decoded a 64-element payload as shape (65,)")
    if other is None:
        other = get_codec("fp16" if codec.codec_id == "identity" else "identity")
    foreign = other.encode(x)
    try:
        codec.decode(foreign)
    except CommpressError:
        pass
    else:
        raise AssertionError(f"{codec} decoded a payload of {other}")
    truncated = payload.replace(
        parts={k: v.reshape(-1)[: max(v.numel() - 1, 0)] for k, v in payload.parts.items()}
    )
    if any(v.numel() for v in payload.parts.values()):
        try:
            codec.decode(truncated)
        except CommpressError:
            pass
        else:
            raise AssertionError(f"{codec} decoded a payload whose parts were truncated")


def check_nonfinite(codec: Codec, *, propagates: bool = True) -> None:
    """NaN and +-Inf inputs never crash or hang. With ``propagates`` (the default contract),
    a non-finite input yields a non-finite output, so AMP's inf checks still trip."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in FLOAT_DTYPES:
            x = gaussian(256).to(dtype)
            x[17] = bad
            out = codec.decode(codec.encode(x))
            assert out.shape == x.shape
            if propagates:
                assert not bool(torch.isfinite(out).all()), (
                    f"{codec}: input with {bad} decoded to an all-finite tensor ({dtype})"
                )
            sim = simulate(codec, [x, gaussian(256, seed=1).to(dtype)])
            if propagates:
                assert not bool(torch.isfinite(sim.total).all()), (
                    f"{codec}: reduction of an input with {bad} is all-finite ({dtype})"
                )


def check_unbiased(
    codec: Codec,
    x: torch.Tensor,
    *,
    trials: int,
    tolerance: float,
) -> float:
    """The mean of ``trials`` encodings (steps 0..trials-1) approaches ``x``.

    For an unbiased codec with per-encoding NMSE ``v``, the mean of T independent encodings
    has expected NMSE ``v / T``; callers pass a ``tolerance`` on the NMSE of the mean derived
    from that (typically a few times ``v / T``). Returns the observed NMSE of the mean.
    """
    acc = torch.zeros_like(x, dtype=torch.float64)
    for t in range(trials):
        ctx = CodecContext(step=t, key="unbiased")
        acc += codec.decode(codec.encode(x, ctx), ctx).double()
    err = nmse(acc / trials, x)
    assert err <= tolerance, (
        f"{codec}: NMSE of the mean of {trials} encodings is {err:.3g} > {tolerance:.3g}; biased?"
    )
    return err


def check_aggregate(
    codec: Codec,
    inputs: Sequence[torch.Tensor],
    *,
    max_nmse: float,
    steps: int = 1,
) -> float:
    """Simulated aggregation matches the exact sum within ``max_nmse`` and is identical on
    every worker (bit for bit). Runs ``steps`` consecutive steps carrying codec state.
    Returns the last step's NMSE."""
    states: list[dict[str, Any]] | None = None
    exact = torch.stack([t.double() for t in inputs]).sum(dim=0)
    err = float("nan")
    for step in range(steps):
        sim = simulate(codec, inputs, step=step, states=states)
        states = sim.states
        for r, total in enumerate(sim.totals[1:], start=1):
            assert torch.equal(total, sim.totals[0]), f"{codec}: worker {r} differs from worker 0"
        err = nmse(sim.total, exact)
    assert err <= max_nmse, f"{codec}: aggregate NMSE {err:.4g} > {max_nmse:.4g}"
    return err


def check_order_independent(codec: Codec, inputs: Sequence[torch.Tensor]) -> None:
    """Summing workers in reversed or rotated order gives a bit-identical aggregate."""
    n = len(inputs)
    base = simulate(codec, inputs).total
    orders: list[list[int]] = [list(reversed(range(n))), [*range(1, n), 0]]
    for order in orders:
        other = simulate(codec, inputs, order=order).total
        assert torch.equal(base, other), f"{codec}: aggregate depends on summation order {order}"


def check_wire_bits(codec: Codec, x: torch.Tensor, expected_bits: float) -> None:
    """The payload's exact size is ``expected_bits`` in total (rounded up to bytes)."""
    payload = codec.encode(x)
    expected = -(-int(round(expected_bits)) // 8)
    assert payload.nbytes == expected, (
        f"{codec}: payload is {payload.nbytes} bytes, formula gives {expected} "
        f"({expected_bits} bits) for {tuple(x.shape)}"
    )


def run_all_contract_checks(
    codec: Codec, *, propagates_nonfinite: bool = True, extra: Callable[[Codec], None] | None = None
) -> None:
    """The checks every registered codec must pass."""
    check_config_round_trip(codec)
    check_edge_shapes_and_dtypes(codec)
    check_rejects_bad_input(codec)
    check_nonfinite(codec, propagates=propagates_nonfinite)
    if extra is not None:
        extra(codec)
