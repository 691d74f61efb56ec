"""Han et al.'s published tables through the model, and the measured device profiles."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from commpress.codecs import get_codec
from commpress.perfmodel.codec_costs import (
    CodecSpeed,
    ExchangeConfig,
    RotationCost,
    SpeedTable,
    code_rotation,
    codec_orth_flops,
    exchange_segments,
)
from commpress.perfmodel.collectives import Cluster
from commpress.perfmodel.model import ddp_buckets
from commpress.perfmodel.published import (
    A100_HBM_BYTES_PER_S,
    DATA,
    KERNEL_LAUNCH_S,
    PAPER_BASE_PROFILE,
    FusedKernels,
    bert_large_shapes,
    exposed_residuals,
    exposed_table,
    load,
    paper_speeds,
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
    # Table 1's TF32 columns are not fitted: TF32+FP32 predicted from TF32+FP16 (compute
    # solved anew, the calibrated network and dense-baseline term) within 3 %
    assert set(report.heldout_errors) == {"BERT", "VGG19"}
    assert all(abs(e) < 0.03 for e in report.heldout_errors.values())
    assert "held out (not fitted)" in report.table()


def test_the_baselines_carry_a_cost_the_compressed_runs_do_not_pay() -> None:
    """The paper's own numbers, no model: with the same compute in every run, communication
    time linear in its bytes and overlap that never makes a step slower than compute plus
    communication, the FP16 step is at least ``C + X`` where ``X = fp32 - fp16`` is the
    time of the FP16 bytes, so every run takes at least ``C >= 2 fp16 - fp32``. The fastest
    compressed runs are faster than that (docs/performance-model.md): the dense baselines
    hold at least 32 ms (VGG19) to 42 ms (BERT) that no byte-linear cost explains."""
    data = load(DATA)
    for name, task in data["tasks"].items():
        fp16 = 1.0 / task["baselines"]["fp32+fp16"]
        fp32 = 1.0 / task["baselines"]["fp32+fp32"]
        fastest = min(1.0 / c["measured"] for c in data["configs"] if c["task"] == name)
        assert 2 * fp16 - fp32 - fastest > 0.03, name


def test_the_paper_kernels_pay_their_traffic_in_full_and_the_dense_extra_is_per_parameter(
) -> None:
    """Serial accounting of every published step (measured step minus the model's network
    and codec time, at the bandwidth calibrated on the baselines): what the paper's rows say
    about the dense extra (docs/performance-model.md).

    * TopKC's and THC's runs (the paper's fused kernels, codec a few ms) leave the same rest
      (within 10 %) whether they send 2 or 86 ms of traffic: their communication costs its
      wire time, neither hidden behind backward (slope -1) nor slowed by interference (slope
      1 - eta, 1.43 as calibrated);
    * the FP16 and FP32 baselines leave the same rest as each other (within 5 %): their extra
      does not grow with their bytes, so Table 1 measures only compute + extra per task;
    * that extra is 0.15-0.30 ns per parameter in both tasks (63-71 ms BERT, 32-33 ms VGG19)."""
    rows = exposed_residuals()
    for task in ("BERT", "VGG19"):
        fused = [r for r in rows if r.task == task and r.label.startswith(("TopKC", "THC"))]
        assert len(fused) == 6
        rest = statistics.median(r.rest_s for r in fused)
        assert all(abs(r.rest_s / rest - 1) < 0.10 for r in fused), task
        mc = statistics.fmean(r.comm_s for r in fused)
        mr = statistics.fmean(r.rest_s for r in fused)
        slope = (sum((r.comm_s - mc) * (r.rest_s - mr) for r in fused)
                 / sum((r.comm_s - mc) ** 2 for r in fused))
        assert abs(slope) < 0.3, (task, slope)
        dense = [r for r in rows if r.task == task and r.dense]
        assert len(dense) == 2
        assert abs(dense[0].rest_s / dense[1].rest_s - 1) < 0.05, task
        extra = statistics.fmean(r.rest_s for r in dense) - rest
        assert 0.15e-9 < extra / dense[0].parameters < 0.30e-9, (task, extra)


def test_the_documented_serial_accounting_is_what_the_code_prints() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "performance-model.md").read_text()
    marker = "print(exposed_table(exposed_residuals()))\"\n"
    assert marker in doc
    shown = doc.split(marker, 1)[1].split("```", 1)[0].rstrip("\n")
    assert shown == exposed_table(exposed_residuals())


def test_published_tables_within_the_verdict_goal(report) -> None:  # type: ignore[no-untyped-def]
    """Issue 15's goals: the same verdict (gain or loss vs fp16) in at least 22 of 26
    configurations; the median |error| is guarded at its present level (the 15 % goal is
    the strict xfail below)."""
    assert len(report.rows) == 26
    assert report.verdicts >= 22
    assert report.median_abs_error <= 0.20
    # the ordering the paper reports within a family is kept: fewer bits, faster
    rel = {(r.task, r.label): r.predicted_rel for r in report.rows}
    for task in ("BERT", "VGG19"):
        assert rel[(task, "TopK b=0.5")] > rel[(task, "TopK b=8")]
        assert rel[(task, "TopKC b=0.5")] > rel[(task, "TopKC b=8")]
        assert rel[(task, "PowerSGD r=1")] > rel[(task, "PowerSGD r=64")]
    for r in report.rows:
        assert r.low_rel <= r.predicted_rel <= r.high_rel


@pytest.mark.xfail(strict=True, reason="median |error| goal (15 %) not met: the dense baselines "
                   "carry a cost the model cannot place; Table 1 fixes only compute + that "
                   "cost per task, not the split (docs/performance-model.md)")
def test_published_tables_within_the_error_goal(report) -> None:  # type: ignore[no-untyped-def]
    assert report.median_abs_error <= 0.15


def test_paper_kernels_are_a_roofline_and_the_rest_the_measured_profile() -> None:
    table = paper_speeds()
    h100 = SpeedTable.from_dict(json.loads(PAPER_BASE_PROFILE.read_text()))
    assert "2026-11-25" in table.source and "2026-11-25" in h100.source
    topkc = table.lookup(get_codec("topkc"))
    assert topkc.encode_eps == pytest.approx(A100_HBM_BYTES_PER_S / 16.0)
    assert topkc.decode_eps == pytest.approx(A100_HBM_BYTES_PER_S / 12.0)
    assert topkc.overhead_s == pytest.approx(4 * KERNEL_LAUNCH_S)
    # BERT-large's 335 M coordinates: a few ms per step, not the Python codec's ~60-100 ms
    n = sum(math.prod(s) for s in bert_large_shapes())
    for codec in ("topkc", "thc"):
        speed = table.lookup(get_codec(codec))
        assert 1e-3 < speed.encode_time(n) + speed.decode_time(n) < 1e-2
    for codec in ("topk", "powersgd", "fp16"):
        assert table.lookup(get_codec(codec)) == h100.lookup(get_codec(codec))
    with pytest.raises(ValueError, match="bytes per coordinate"):
        FusedKernels(encode_kernels=1, decode_kernels=1, encode_bytes=0.0, decode_bytes=1.0)


def test_batched_powersgd_pays_one_fixed_cost_and_one_collective_per_round() -> None:
    """PyTorch's PowerSGD hook: each tensor encoded (its passes and products), one fixed
    cost per bucket, and round k of every tensor in one all-reduce."""
    speed = CodecSpeed(1e-3, 1e12, 1e12, additive=True, flops=1e13)
    ident = CodecSpeed(1e-6, 1e12, 1e12, additive=True)
    cl = Cluster.build(nodes=2, gpus_per_node=1, inter_bw="100gbit")
    cfg = ExchangeConfig(cluster=cl, speeds=SpeedTable(
        {"powersgd": speed, "identity": ident, "*": speed}, "test"))
    shapes = [(1024, 1024), (1024,), (4096, 1024), (512, 2048)]
    per = exchange_segments("powersgd:rank=4", shapes, cfg)
    bat = exchange_segments("powersgd:rank=4", shapes, cfg, granularity="batched")
    nets = [s for s in bat if s.resource == "net"]
    assert len(nets) == 2  # P (with the vector) and Q
    assert len([s for s in per if s.resource == "net"]) == 7  # 2 per matrix, 1 the vector
    assert sum(s.nbytes for s in nets) == pytest.approx(
        sum(s.nbytes for s in per if s.resource == "net"))
    codec_per = sum(s.seconds for s in per if s.kind == "codec")
    codec_bat = sum(s.seconds for s in bat if s.kind == "codec")
    # three matrices' encode and decode fixed costs (1 ms each) and the vector's copy become
    # one encode and one decode fixed cost
    assert codec_per - codec_bat == pytest.approx(4e-3 + 2e-6, rel=1e-3)
    with pytest.raises(ValueError, match="granularity"):
        exchange_segments("powersgd:rank=4", shapes, cfg, granularity="layer")
    with pytest.raises(ValueError, match="all-reduce rounds"):
        exchange_segments("topk:ratio=0.01", shapes, cfg, granularity="batched")


def test_speed_tables_scale_every_fixed_cost_and_follow_the_thread_count() -> None:
    speed = CodecSpeed(1e-4, 1e9, 2e9, additive=True, flops=1e11, accumulate_eps=1e8,
                       accumulate_s=1e-5, decode_overhead_s=2e-5, spread=0.5)
    table = SpeedTable({"*": speed}, "t", {"threads": 16})
    slow = table.scaled(4.0).speeds["*"]
    assert (slow.overhead_s, slow.decode_overhead_s, slow.accumulate_s) == pytest.approx(
        (4e-4, 8e-5, 4e-5))
    assert slow.decode_time(1e6) == pytest.approx(4 * speed.decode_time(1e6))
    one = table.for_threads(1).speeds["*"]
    assert one.encode_eps == pytest.approx(1e9 / 16) and one.flops == pytest.approx(1e11 / 16)
    assert one.overhead_s == speed.overhead_s and one.decode_overhead_s == 2e-5
    assert table.for_threads(16) is table and table.for_threads(32) is table
    assert SpeedTable({"*": speed}, "no threads").for_threads(1).speeds["*"] == speed
    with pytest.raises(ValueError, match="threads"):
        table.for_threads(0)
    slow_end, fast_end = table.at_spread(1).speeds["*"], table.at_spread(-1).speeds["*"]
    assert slow_end.encode_time(1e6) == pytest.approx(1.5 * speed.encode_time(1e6))
    assert fast_end.encode_time(1e6) == pytest.approx(speed.encode_time(1e6) / 1.5)


def test_builtin_gpu_profile_is_the_measured_h100_one() -> None:
    """The built-in GPU profile is the committed H100 measurement (docs/results), entry for
    entry, and carries its provenance; THC's fixed cost is its Triton kernel's (about 0.1
    ms; the torch path's was 0.7-1.4 ms)."""
    table = SpeedTable.builtin("gpu")
    assert "H100" in table.provenance["device"] and table.provenance["torch"]
    raw = json.loads((Path(__file__).resolve().parent.parent / "docs" / "results"
                      / "profile-h100.json").read_text())
    assert raw["provenance"]["date"] == table.provenance["date"]
    for name, entry in raw["speeds"].items():
        assert table.speeds[name] == CodecSpeed.from_dict(entry), name
    thc = table.lookup(get_codec("thc"))
    assert 5e-5 < thc.overhead_s < 5e-4
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


def test_powersgd_orthogonalisation_is_quadratic_in_the_rank() -> None:
    """Orthonormalising the ``n x r`` factor costs ``2 n r^2`` flops per power iteration, at
    its own (column-by-column, far lower) rate: with free products and passes the encode
    grows 16-fold from rank 16 to 64 where the products grow 4-fold."""
    assert codec_orth_flops(get_codec("powersgd:rank=8"), (4096, 1024)) == 2 * 4096 * 64
    assert codec_orth_flops(get_codec("powersgd:rank=8,power_iterations=2"),
                            (4096, 1024)) == 2 * 2 * 4096 * 64
    assert codec_orth_flops(get_codec("powersgd:rank=8"), (64, 3, 3, 3)) == 2 * 64 * 64
    assert codec_orth_flops(get_codec("powersgd:rank=8"), (4096,)) == 0.0  # sent exactly
    assert codec_orth_flops(get_codec("topk"), (4096, 1024)) == 0.0
    orth_rate = 2e11
    speed = CodecSpeed(0.0, math.inf, math.inf, additive=True, orth_flops=orth_rate)
    cfg = ExchangeConfig(cluster=Cluster.build(nodes=2, gpus_per_node=1, inter_bw="100gbit"),
                         speeds=SpeedTable({"powersgd": speed, "*": speed}, "test"))

    def encode_s(rank: int, granularity: str = "parameter") -> float:
        segs = exchange_segments(f"powersgd:rank={rank}", [(8192, 4096)], cfg,
                                 granularity=granularity)
        return sum(s.seconds for s in segs if s.label == "encode")

    for r in (16, 64):
        assert encode_s(r) == pytest.approx(2 * 8192 * r * r / orth_rate, rel=1e-9)
        assert encode_s(r, "batched") == pytest.approx(encode_s(r), rel=1e-9)
    assert encode_s(64) / encode_s(16) == pytest.approx(16.0)
    # a profile without the term (an older one) charges nothing apart
    assert CodecSpeed(0.0, 1e9, 1e9, additive=True).encode_time(1e6, 0.0, 1e12) == (
        pytest.approx(1e-3))
    with pytest.raises(ValueError, match="orth_flops"):
        CodecSpeed(0.0, 1e9, 1e9, orth_flops=0.0)


def test_rotation_passes_of_a_block_larger_than_the_fused_kernel() -> None:
    # commpress's torch fallback: every butterfly stage one pass, once the block is too large
    code = RotationCost(fused_log2=12, radix_log2=1, restart=True, pass_eps=1e9)
    assert [code.passes(1 << k) for k in (1, 12, 13, 23)] == [0, 0, 13, 23]
    # a kernel whose shared-memory block is the radix: the fused pass does 12 stages
    paper = RotationCost(fused_log2=12, radix_log2=12, restart=False, pass_eps=1e9)
    assert [paper.passes(1 << k) for k in (12, 13, 23, 24, 25, 27)] == [0, 1, 1, 1, 2, 2]
    assert paper.time(1 << 25, 1 << 25) == pytest.approx(2 * (1 << 25) / 1e9)
    with pytest.raises(ValueError, match="radix_log2"):
        RotationCost(fused_log2=12, radix_log2=0, restart=True, pass_eps=1e9)


def test_thc_full_rotation_is_charged_as_the_code_runs_it() -> None:
    """commpress's THC rotates blocks of up to 2^12 in its Triton kernel (what the GPU profile
    measured); ``block_log2="full"`` runs all log2(B) butterfly stages of the torch fallback,
    each 1.5 copies of the padded tensor at the profile's measured copy rate, in the encode
    and again in the decode's inverse."""
    table = SpeedTable.builtin("gpu")
    cfg = ExchangeConfig(cluster=Cluster.build(nodes=2, gpus_per_node=1, inter_bw="100gbit"),
                         speeds=table)
    copy_eps = table.lookup(get_codec("identity")).decode_eps
    numel = 3_000_000  # padded to 2^22 by the full rotation
    shape = (numel,)

    def codec_s(spec: str) -> dict[str, float]:
        return {s.label: s.seconds for s in exchange_segments(spec, [shape], cfg)
                if s.kind == "codec"}

    speed = table.lookup(get_codec("thc"))
    partial = codec_s("thc")
    assert partial["encode"] == pytest.approx(speed.encode_time(numel))  # nothing extra
    full = codec_s('thc:block_log2="full"')
    stages = 22 * (1 << 22) * 1.5 / copy_eps
    assert full["encode"] == pytest.approx(speed.encode_time(numel) + stages)
    assert full["decode"] == pytest.approx(speed.decode_time(numel) + stages)
    # a CPU profile's numba kernel holds blocks of 2^15: block_log2=15 costs nothing extra
    cpu = ExchangeConfig(cluster=cfg.cluster, speeds=SpeedTable.builtin("cpu"))
    cpu_speed = cpu.speeds.lookup(get_codec("thc"))
    enc = [s.seconds for s in exchange_segments("thc:block_log2=15", [shape], cpu)
           if s.label == "encode"]
    assert enc == [pytest.approx(cpu_speed.encode_time(numel))]


@pytest.mark.parametrize("granularity", ["parameter", "bucket", "batched", "hook"])
def test_thc_full_rotation_is_charged_at_every_granularity(granularity: str) -> None:
    """Every way a bucket can be modelled pays the full rotation's butterfly stages, in the
    encode and again in the decode, on each tensor (the batched and hook granularities
    once missed it)."""
    table = SpeedTable.builtin("gpu")
    cfg = ExchangeConfig(cluster=Cluster.build(nodes=2, gpus_per_node=1, inter_bw="100gbit"),
                         speeds=table)
    copy_eps = table.lookup(get_codec("identity")).decode_eps
    shapes = [(3_000_000,), (1024, 1024)]  # padded to 2^22 and 2^20

    def codec_s(spec: str) -> float:
        return sum(s.seconds for s in exchange_segments(spec, shapes, cfg,
                                                        granularity=granularity)
                   if s.kind == "codec")

    # each tensor on its own, or (bucket) the bucket's 4,048,576 values as one, padded to 2^22
    padded = [(22, 1 << 22)] if granularity == "bucket" else [(22, 1 << 22), (20, 1 << 20)]
    stages = sum(log2 * n for log2, n in padded) * 1.5 / copy_eps
    extra = codec_s('thc:block_log2="full"') - codec_s("thc")
    assert extra == pytest.approx(2 * stages, rel=0.02), (granularity, extra, stages)


def test_paper_full_rotation_costs_what_table_6_bounds() -> None:
    """The paper's kernels: partial rotation inside the fused pass; a full rotation of a
    bucket padded to 2^L runs the other L - 12 stages in passes of 8 B per coordinate with
    the 2^12 shared-memory block as radix. Over BERT-large's and VGG19's buckets that is a
    few ms per step (encode and decode), the size of Table 6's full-minus-partial steps
    (BERT 3.4 and 5.0 ms, VGG19 2.8 and 3.7 ms at b = 4 and 2; the model is not fitted to
    them), within a factor of 2; the torch fallback's one pass per stage is >= 10 passes
    per bucket."""
    speeds = paper_speeds()
    thc = speeds.lookup(get_codec("thc"))
    assert thc.rotation is not None and thc.rotation.passes(1 << 23) == 1
    cfg = ExchangeConfig(cluster=Cluster.build(nodes=2, gpus_per_node=2, inter_bw="100gbit"),
                         speeds=speeds)
    for shapes, (low, high) in ((bert_large_shapes(), (3.4e-3, 5.0e-3)),
                                (vgg19_shapes(), (2.8e-3, 3.7e-3))):
        extra = 0.0
        for bucket in ddp_buckets(shapes):
            for spec, sign in (('thc:bits=4,saturate=true,block_log2="full"', 1),
                               ("thc:bits=4,saturate=true", -1)):
                segs = exchange_segments(spec, bucket, cfg, granularity="bucket")
                extra += sign * sum(s.seconds for s in segs if s.kind == "codec")
        assert low / 2 < extra < 2 * high
        fallback = sum(code_rotation(SpeedTable.builtin("gpu")).passes(_pow2(sum(
            math.prod(s) for s in b))) for b in ddp_buckets(shapes))
        assert fallback >= 10 * len(ddp_buckets(shapes))


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


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
                       accumulate_s=1e-5, decode_overhead_s=3e-5, spread=0.1, orth_flops=2e11,
                       rotation=RotationCost(fused_log2=12, radix_log2=12, restart=False,
                                             pass_eps=2e11))
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
