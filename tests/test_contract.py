"""The codec contract: registry, configs, payloads, contexts, errors."""

from __future__ import annotations

import json

import pytest
import torch

import commpress
from commpress.codecs import CodecContext, Payload, get_codec, list_codecs, parse_codec_spec
from commpress.codecs.registry import codec_class
from commpress.errors import CommpressError, error_context
from commpress.testing import check_config_round_trip, gaussian

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
