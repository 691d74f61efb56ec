"""The performance model of commpress's own DDP hook: queue-mode timeline, the hook's dense
fallback plan, protocol calibration, and the platform constants added for validation."""

from __future__ import annotations

import math

import pytest

from commpress.codecs.registry import get_codec
from commpress.errors import CommpressError
from commpress.perfmodel import collectives as coll
from commpress.perfmodel.calibration import ALL_FITTABLE, FITTABLE, Measurement, fit_platform
from commpress.perfmodel.codec_costs import (
    CodecSpeed,
    ExchangeConfig,
    SpeedTable,
    calibrate_protocol_speeds,
    exchange_segments,
    exchange_wire_bytes,
    wire_profile,
)
from commpress.perfmodel.collectives import Cluster
from commpress.perfmodel.model import (
    HookPlan,
    Platform,
    Prediction,
    Setup,
    Workload,
    predict,
)
from commpress.perfmodel.timeline import Segment, simulate_step


def _job(enc: float, net: float, dec: float) -> list[Segment]:
    return [Segment("gpu", enc, "codec", "enc"), Segment("net", net, "comm", "ar"),
            Segment("gpu", dec, "codec", "dec")]


def test_queue_mode_timeline_by_hand() -> None:
    """Two buckets (forward 1, backward 2 each); bucket 0 holds jobs A, B, C and bucket 1 job
    D; every job is encode 0.5, exchange 1, decode 0.5 (GPU, net, GPU); depth 2.

    b0 [1,3]. A.enc [3,3.5] (released with b1 at 3: codec first). A.net [3.5,4.5].
    B.enc is released when A's exchange starts (3.5), later than b1 (3): b1 [3.5,5.5], then
    B.enc [5.5,6] (released 3.5) before A.dec (released 4.5) [6,6.5]. B.net [6,7].
    C.enc waits for A to end (depth 2): [6.5,7]. B.dec [7,7.5]; C.net [7,8] (after B.net);
    C.dec [8,8.5]. D (next bucket) waits for A, B and C to end: D.enc [8.5,9], D.net
    [9,10], D.dec [10,10.5]. Step 10.5. Without queue mode D.enc is released once C's
    exchange starts (7) and runs at [7.5,8] on the GPU, so the step ends 1 s earlier.
    """
    tl = simulate_step(forward_s=1.0, backward_s=[2.0, 2.0],
                       jobs=[_job(0.5, 1.0, 0.5)] * 4, bucket_of=[0, 0, 0, 1], queue_depth=2)
    ev = {e.name.split(":")[0]: (e.start, e.end) for e in tl.events}
    expected = {
        "backward[1]": (3.5, 5.5),
        "bucket[0].job[0].0": (3.0, 3.5), "bucket[0].job[0].1": (3.5, 4.5),
        "bucket[0].job[0].2": (6.0, 6.5),
        "bucket[0].job[1].0": (5.5, 6.0), "bucket[0].job[1].1": (6.0, 7.0),
        "bucket[0].job[1].2": (7.0, 7.5),
        "bucket[0].job[2].0": (6.5, 7.0), "bucket[0].job[2].1": (7.0, 8.0),
        "bucket[0].job[2].2": (8.0, 8.5),
        "bucket[1].job[3].0": (8.5, 9.0), "bucket[1].job[3].1": (9.0, 10.0),
        "bucket[1].job[3].2": (10.0, 10.5),
    }
    for name, span in expected.items():
        assert ev[name] == span, name
    assert tl.total == 10.5
    free = simulate_step(forward_s=1.0, backward_s=[2.0, 2.0],
                         jobs=[_job(0.5, 1.0, 0.5)] * 4, bucket_of=[0, 0, 0, 1])
    assert free.total == 9.5


def test_queue_mode_depth_one_is_sequential() -> None:
    jobs = [_job(0.5, 1.0, 0.5)] * 3
    tl = simulate_step(forward_s=0.0, backward_s=[1.0], jobs=jobs, bucket_of=[0, 0, 0],
                       queue_depth=1)
    # backward 1, then three jobs of 2 s each back to back.
    assert tl.total == pytest.approx(7.0)


def test_queue_mode_rejects_bad_input() -> None:
    with pytest.raises(CommpressError, match="bucket_of"):
        simulate_step(forward_s=0, backward_s=[1.0], jobs=[[]], bucket_of=[0, 0])
    with pytest.raises(CommpressError, match="non-decreasing"):
        simulate_step(forward_s=0, backward_s=[1.0, 1.0], jobs=[[], []], bucket_of=[1, 0])
    with pytest.raises(CommpressError, match="queue_depth"):
        simulate_step(forward_s=0, backward_s=[1.0], jobs=[[]], queue_depth=0)


SHAPES = [(256, 128), (128,), (384, 128), (384,), (512, 128), (128, 512), (64, 128)]


def test_hook_plan_sends_small_and_incompressible_tensors_as_fp16() -> None:
    plan = HookPlan(min_numel=4096, min_compression_rate=2.0)
    psgd = get_codec("powersgd:rank=4")
    jobs = plan.bucket_jobs(psgd, SHAPES)
    # First one flat fp16 group with the two vectors, then one job per matrix in order.
    assert jobs[0][0].codec_id == "fp16" and jobs[0][1] == [(128,), (384,)]
    assert [c.codec_id for c, _ in jobs[1:]] == ["powersgd"] * 5
    assert [s for _, (s,) in jobs[1:]] == [(256, 128), (384, 128), (512, 128), (128, 512),
                                          (64, 128)]
    # fp16 shrinks by 2: with min_compression_rate 2.5 even fp16's own matrices... fp16 is a
    # cast, never replaced; a codec that compresses < 2.5x is.
    strict = HookPlan(min_numel=0, min_compression_rate=1e9)
    assert all(c.codec_id == "fp16" for c, _ in strict.bucket_jobs(psgd, SHAPES))
    assert len(strict.bucket_jobs(psgd, SHAPES)) == 1
    with pytest.raises(CommpressError, match="fallback_codec"):
        HookPlan(fallback_codec="sign")
    with pytest.raises(CommpressError, match="depth"):
        HookPlan(depth=0)


def test_hooked_prediction_counts_fp16_fallback_bytes() -> None:
    w = Workload.from_shapes(SHAPES, compute_s=0.1)
    cl = Cluster.build(nodes=2, gpus_per_node=1, inter_bw="100mbit")
    plan = HookPlan(min_numel=4096, min_compression_rate=2.0)
    hooked = predict(w, cl, "powersgd:rank=4", hook=plan)
    plain = predict(w, cl, "powersgd:rank=4")
    # The two vectors (512 elements) go as fp16: 1024 bytes more than PowerSGD alone sends
    # for them.
    vec_psgd = predict(Workload.from_shapes([(128,), (384,)], compute_s=0.1), cl,
                       "powersgd:rank=4").wire_bytes
    assert hooked.wire_bytes == pytest.approx(plain.wire_bytes - vec_psgd + 1024)
    # fp16 through the hook is still one flat exchange per bucket: same bytes.
    assert predict(w, cl, "fp16", hook=plan).wire_bytes == pytest.approx(
        predict(w, cl, "fp16").wire_bytes)


def test_message_latency_and_compute_scale() -> None:
    w = Workload.from_shapes(SHAPES, compute_s=0.1)
    cl = Cluster.build(nodes=4, gpus_per_node=1, inter_bw="10gbit")
    base = predict(w, cl, "fp16", platform=Platform())
    slow = predict(w, cl, "fp16", platform=Platform(message_latency_s=1e-3))
    # One flat bucket (everything < 1 MiB): one ring all-reduce of 2 (n-1) = 6 messages,
    # exposed after backward.
    assert len(w.buckets) == 1
    assert slow.total - base.total == pytest.approx(6e-3, rel=1e-6)
    scaled = predict(w, cl, "fp16", platform=Platform(compute_time_scale=2.0))
    assert scaled.total - base.total == pytest.approx(0.1, rel=1e-6)
    with pytest.raises(CommpressError, match="message_latency_s"):
        Platform(message_latency_s=-1.0)
    with pytest.raises(CommpressError, match="compute_time_scale"):
        Platform(compute_time_scale=0.0)


def test_setup_carries_its_own_speed_table() -> None:
    w = Workload.from_shapes(SHAPES, compute_s=0.1)
    cl = Cluster.build(nodes=2, gpus_per_node=1, inter_bw="1gbit")
    fast = SpeedTable({"*": CodecSpeed(1e-6, 1e12, 1e12)}, "fast")
    slow = fast.scaled(1000.0)
    assert slow.speeds["*"].overhead_s == pytest.approx(1e-3)
    assert slow.speeds["*"].encode_eps == pytest.approx(1e9)
    s = Setup(w, cl, "sign", speeds=slow)
    assert s.predict(speeds=fast).total == pytest.approx(s.predict().total)
    assert s.predict().total > Setup(w, cl, "sign").predict(speeds=fast).total
    with pytest.raises(CommpressError, match="scale factor"):
        fast.scaled(0.0)


def test_extended_constants_are_fittable_but_not_by_default() -> None:
    assert set(FITTABLE) < set(ALL_FITTABLE)
    assert {"message_latency_s", "compute_time_scale"} <= set(ALL_FITTABLE) - set(FITTABLE)
    w = Workload.from_shapes(SHAPES, compute_s=0.05)
    truth = Platform(message_latency_s=5e-4, compute_time_scale=1.3)
    ms = []
    for n in (2, 3, 4):
        for bw in ("100mbit", "1gbit"):
            s = Setup(w, Cluster.build(nodes=n, gpus_per_node=1, inter_bw=bw), "fp16",
                      label=f"{n} {bw}")
            ms.append(Measurement(s, s.predict(truth).total))
    fit = fit_platform(ms, fit=["message_latency_s", "compute_time_scale"],
                       start=Platform(message_latency_s=1e-4), max_iter=400)
    # Noise-free data from the model itself: the truth is the exact minimum.
    assert fit.platform.message_latency_s == pytest.approx(5e-4, rel=0.02)
    assert fit.platform.compute_time_scale == pytest.approx(1.3, rel=0.02)


def test_protocol_calibration_counts_every_gathered_decode() -> None:
    table = calibrate_protocol_speeds(["fp16", "sign", "powersgd:rank=2"], world_size=4,
                                      matrix_shapes=((32, 32), (64, 64)),
                                      flat_sizes=(1024, 4096), repeats=2)
    assert set(table.speeds) == {"fp16", "sign", "powersgd:rank=2"}
    for v in table.speeds.values():
        assert v.overhead_s > 0 and math.isfinite(v.encode_eps) and v.encode_eps > 0
    # PowerSGD's work is split in halves between encode and decode.
    p = table.speeds["powersgd:rank=2"]
    assert p.encode_eps == pytest.approx(p.decode_eps)
    assert "world size 4" in table.source


# ------------------------------------------------------------------ strategies in the hook
def _cfg(cl: Cluster, strategy: str, **kw: object) -> ExchangeConfig:
    return ExchangeConfig(cluster=cl, strategy=strategy, **kw)  # type: ignore[arg-type]


def test_ring_segments_by_hand() -> None:
    """4 ranks, a 4000-element fp32 vector with identity: chunks of 1000 elements (4000 bytes).
    The hook's software ring makes 2 (n-1) = 6 point-to-point exchanges, each paying the link
    (alpha + bytes / rate) and, but for the first, the per-call overhead the collective
    already pays once: 6 link times + 6 overheads. netzip (payload size varies) sends a size
    header first at every hop: 6 more latencies. Wire bytes: 6 chunk payloads per rank."""
    cl = Cluster.build(nodes=4, gpus_per_node=1, inter_bw="100mbit", inter_latency="1ms")
    cfg = _cfg(cl, "ring", collective_overhead_s=2e-3)
    segs = exchange_segments("identity", [(4000,)], cfg)
    ring = [s for s in segs if s.label == "ring"]
    assert len(ring) == 1
    hop = cl.bottleneck.time(4000)
    assert ring[0].seconds == pytest.approx(6 * hop + 6 * 2e-3, rel=1e-12)
    netzip = [s for s in exchange_segments("netzip", [(4000,)], cfg) if s.label == "ring"]
    q = wire_profile(get_codec("netzip"), (1000,), 1).nbytes
    assert netzip[0].seconds == pytest.approx(
        6 * cl.bottleneck.time(q) + 6 * 2e-3 + 6 * cl.bottleneck.latency, rel=1e-12)
    assert exchange_wire_bytes("identity", (4000,), cl, "ring") == 6 * 4000
    assert exchange_wire_bytes("identity", (4000,), cl, "auto") == 16000


def test_hierarchical_shards_matrices_by_rows_and_runs_one_at_a_time() -> None:
    """2 nodes x 2 ranks: PowerSGD's inter-node exchange is of a (64/2) x 32 shard (what
    hierarchical_task hands the codec), both local ranks' shards sharing the node's link; the
    intra-node reduce-scatter and all-gather move the uncompressed matrix. Queue depth 1."""
    cl = Cluster.build(nodes=2, gpus_per_node=2, inter_bw="100mbit", intra_bw="10gbit")
    cfg = _cfg(cl, "hierarchical")
    codec = get_codec("powersgd:rank=4")
    segs = exchange_segments(codec, [(64, 32)], cfg)
    inter = [s for s in segs if s.label.startswith("inter allreduce")]
    rounds = wire_profile(codec, (32, 32), 2).rounds
    assert len(inter) == len(rounds) == 2
    for seg, r in zip(inter, rounds, strict=True):
        assert seg.seconds == pytest.approx(coll.allreduce(2 * r.nbytes, 2, cl.inter), rel=1e-12)
    rs = [s for s in segs if s.label == "intra reduce-scatter"]
    assert rs[0].seconds == pytest.approx(coll.ring_reduce_scatter(64 * 32 * 4, 2, cl.intra))
    assert exchange_wire_bytes(codec, (64, 32), cl, "hierarchical") == sum(
        r.nbytes for r in rounds)
    # one exchange at a time: the hook's depth does not matter with hierarchical, it does with
    # auto (two sign tensors in one bucket, encode and exchange of similar length: the second's
    # encode overlaps the first exchange)
    w = Workload.from_shapes([(256, 256), (256, 256)], compute_s=0.01)
    cl = Cluster.build(nodes=2, gpus_per_node=2, inter_bw="1mbit", intra_bw="10gbit")
    assert len(w.buckets) == 1
    slow = SpeedTable({"*": CodecSpeed(0.0, 1e6, 1e6)})
    one, two = HookPlan(depth=1), HookPlan(depth=2)
    for strategy, same in (("hierarchical", True), ("auto", False)):
        a = predict(w, cl, "sign", strategy=strategy, speeds=slow, hook=one).total
        b = predict(w, cl, "sign", strategy=strategy, speeds=slow, hook=two).total
        assert (a == pytest.approx(b, rel=1e-12)) is same, (strategy, a, b)


def test_ring_and_hierarchical_pay_the_feedback_round_trip() -> None:
    """With error feedback the hook's ring and hierarchical exchanges also compute
    decode(encode(x)) of the whole tensor; the codec's own protocol yields it for free. One
    tensor, no compute to overlap: the step grows by exactly one encode plus one decode."""
    w = Workload.from_shapes([(256, 256)], compute_s=0.0)
    cl = Cluster.build(nodes=2, gpus_per_node=2, inter_bw="1gbit")
    speeds = SpeedTable({"*": CodecSpeed(0.0, 1e6, 4e6)})
    n = 256 * 256
    for strategy in ("ring", "hierarchical", "hierarchical-compress-first"):
        on = predict(w, cl, "sign", strategy=strategy, speeds=speeds, hook=HookPlan())
        off = predict(w, cl, "sign", strategy=strategy, speeds=speeds,
                      hook=HookPlan(error_feedback=False))
        assert on.total - off.total == pytest.approx(n / 1e6 + n / 4e6, rel=1e-9), strategy
    on = predict(w, cl, "sign", strategy="allgather", speeds=speeds, hook=HookPlan())
    off = predict(w, cl, "sign", strategy="allgather", speeds=speeds,
                  hook=HookPlan(error_feedback=False))
    assert on.total == off.total
    # fp16 has no feedback by default: no round trip
    a = predict(w, cl, "fp16", strategy="ring", speeds=speeds, hook=HookPlan())
    b = predict(w, cl, "fp16", strategy="ring", speeds=speeds, hook=HookPlan(error_feedback=False))
    assert a.total == b.total


def test_hooked_strategies_refuse_what_the_hook_refuses() -> None:
    w = Workload.from_shapes(SHAPES, compute_s=0.1)
    cl = Cluster.build(nodes=2, gpus_per_node=2, inter_bw="100mbit")
    for codec, strategy, match in (("powersgd", "ring", "several exchange rounds"),
                                   ("topkc", "allgather", "several exchange rounds"),
                                   ("sign", "allreduce", "not summable")):
        with pytest.raises(CommpressError, match=match):
            predict(w, cl, codec, strategy=strategy, hook=HookPlan())
    # what the hook accepts, the model predicts
    for codec, strategy in (("powersgd", "hierarchical"), ("fp16", "ring"),
                            ("sign", "allgather"), ("fp16", "allreduce"),
                            ("netzip", "hierarchical-compress-first")):
        assert predict(w, cl, codec, strategy=strategy, hook=HookPlan()).total > 0
    with pytest.raises(CommpressError, match="error_feedback"):
        HookPlan(error_feedback="yes")  # type: ignore[arg-type]


def test_hook_granularity_batches_where_the_hook_batches_its_rounds() -> None:
    """The DDP hook's default (``batch_rounds=True``) merges round k of a bucket's non-cast
    tensors into one all-reduce: granularity "hook" has "batched"'s collectives there (and
    "parameter"'s fixed codec costs: one codec call per tensor), and is "parameter" where the
    hook cannot merge (all-gathers, strategies that do not run the codec's protocol)."""
    cl = Cluster.build(nodes=2, gpus_per_node=1, inter_bw="100mbit")
    matrices = [s for s in SHAPES if len(s) == 2]

    def split(segs: list[Segment]) -> tuple[list[Segment], float]:
        return ([s for s in segs if s.resource == "net"],
                sum(s.seconds for s in segs if s.kind == "codec"))

    for strategy, codec, merged in (("auto", "powersgd:rank=4", True),
                                    ("allreduce", "powersgd:rank=4", True),
                                    ("ring", "sign", False),
                                    ("auto", "topk:ratio=0.01", False)):
        cfg = ExchangeConfig(cluster=cl, strategy=strategy)
        hook = exchange_segments(codec, matrices, cfg, granularity="hook")
        per = exchange_segments(codec, matrices, cfg, granularity="parameter")
        if not merged:
            assert hook == per, (strategy, codec)
            continue
        net, codec_s = split(hook)
        batched_net, batched_codec_s = split(
            exchange_segments(codec, matrices, cfg, granularity="batched"))
        assert net == batched_net and len(net) == 2
        speed = cfg.speeds.lookup(get_codec(codec))
        # every matrix pays the encode's and the decode's fixed cost, not the bucket once
        fixed = speed.overhead_s + (speed.overhead_s if speed.decode_overhead_s is None
                                    else speed.decode_overhead_s)
        assert codec_s == pytest.approx(batched_codec_s + (len(matrices) - 1) * fixed)
        assert codec_s == pytest.approx(split(per)[1], rel=0.05)
    # the hooked prediction: the fp16 group, then one exchange of every PowerSGD matrix with
    # two all-reduces; batch_rounds=False: two per matrix
    w = Workload.from_shapes(SHAPES, compute_s=0.1)
    on = predict(w, cl, "powersgd:rank=4", hook=HookPlan(min_numel=4096))
    off = predict(w, cl, "powersgd:rank=4", hook=HookPlan(min_numel=4096, batch_rounds=False))

    def collectives(p: Prediction) -> int:
        return len([e for e in p.timeline.events if e.resource == "net" and e.kind == "comm"])

    assert collectives(off) == 1 + 2 * len(matrices)
    assert collectives(on) == 1 + 2
    assert on.wire_bytes == pytest.approx(off.wire_bytes)
    # merged rounds save latencies but give up overlapping one tensor's encode with the
    # previous one's transfer: a gain where latency dominates (2 ms per message)
    slow = Cluster.build(nodes=2, gpus_per_node=1, inter_bw="100mbit", inter_latency="2ms")
    assert predict(w, slow, "powersgd:rank=4", hook=HookPlan(min_numel=4096)).total < \
        predict(w, slow, "powersgd:rank=4",
                hook=HookPlan(min_numel=4096, batch_rounds=False)).total
    with pytest.raises(CommpressError, match="batch_rounds"):
        HookPlan(batch_rounds=1)  # type: ignore[arg-type]


def test_hook_granularity_charges_each_tensor_what_parameter_charges() -> None:
    """The hook's lockstep exchange (:mod:`commpress.collectives.batched`) still makes one
    codec call per tensor, each as costly as when that tensor is reduced on its own: PowerSGD
    sends a vector exactly (one uncompressed all-reduce round, the identity's speed), so a
    bucket of matrices and biases costs the same codec time in "hook" as in "parameter" (only
    the collectives differ), not the PowerSGD fixed cost for every bias."""
    cl = Cluster.build(nodes=2, gpus_per_node=1, inter_bw="100mbit")
    psgd = get_codec("powersgd:rank=4")
    assert psgd.plan((128,)) is None and psgd.plan((256, 128)) is not None
    bucket = list(SHAPES)
    assert any(len(s) == 1 for s in bucket) and any(len(s) == 2 for s in bucket)
    # additive and non-additive (max(c0, work)) speeds, fixed costs far apart
    for additive, eps in ((True, 1e9), (False, 1e6)):
        speeds = SpeedTable(speeds={
            "powersgd": CodecSpeed(2e-3, eps, eps, additive=additive, decode_overhead_s=1e-3),
            "identity": CodecSpeed(1e-5, 10 * eps, 10 * eps, additive=additive),
        })
        cfg = ExchangeConfig(cluster=cl, speeds=speeds)
        hook = exchange_segments(psgd, bucket, cfg, granularity="hook")
        per = exchange_segments(psgd, bucket, cfg, granularity="parameter")

        def codec_s(segs: list[Segment]) -> float:
            return sum(s.seconds for s in segs if s.kind == "codec")

        assert codec_s(hook) == pytest.approx(codec_s(per), rel=1e-9)
        assert [s for s in hook if s.resource == "net"] == [
            s for s in exchange_segments(psgd, bucket, cfg, granularity="batched")
            if s.resource == "net"]
