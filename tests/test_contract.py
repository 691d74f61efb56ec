"""The codec contract: registry, configs, payloads, contexts, errors."""

from __future__ import annotations

import json
import math
import typing

import pytest
import torch

import commpress
from commpress.codecs import (
    Codec,
    CodecContext,
    Payload,
    get_codec,
    list_codecs,
    parse_codec_spec,
    simulate,
)
from commpress.codecs.base import FeedbackFit
from commpress.codecs.randomk import RandomK
from commpress.codecs.registry import codec_class
from commpress.errors import (
    CommpressError,
    ConfigError,
    PayloadError,
    error_context,
    exit_status,
    read_json,
)
from commpress.testing import check_config_round_trip, gaussian, nmse

EXPECTED_IDS = {
    "identity", "fp16", "bf16",
    "minmax", "qsgd", "terngrad", "sign", "thc",
    "topk", "randomk", "topkc", "dgc",
    "powersgd",
    "netzip",
}


def test_registry_lists_every_codec() -> None:
    ids = set(commpress.codec_ids())
    missing = EXPECTED_IDS - ids
    assert not missing, f"codecs missing from the registry: {sorted(missing)}"
    assert [c.codec_id for c in list_codecs()] == sorted(ids)


@pytest.mark.parametrize("codec_id", sorted(EXPECTED_IDS))
def test_default_config_round_trips_through_json(codec_id: str) -> None:
    codec = get_codec(codec_id)
    check_config_round_trip(codec)
    assert json.loads(json.dumps(codec.get_config()))["id"] == codec_id


@pytest.mark.parametrize("codec_id", sorted(EXPECTED_IDS))
def test_codec_declares_its_nature(codec_id: str) -> None:
    cls = codec_class(codec_id)
    assert isinstance(cls.summable, bool) and isinstance(cls.lossless, bool)
    assert cls.summary, f"{codec_id} has no summary line"
    for name, _default, doc in cls.parameters():
        assert doc, f"{codec_id}.{name} has no description"


def test_codec_modules_table_names_where_each_codec_lives() -> None:
    """``codecs.CODEC_MODULES`` (id -> module) is the map a reader uses to find a codec."""
    from commpress.codecs import CODEC_MODULES

    assert set(CODEC_MODULES) == set(commpress.codec_ids())
    for codec_id, module in CODEC_MODULES.items():
        defined_in = codec_class(codec_id).__module__
        assert defined_in.startswith(f"commpress.codecs.{module}"), (codec_id, defined_in)


@pytest.mark.parametrize(
    ("spec", "params"),
    [
        ("topk", {"ratio": 2.0}),
        ("netzip", {"level": 40}),
        ("netzip", {"grouping": "nibble"}),
        ("qsgd", {"seed": -1}),
        ("identity", {"bogus": 1}),
        ("powersgd", {"rank": "four"}),
    ],
)
def test_bad_codec_parameters_raise_config_error(spec: str, params: dict) -> None:
    with pytest.raises(ConfigError):
        get_codec(spec, **params)


def test_malformed_payloads_raise_payload_error() -> None:
    """A part of the wrong size (checked by ``part``) and an out-of-range index (a torch error
    inside ``_decode``) are both PayloadErrors; a payload of another codec too."""
    x = gaussian(20, seed=1)
    topk = get_codec("topk", ratio=0.5)
    p = topk.encode(x)
    bad = p.parts["indices"].clone()
    bad[0] = 10**6
    with pytest.raises(PayloadError, match="topk.decode: RuntimeError"):
        topk.decode(p.replace(parts={**p.parts, "indices": bad}))
    qsgd = get_codec("qsgd")
    q = qsgd.encode(x)
    with pytest.raises(PayloadError, match="part 'codes' has 19 elements"):
        qsgd.decode(q.replace(parts={**q.parts, "codes": q.parts["codes"][:-1]}))
    with pytest.raises(PayloadError, match="produced by codec 'qsgd'"):
        topk.decode(q)


def test_get_codec_accepts_id_mapping_spec_and_instance() -> None:
    a = get_codec("fp16")
    assert get_codec({"id": "fp16"}) == a
    assert get_codec(a) is a
    assert parse_codec_spec("powersgd:rank=4,flag=true,name=x") == {
        "id": "powersgd", "rank": 4, "flag": True, "name": "x",
    }


def test_unknown_id_lists_known_ids() -> None:
    with pytest.raises(CommpressError, match="unknown codec id 'nope'.*identity"):
        get_codec("nope")
    with pytest.raises(CommpressError, match="did you mean 'topk'"):  # another case
        get_codec("TOPK")


def test_spec_refuses_a_repeated_parameter_and_reads_nan_as_a_number() -> None:
    # the last value used to win silently; 'nan' was "must be float, got 'nan'"
    with pytest.raises(CommpressError, match="'ratio' is given twice"):
        parse_codec_spec("topk:ratio=0.01,ratio=0.5")
    with pytest.raises(CommpressError, match="goes before the ':'"):
        parse_codec_spec("topk:id=minmax")
    assert math.isnan(parse_codec_spec("topk:ratio=nan")["ratio"])
    assert parse_codec_spec("topk:ratio=-inf")["ratio"] == -math.inf
    with pytest.raises(CommpressError, match=r"ratio must be in \(0, 1\], got nan"):
        get_codec("topk:ratio=nan")


def test_unknown_parameter_lists_accepted_ones() -> None:
    with pytest.raises(CommpressError, match="unknown parameter.*bogus"):
        get_codec("identity", bogus=1)


def test_error_type_is_a_value_error() -> None:
    assert issubclass(CommpressError, ValueError)


def test_missing_id_and_bad_spec_are_refused() -> None:
    with pytest.raises(CommpressError, match="no 'id'"):
        get_codec({"ratio": 0.1})
    with pytest.raises(CommpressError, match="name=value"):
        parse_codec_spec("topk:0.1")
    with pytest.raises(CommpressError):
        get_codec(3.0)  # type: ignore[arg-type]


def test_error_context_prefixes_and_converts() -> None:
    with (
        pytest.raises(CommpressError, match=r"^outer: inner: boom$"),
        error_context("outer"),
        error_context("inner"),
    ):
        raise CommpressError("boom")
    with pytest.raises(CommpressError, match=r"^doing x: RuntimeError: bad$"), error_context(
        "doing x"
    ):
        raise RuntimeError("bad")
    # a subtype survives the prefix
    with pytest.raises(ConfigError, match=r"^outer: bad option$"), error_context("outer"):
        raise ConfigError("bad option")


@pytest.mark.parametrize("bug", [TypeError, KeyError, AttributeError])
def test_error_context_does_not_relabel_bugs(bug: type[Exception]) -> None:
    """Programming errors keep their type (not a ValueError), with a note on where."""
    with pytest.raises(bug) as info, error_context("doing y"):
        raise bug("oops")
    assert not isinstance(info.value, ValueError)
    if hasattr(info.value, "add_note"):  # Python >= 3.11
        assert "(in doing y)" in getattr(info.value, "__notes__", [])


def test_read_json_names_the_file_it_cannot_read(tmp_path: typing.Any) -> None:
    good = tmp_path / "good.json"
    good.write_text('{"a": [1, 2]}')
    assert read_json(good, "the good file") == {"a": [1, 2]}
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(CommpressError, match=r"^cannot read the bad file: Expecting property"):
        read_json(bad, "the bad file")
    with pytest.raises(CommpressError, match=r"^cannot read it: \[Errno 2\] No such file"):
        read_json(tmp_path / "missing.json", "it")


def test_exit_status_reports_a_commpress_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_status(lambda: 3) == 3

    def failing() -> int:
        raise ConfigError("bad option")

    assert exit_status(failing) == 2
    assert capsys.readouterr().err == "commpress: error: bad option\n"

    def buggy() -> int:
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError):  # anything else is not the command's error to report
        exit_status(buggy)


@pytest.mark.parametrize("spec", ["identity", "minmax", "netzip"])
def test_a_decoding_of_another_shape_or_dtype_is_a_codec_bug(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Codec.decode (with and without ``out``), NetZip's own decode and sum_decoded check
    what a codec's ``_decode`` returned against the payload."""
    codec = get_codec(spec)
    payload = codec.encode(gaussian(12).reshape(3, 4))

    def wrong(
        self: typing.Any, payload: typing.Any, ctx: typing.Any, out: typing.Any = None
    ) -> torch.Tensor:
        return torch.zeros(payload.shape, dtype=torch.float64)

    monkeypatch.setattr(type(codec), "_decode", wrong)
    bug = r"decode produced \(3, 4\) torch.float64, expected \(3, 4\) torch.float32 \(codec bug\)"
    with pytest.raises(CommpressError, match=bug):
        codec.decode(payload)
    with pytest.raises(CommpressError, match=bug):
        codec.decode(payload, out=torch.empty(3, 4))
    with pytest.raises(CommpressError, match=bug):
        codec.sum_decoded([payload, payload], CodecContext())


def test_context_validates_and_seeds_reproducibly() -> None:
    with pytest.raises(CommpressError, match="rank"):
        CodecContext(rank=2, world_size=2)
    with pytest.raises(CommpressError, match="world_size"):
        CodecContext(world_size=0)
    with pytest.raises(CommpressError, match="world_size must be an int"):
        CodecContext(world_size=True)
    with pytest.raises(CommpressError, match="step must be an int"):
        CodecContext(step=1.5)  # type: ignore[arg-type]
    a = CodecContext(rank=0, world_size=2, step=3, key="w")
    b = CodecContext(rank=1, world_size=2, step=3, key="w")
    cpu = torch.device("cpu")
    shared_a = torch.rand(4, generator=a.generator(1, shared=True, device=cpu))
    shared_b = torch.rand(4, generator=b.generator(1, shared=True, device=cpu))
    own_a = torch.rand(4, generator=a.generator(1, shared=False, device=cpu))
    own_b = torch.rand(4, generator=b.generator(1, shared=False, device=cpu))
    assert torch.equal(shared_a, shared_b)
    assert not torch.equal(own_a, own_b)
    later = CodecContext(rank=0, world_size=2, step=4, key="w")
    assert not torch.equal(
        shared_a, torch.rand(4, generator=later.generator(1, shared=True, device=cpu))
    )


def test_payload_size_counts_logical_lane_width() -> None:
    p = Payload(
        codec="x", fingerprint="f", shape=(10,), dtype=torch.float32,
        parts={"codes": torch.zeros(10, dtype=torch.int8), "scale": torch.zeros(1)},
        lane_bits={"codes": 4},
    )
    assert p.nbytes == 5 + 4
    assert p.bits_per_coordinate == pytest.approx(8 * 9 / 10)
    empty = p.replace(shape=(0,), parts={})
    assert empty.nbytes == 0 and empty.bits_per_coordinate == 0.0


def test_decode_refuses_other_config_of_same_codec() -> None:
    x = gaussian(100)
    payload = get_codec("fp16").encode(x)
    forged = payload.replace(fingerprint="0" * 16)
    with pytest.raises(CommpressError, match="another configuration"):
        get_codec("fp16").decode(forged)
    with pytest.raises(CommpressError, match="expects a Payload"):
        get_codec("fp16").decode(x)  # type: ignore[arg-type]


def test_decode_checks_codec_output_against_payload() -> None:
    """A codec bug that returns the wrong shape is caught by the base class."""
    codec = get_codec("identity")
    payload = codec.encode(gaussian(12).reshape(3, 4))
    lying = payload.replace(shape=(4, 3))
    out = codec.decode(lying)  # same numel: a reshape is legitimate
    assert out.shape == (4, 3)
    with pytest.raises(CommpressError, match="12 elements, expected 13"):
        codec.decode(payload.replace(shape=(13,)))


def test_spec_string_names_changed_parameters_and_parses_back() -> None:
    codec = get_codec("topk", ratio=0.05)
    assert codec.spec() == "topk:ratio=0.05"
    assert get_codec(codec.spec()) == codec
    assert get_codec("fp16").spec() == "fp16"
    thc = get_codec("thc", saturate=True, bits=2)
    assert get_codec(thc.spec()) == thc
    sparse = get_codec("topk", value_dtype="float32")
    assert sparse.spec() == "topk:value_dtype=float32"
    assert get_codec(sparse.spec()) == sparse


# ------------------------------------------------------------------------ codec traits
#: Every registered codec with its defaults, plus the variants whose traits depend on a
#: parameter (both sides of each such parameter).
TRAIT_SPECS = [
    *sorted(EXPECTED_IDS),
    "randomk:scale=true",
    "randomk:scale=true,ratio=0.75",
    "qsgd:levels=1",
    "terngrad:chunk_size=2",
    "minmax:bits=1",
    "minmax:rounding=stochastic",
    "thc:bits=2",
    "thc:saturate=true",
]
#: Shapes the measurements run on (PowerSGD compresses the 2-D ones).
TRAIT_SHAPES = [(1000,), (48, 40), (3000,)]


def _apply(codec: Codec, x: torch.Tensor, step: int) -> torch.Tensor:
    """C(x) = decode(encode(x)) for one worker at ``step``, with fresh per-tensor state."""
    ctx = CodecContext(step=step, key="t", state={})
    payload = codec.encode(x, ctx)
    return codec.decode(payload, CodecContext(step=step, key="t", state=ctx.state))


def _ratios(codec: Codec, x: torch.Tensor, steps: int) -> list[float]:
    """Measured ||C(x) - x||^2 / ||x||^2 for ``steps`` draws."""
    return [nmse(_apply(codec, x, step), x) for step in range(steps)]


@pytest.mark.parametrize("spec", TRAIT_SPECS)
def test_traits_are_declared_and_consistent(spec: str) -> None:
    codec = get_codec(spec)
    for name in ("elementwise", "stateful", "unbiased", "contractive"):
        assert isinstance(getattr(codec, name), bool), f"{spec}.{name} is not a bool"
    assert codec.feedback_fit in typing.get_args(FeedbackFit)
    if codec.lossless:
        assert codec.unbiased and codec.contractive and codec.feedback_fit == "optional"
    if not codec.contractive:
        assert codec.feedback_fit == "incompatible"
    if codec.feedback_fit == "needed":
        assert codec.contractive and not codec.unbiased
    if codec.elementwise:
        assert not codec.stateful


def test_feedback_fit_keeps_todays_automatic_choice_where_it_works() -> None:
    """error_feedback=None turned EF on for every lossy codec but fp16/bf16. The biased
    contractive codecs keep it; randomk's default is now unscaled (contractive, EF needed);
    the non-contractive unbiased ones (scaled randomk, terngrad, coarse qsgd) are now
    incompatible; unbiased contractive qsgd/thc defaults (and stochastic minmax) are optional."""
    fits = {codec_id: get_codec(codec_id).feedback_fit for codec_id in EXPECTED_IDS}
    assert fits == {
        "identity": "optional", "fp16": "optional", "bf16": "optional", "netzip": "optional",
        "topk": "needed", "dgc": "needed", "topkc": "needed", "sign": "needed",
        "powersgd": "needed", "minmax": "needed", "randomk": "needed",
        "qsgd": "optional", "thc": "optional",
        "terngrad": "incompatible",
    }
    assert get_codec("randomk:scale=true").feedback_fit == "incompatible"
    assert get_codec("qsgd:levels=1").feedback_fit == "incompatible"
    assert get_codec("thc:bits=2").feedback_fit == "incompatible"
    assert get_codec("thc:saturate=true").feedback_fit == "needed"
    assert get_codec("minmax:rounding=stochastic").feedback_fit == "optional"


@pytest.mark.parametrize("spec", TRAIT_SPECS)
def test_contractive_matches_measurement(spec: str) -> None:
    """Declared contractive: the mean over 6 draws of ||C(x) - x||^2 / ||x||^2 is below 1 for
    Gaussian inputs of several sizes and seeds (the largest measured, thc at q = 3 aside, is
    sign's 1 - 2/pi ~ 0.36 and unscaled randomk's 1 - k/d = 0.99). Declared not contractive:
    the same mean is above 1 on at least one of those inputs (scaled randomk ~ 99, terngrad
    ~ 2, qsgd with one level ~ 15, 1-bit minmax ~ 2-8, thc at q = 2 ~ 2)."""
    codec = get_codec(spec)
    means = []
    for seed, shape in enumerate(TRAIT_SHAPES):
        x = gaussian(math.prod(shape), seed=seed).reshape(shape)
        ratios = _ratios(codec, x, steps=6)
        means.append(sum(ratios) / len(ratios))
    if codec.contractive:
        assert max(means) < 1.0, f"{spec} declared contractive, measured {means}"
    else:
        assert max(means) > 1.0, f"{spec} declared not contractive, measured {means}"


@pytest.mark.parametrize("spec", TRAIT_SPECS)
def test_unbiased_matches_measurement(spec: str) -> None:
    """The aggregate of two workers both holding x, halved, estimates x. Over T = 200 draws
    (steps) the mean estimate of an unbiased codec has NMSE v / T for a per-draw NMSE v: we
    require <= 2 v / T (+1e-12 for exact codecs). A biased codec's mean keeps its bias:
    NMSE > 4 v / T (deterministic codecs: the mean is one draw, NMSE = v; unscaled randomk's
    mean tends to (k/d) x, NMSE ~ 0.98; saturating thc clamps the agreeing workers' sums)."""
    codec = get_codec(spec)
    x = gaussian(1000, seed=11).reshape(40, 25)
    trials = 200
    acc = torch.zeros(x.shape, dtype=torch.float64)
    per_draw = 0.0
    for step in range(trials):
        out = simulate(codec, [x, x], step=step, key="t").total.double() / 2
        acc += out
        per_draw += nmse(out, x) / trials
    mean_err = nmse(acc / trials, x)
    if codec.unbiased:
        assert mean_err <= 2 * per_draw / trials + 1e-12, (spec, mean_err, per_draw)
    else:
        assert mean_err > 4 * per_draw / trials, (spec, mean_err, per_draw)


@pytest.mark.parametrize("codec_id", sorted(EXPECTED_IDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_elementwise_matches_measurement(codec_id: str, dtype: torch.dtype) -> None:
    """elementwise: decoding the encoding of a concatenation equals concatenating the
    decodings, bit for bit; non-elementwise codecs differ on these inputs."""
    codec = get_codec(codec_id)
    a = gaussian(700, seed=1, dtype=dtype)
    b = (gaussian(300, seed=2) * 100).to(dtype)
    whole = _apply(codec, torch.cat([a, b]), 0)
    parts = torch.cat([_apply(codec, a, 0), _apply(codec, b, 0)])
    if codec.elementwise:
        assert torch.equal(whole, parts)


@pytest.mark.parametrize("spec", [*sorted(EXPECTED_IDS), "netzip:delta=previous"])
def test_stateful_matches_measurement(spec: str) -> None:
    """A codec that is not stateful never writes ctx.state (two-worker reductions over three
    steps, and a single-worker encode); a stateful one may, depending on its configuration
    (netzip only with delta='previous'), and the ones listed here do."""
    codec = get_codec(spec)
    xs = [gaussian(2048, seed=i).reshape(64, 32) for i in range(2)]
    states: list[dict[str, object]] = [{}, {}]
    for step in range(3):
        simulate(codec, xs, states=states, key="w", step=step)
    ctx = CodecContext(key="w", state={})
    codec.decode(codec.encode(xs[0], ctx), ctx)
    touched = bool(states[0]) or bool(states[1]) or bool(ctx.state)
    if not codec.stateful:
        assert not touched, (spec, states, ctx.state)
    # and the converse: a codec declared stateful does keep state (a needless declaration
    # makes every step journal and check its tensors for nothing: netzip without previous-step
    # delta was declared stateful)
    assert codec.stateful == touched, spec
    if spec in ("powersgd", "netzip:delta=previous"):
        assert touched and codec.stateful


# ------------------------------------------------------------------------ overflow
#: Finite magnitudes every codec must map to finite outputs (largest |x| of the input).
MAGNITUDES: dict[torch.dtype, list[float]] = {
    torch.float32: [1e-30, 1e-10, 1.0, 1e10, 1e30, 3e38, float(torch.finfo(torch.float32).max)],
    torch.float16: [6e-8, 1e-3, 1.0, 1e3, 65504.0],
    torch.bfloat16: [1e-30, 1.0, 1e30, 3e38],
    torch.float64: [1e-300, 1.0, 1e30, 3e38, 1e300, 1.7e308],
}
F32_MAX = float(torch.finfo(torch.float32).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
FLOAT32_COMPUTE = {"minmax", "qsgd", "terngrad", "sign", "powersgd", "thc"}


def documented_overflow(codec: Codec, dtype: torch.dtype, magnitude: float) -> str | None:
    """The phrase of the codec's ``nonfinite`` text that allows a non-finite output for this
    input (one worker, or a sum of two at magnitude / 64 each), or None when the output must
    be finite."""
    codec_id = codec.codec_id
    if isinstance(codec, RandomK):
        value_max = float(torch.finfo(getattr(torch, codec.value_dtype)).max)
        if magnitude / 64 * 2 > value_max:
            return "sums over workers of saturated values overflow"
    if codec_id == "fp16" and dtype != torch.float16 and magnitude > 65504:
        return "beyond +-65504 become +-Inf"
    if codec_id == "bf16" and magnitude > BF16_MAX:
        return "beyond bfloat16's largest"
    if codec_id in FLOAT32_COMPUTE and dtype == torch.float64 and magnitude > F32_MAX:
        return "float64 inputs beyond float32's range"
    if codec_id == "thc" and dtype == torch.float32 and magnitude > 3e38:
        return "within a quantization step of float32's largest"
    return None


def _extreme(
    dtype: torch.dtype, magnitude: float, seed: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """Gaussian values scaled so that the largest |x| is ``magnitude`` (finite in dtype)."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    top = float(torch.finfo(dtype).max)
    x = (g / g.abs().max() * magnitude).clamp(-top, top).to(dtype)
    assert bool(torch.isfinite(x).all())
    return x


@pytest.mark.parametrize(
    "spec",
    [*sorted(EXPECTED_IDS), "randomk:scale=true", "randomk:value_dtype=float16",
     "topk:value_dtype=bfloat16", "dgc:value_dtype=float16", "topkc:value_dtype=bfloat16",
     "qsgd:levels=1", "thc:bits=8"],
)
def test_finite_inputs_give_finite_outputs(spec: str) -> None:
    """Finite inputs from 1e-30 to float32's largest (fp16: up to 65504, fp64: up to 1.7e308)
    decode to finite outputs on one worker, and reduce to finite totals over two workers
    whose estimates' sum is representable (magnitude / 64 each: qsgd with one level sends
    +-||chunk||, up to sqrt(512) times the largest |x|), unless the codec's ``nonfinite``
    text documents the overflow."""
    codec = get_codec(spec)
    for dtype, mags in MAGNITUDES.items():
        for magnitude in mags:
            x = _extreme(dtype, magnitude, 0, (48, 40))
            allowed = documented_overflow(codec, dtype, magnitude)
            if allowed is not None:
                assert allowed in codec.nonfinite, (spec, allowed, codec.nonfinite)
                continue
            out = _apply(codec, x, 0)
            assert bool(torch.isfinite(out).all()), (spec, dtype, magnitude)
            xs = [_extreme(dtype, magnitude / 64, seed, (48, 40)) for seed in (1, 2)]
            for average in (False, True):
                for total in simulate(codec, xs, average=average).totals:
                    assert bool(torch.isfinite(total).all()), (spec, dtype, magnitude, average)


@pytest.mark.parametrize("codec_id", sorted(EXPECTED_IDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(33, 17), (0,), ()])
def test_decode_into_a_buffer_is_bit_identical(
    codec_id: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """``decode(..., out=buf)`` writes into ``buf``, returns it, and equals a fresh decode."""
    codec = get_codec(codec_id)
    x = gaussian(math.prod(shape), seed=4).reshape(shape).to(dtype)
    ctx = CodecContext(key="w", step=1)
    payload = codec.encode(x, ctx)
    fresh = codec.decode(payload, ctx)
    buf = torch.full(shape, 7.0, dtype=dtype)  # stale content must not leak through
    into = codec.decode(payload, ctx, out=buf)
    assert into is buf
    torch.testing.assert_close(into, fresh, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(into), torch.signbit(fresh))


def test_decode_refuses_a_wrong_buffer() -> None:
    codec = get_codec("fp16")
    payload = codec.encode(gaussian(12).reshape(3, 4))
    for bad in (
        torch.empty(4, 3), torch.empty(3, 4, dtype=torch.float64), torch.empty(4, 3).t(), "x",
    ):
        with pytest.raises(CommpressError, match="out must be"):
            codec.decode(payload, out=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("codec_id", sorted(EXPECTED_IDS))
def test_every_codec_encode_takes_scratch_and_ignores_it_or_reuses_it(codec_id: str) -> None:
    """``Codec.encode(x, ctx, scratch=...)`` is part of the codec API: every codec takes the
    keyword (those without ``encodes_into`` ignore it) and sends the same payload."""
    codec = get_codec(codec_id)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5))
    ctx = CodecContext(rank=0, world_size=1, step=0, key="t")
    plain = codec.encode(x, ctx)
    scratch: dict[str, torch.Tensor] = {}
    ctx2 = CodecContext(rank=0, world_size=1, step=0, key="t")
    again = codec.encode(x, ctx2, scratch=scratch)
    assert plain.parts.keys() == again.parts.keys()
    for name in plain.parts:
        assert torch.equal(plain.parts[name], again.parts[name]), name
    if not codec.encodes_into:
        assert not scratch
