"""Han et al.'s published tables through the model, and the measured device profiles."""

from __future__ import annotations

import json
import math

import pytest

from commpress.codecs import get_codec
from commpress.perfmodel.codec_costs import (
    CodecSpeed,
    ExchangeConfig,
    SpeedTable,
    exchange_segments,
)
from commpress.perfmodel.collectives import Cluster
from commpress.perfmodel.published import (
    DATA,
    bert_large_shapes,
    load,
    reproduce,
    vgg19_shapes,
)


def test_model_shapes_have_the_published_parameter_counts() -> None:
    # BERT-large MLM (tied decoder) and torchvision's VGG19 with 1000 classes
    assert sum(math.prod(s) for s in bert_large_shapes()) == 335_174_458
    assert sum(math.prod(s) for s in vgg19_shapes()) == 143_667_240
    assert (4096, 25088) in vgg19_shapes() and (512, 512, 3, 3) in vgg19_shapes()


def test_published_data_lists_26_valid_configurations() -> None:
    data = load()
    assert len(data["configs"]) == 26
    for c in data["configs"]:
        get_codec(c["codec"])  # every spec is a real codec configuration
        assert c["task"] in data["tasks"] and c["measured"] > 0 and c["ref"].startswith("Table")
    # the numbers: 23 of 26 gain over fp16
    gains = sum(c["measured"] > data["tasks"][c["task"]]["baselines"]["fp32+fp16"]
                for c in data["configs"])
    assert gains == 23


@pytest.fixture(scope="module")
def report():  # type: ignore[no-untyped-def]
    return reproduce(DATA)


def test_calibration_reproduces_the_baselines_it_was_fitted_to(report) -> None:  # type: ignore[no-untyped-def]
    assert all(abs(e) < 0.05 for e in report.baseline_errors.values())
    assert 0.3 < report.platform.inter_bandwidth_scale <= 1.0
    assert all(0 < c < 1.0 / 3.17 for c in report.compute_s.values())


def test_published_tables_state_of_the_model(report) -> None:  # type: ignore[no-untyped-def]
    """Where the model stands on Han et al. (goal: median 15 %, 22 of 26 verdicts; not met,
    see docs/performance-model.md). Guards against regressions from this state."""
    assert len(report.rows) == 26
    assert report.verdicts >= 17
    assert report.median_abs_error <= 0.50
    # the ordering the paper reports within a family is kept: fewer bits, faster
    rel = {(r.task, r.label): r.predicted_rel for r in report.rows}
    for task in ("BERT", "VGG19"):
        assert rel[(task, "TopK b=0.5")] > rel[(task, "TopK b=8")]
        assert rel[(task, "TopKC b=0.5")] > rel[(task, "TopKC b=8")]
        assert rel[(task, "PowerSGD r=1")] > rel[(task, "PowerSGD r=64")]
    for r in report.rows:
        assert r.low_rel <= r.predicted_rel <= r.high_rel


def test_builtin_gpu_profile_is_the_measured_h100_one() -> None:
    table = SpeedTable.builtin("gpu")
    assert "H100" in table.provenance["device"] and table.provenance["torch"]
    thc = table.lookup(get_codec("thc"))
    assert thc.overhead_s > 5e-4  # measured: ~0.7-1.4 ms per call, not 100 us
    with pytest.raises(ValueError, match="no built-in codec profile"):
        SpeedTable.builtin("tpu")


def test_powersgd_is_charged_its_matmuls_not_a_per_element_rate() -> None:
    speed = CodecSpeed(1e-4, 1e12, 1e12, additive=True, flops=1e13)
    cfg = ExchangeConfig(cluster=Cluster.build(nodes=2, gpus_per_node=1, inter_bw="100gbit"),
                         speeds=SpeedTable({"powersgd": speed, "*": speed,
                                            "identity": CodecSpeed(1e-6, 1e12, 1e12)}, "test"))

    def codec_s(rank: int, shape: tuple[int, int]) -> float:
        segs = exchange_segments(f"powersgd:rank={rank}", [shape], cfg)
        return sum(s.seconds for s in segs if s.kind == "codec")

    n, m = 8192, 8192
    # encode 4 n m r + decode 2 n m r flops at 1e13 flop/s, plus two passes and c0
    for r in (4, 64):
        expected = 2e-4 + 2 * n * m / 1e12 + 6 * n * m * r / 1e13
        assert codec_s(r, (n, m)) == pytest.approx(expected, rel=1e-6)
    # a vector PowerSGD sends exactly costs the identity's copy, not a factorisation
    assert codec_s(4, (8192,)) == pytest.approx(2e-6)  # max(c0, n / eps) of a copy


def test_topk_gathered_from_many_ranks_is_a_scatter_add_of_k_entries() -> None:
    dense = CodecSpeed(1e-5, 1e10, 1e10, additive=True)
    sparse = CodecSpeed(1e-5, 1e10, 1e10, additive=True, accumulate_eps=1e9, accumulate_s=1e-5)
    cl = Cluster.build(nodes=32, gpus_per_node=1, inter_bw="100gbit")

    def decode_s(speed: CodecSpeed) -> float:
        cfg = ExchangeConfig(cluster=cl, speeds=SpeedTable({"*": speed}, "t"))
        segs = exchange_segments("topk:ratio=0.01", [(1 << 24,)], cfg)
        return sum(s.seconds for s in segs if s.label == "decode")

    d = 1 << 24
    assert decode_s(dense) == pytest.approx(32 * (1e-5 + d / 1e10))
    k = math.ceil(0.01 * d)
    assert decode_s(sparse) == pytest.approx(1e-5 + d / 1e10 + 32 * (1e-5 + k / 1e9))


def test_profile_file_round_trip_and_bad_entries(tmp_path) -> None:  # type: ignore[no-untyped-def]
    speed = CodecSpeed(2e-5, 3e9, 4e9, additive=True, flops=5e12, accumulate_eps=1e9,
                       accumulate_s=1e-5, decode_overhead_s=3e-5, spread=0.1)
    table = SpeedTable({"powersgd": speed}, "test", {"device": "cpu (test)", "torch": "x"})
    path = tmp_path / "p.json"
    table.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "commpress-device-profile/1"
    loaded = SpeedTable.load(path)
    assert loaded.lookup(get_codec("powersgd")) == speed
    assert loaded.provenance["device"] == "cpu (test)"
    data["speeds"]["powersgd"]["encode_eps"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="encode_eps"):
        SpeedTable.load(path)
