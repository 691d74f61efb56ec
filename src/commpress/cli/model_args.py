"""Command-line arguments shared by ``commpress predict``, ``sweep`` and ``advise``.

They live in the CLI, not in :mod:`commpress.perfmodel`: ``--demo-model`` builds a model of
:mod:`commpress.demo`, which sits above the performance model. The real-model descriptions
(``--model``, ``--hf-config``, ``--shapes``) come from :mod:`commpress.perfmodel.shapes`."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

from commpress.cli.argtypes import non_negative_float, positive_float, positive_int
from commpress.demo.model import build_model, preset
from commpress.errors import CommpressError, read_json
from commpress.perfmodel.codec_costs import STRATEGIES, Offload, SpeedTable
from commpress.perfmodel.collectives import ALLREDUCE_ALGORITHMS, TCP_EFFICIENCY, Cluster
from commpress.perfmodel.model import (
    CALIBRATION_FORMAT,
    Platform,
    Workload,
    ddp_bucket_indices,
    estimate_compute_s,
)
from commpress.perfmodel.shapes import ModelShapes
from commpress.units import parse_bandwidth, parse_count, parse_duration

#: Environment variable naming a codec speed table (JSON) to use by default.
SPEEDS_ENV = "COMMPRESS_CODEC_SPEEDS"
_GRAD_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def add_workload_args(p: argparse.ArgumentParser, *, single: bool = True) -> None:
    g = p.add_argument_group("model")
    if single:
        g.add_argument("--params", help="parameter count, e.g. 1.3e9 or 350M (a GPT-style "
                       "model of that size is assumed)")
        g.add_argument("--buckets", help="gradient bucket sizes in elements, comma-separated, "
                       "in the order they become ready (instead of --params)")
        g.add_argument("--demo-model", choices=["tiny", "small", "medium"],
                       help="the built-in TinyGPT preset (commpress.demo) instead of --params")
        g.add_argument("--hidden", type=positive_int,
                       help="hidden size of the assumed GPT-style model "
                       "(default: derived from --params)")
    g.add_argument("--model", metavar="MODULE:FN",
                   help="a function returning the nn.Module to describe, 'pkg.module:build' or "
                   "'path/to/file.py:build'; called under torch.device('meta'), so no memory "
                   "is used (real shapes instead of --params)")
    g.add_argument("--hf-config", metavar="CONFIG",
                   help="a Hugging Face config: config.json, a directory holding one, or a "
                   "model name already cached locally (offline; needs transformers); the model "
                   "is built from it on the meta device")
    g.add_argument("--shapes", metavar="FILE",
                   help="parameter shapes in JSON ([{\"name\", \"shape\", \"dtype\"}, ...] or "
                   "{name: shape}) or CSV (name,shape[,dtype]; shapes like 64x3x3x3)")
    g.add_argument("--compute-ms", help="forward + backward time per step in ms (default: "
                   "6 * params * tokens / flops)")
    g.add_argument("--tokens-per-gpu", default="16384",
                   help="tokens per GPU per step, for the default compute time (16384)")
    g.add_argument("--gpu-tflops", type=positive_float, default=400.0,
                   help="achieved TFLOP/s per GPU, for the default compute time (400)")
    g.add_argument("--backward-fraction", type=float, default=2 / 3,
                   help="share of the compute that is backward (default 2/3)")
    g.add_argument("--optimizer-ms", type=non_negative_float, default=0.0,
                   help="optimizer step in ms (0)")
    g.add_argument("--bucket-mb", type=positive_float, default=25.0,
                   help="DDP bucket_cap_mb (MiB, default 25)")
    g.add_argument("--grad-dtype", choices=sorted(_GRAD_BYTES),
                   help="dtype of the gradients before compression (default: the parameters' "
                   "dtype for --model/--hf-config/--shapes, else fp32)")


def add_cluster_args(p: argparse.ArgumentParser, *, single: bool = True) -> None:
    g = p.add_argument_group("cluster")
    if single:
        g.add_argument("--nodes", type=positive_int, default=2, help="number of nodes N (2)")
        g.add_argument("--inter-bw", default="100gbit",
                       help="inter-node bandwidth per node and direction (100gbit; units: "
                       "gbit, Gb/s, Gbps = bits; GB/s = bytes)")
    g.add_argument("--gpus-per-node", type=positive_int, default=8, help="ranks per node M (8)")
    g.add_argument("--intra-bw", default="600GB/s", help="intra-node bandwidth (600GB/s)")
    g.add_argument("--inter-latency", default="10us", help="inter-node alpha (10us)")
    g.add_argument("--intra-latency", default="5us", help="intra-node alpha (5us)")
    g.add_argument("--inter-efficiency", type=float, default=TCP_EFFICIENCY,
                   help="usable fraction of the inter-node rate (default 1448/1514 = TCP "
                   "framing at MTU 1500; 1 for a goodput)")
    if single:
        g.add_argument("--links", help="JSON file of measured links (`commpress cluster status "
                       "--json` output, a link report, or a flat description); overrides the "
                       "bandwidth/latency options")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("exchange and platform")
    g.add_argument("--strategy", choices=STRATEGIES, default="auto",
                   help="how tensors are exchanged (auto: the codec's own protocol)")
    g.add_argument("--algorithm", choices=ALLREDUCE_ALGORITHMS, default="ring",
                   help="all-reduce algorithm (ring)")
    g.add_argument("--granularity", choices=["hook", "parameter", "bucket", "batched"],
                   default="hook",
                   help="as commpress's DDP hook reduces a bucket (hook: batched where it "
                   "batches the rounds of the bucket's tensors, else per parameter), codec "
                   "per parameter tensor with one exchange each (parameter: the hook with "
                   "batch_rounds=False), per flat bucket, or per tensor with the bucket's "
                   "payloads sent together (batched: PyTorch's PowerSGD hook)")
    g.add_argument("--codec-speeds", help=f"codec speed table JSON (from --calibrate-codecs; "
                   f"default ${SPEEDS_ENV} or the built-in assumptions)")
    g.add_argument("--platform", help="platform constants JSON, or the file `commpress "
                   "calibrate` writes (its cluster, codec speeds, compute time and spreads "
                   "then become the defaults)")
    g.add_argument("--codec-device", choices=["gpu", "cpu"], default="gpu",
                   help="built-in codec profile when no speed table is given: gpu (measured "
                   "on an H100, default) or cpu (gloo jobs whose codecs run on the CPU)")
    g.add_argument("--overlap-efficiency", type=float,
                   help="override the platform's overlap efficiency: 1 = communication "
                   "during backward fully hidden, 0 = serial, below 0 = it slows the "
                   "backward too (-4..1)")
    g.add_argument("--offload-bw", help="run codec work on an offload device (SqueezeNIC) "
                   "compressing at this rate of uncompressed data, e.g. 400gbit")
    g.add_argument("--offload-decompress-bw",
                   help="the offload device's decompress rate, in uncompressed data restored "
                   "(default: --offload-bw)")
    g.add_argument("--offload-latency", default="2us", help="offload device latency (2us)")


def calibration_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``commpress calibrate`` file given as ``--platform``, or ``None``."""
    path = getattr(args, "platform", None)
    if not path:
        return None
    data = read_json(path, f"--platform {path}")
    return data if isinstance(data, dict) and data.get("format") == CALIBRATION_FORMAT else None


def compute_seconds(args: argparse.Namespace, params: float) -> float:
    """``--compute-ms`` (a number of ms, or a duration with its unit), the calibration
    file's compute time, or the estimate."""
    cal = calibration_from_args(args)
    if args.compute_ms is None and cal is not None and cal.get("compute_s"):
        return float(cal["compute_s"])
    if args.compute_ms is not None:
        text = str(args.compute_ms).strip()
        return parse_duration(text if text[-1:].isalpha() else text + "ms")
    return estimate_compute_s(params, tokens_per_gpu=parse_count(args.tokens_per_gpu),
                              flops=args.gpu_tflops * 1e12)


def workload_common(args: argparse.Namespace, shapes: ModelShapes | None = None
                    ) -> dict[str, Any]:
    grad_bytes = _GRAD_BYTES[args.grad_dtype] if args.grad_dtype else (
        shapes.grad_bytes if shapes is not None else 4)
    return dict(
        backward_fraction=args.backward_fraction,
        optimizer_s=args.optimizer_ms / 1e3,
        grad_bytes=grad_bytes,
        bucket_bytes=args.bucket_mb * 1024 * 1024,
    )


_DESCRIBED = ("model", "hf_config", "shapes")
_SHAPES_CACHE: dict[tuple[str, str], ModelShapes] = {}


def model_shapes_from_args(args: argparse.Namespace) -> ModelShapes | None:
    """The real model of ``--model``, ``--hf-config`` or ``--shapes`` (at most one), or
    ``None`` when none is given (built once per run)."""
    given = [x for x in _DESCRIBED if getattr(args, x, None)]
    if not given:
        return None
    if len(given) > 1:
        raise CommpressError("give one of --model, --hf-config, --shapes")
    from commpress.perfmodel import shapes as sh

    kind = given[0]
    source = str(getattr(args, kind))
    key = (kind, source)
    if key not in _SHAPES_CACHE:
        build = {"model": sh.shapes_from_callable, "hf_config": sh.shapes_from_hf_config,
                 "shapes": sh.shapes_from_file}[kind]
        _SHAPES_CACHE[key] = build(source)
    return _SHAPES_CACHE[key]


def bucket_names_from_args(args: argparse.Namespace) -> list[list[str]] | None:
    """Parameter names per DDP bucket (ready order) when the model itself is given
    (``--demo-model``, ``--model``, ``--hf-config``, ``--shapes``), else ``None``."""
    described = model_shapes_from_args(args)
    if described is not None:
        common = workload_common(args, described)
        return described.bucket_names(grad_bytes=common["grad_bytes"],
                                      bucket_bytes=common["bucket_bytes"])
    if not getattr(args, "demo_model", None):
        return None
    model = build_model(preset(args.demo_model))
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]  # as workload_from_args
    common = workload_common(args)
    layout = ddp_bucket_indices([s for _, s in named], grad_bytes=common["grad_bytes"],
                                bucket_bytes=common["bucket_bytes"])
    return [[named[i][0] for i in bucket] for bucket in layout]


def workload_from_args(args: argparse.Namespace) -> Workload:
    given = [x for x in ("params", "buckets", "demo_model", *_DESCRIBED)
             if getattr(args, x, None)]
    if len(given) > 1:
        raise CommpressError("give one of --params, --buckets, --demo-model, --model, "
                             "--hf-config, --shapes")
    described = model_shapes_from_args(args)
    if described is not None:
        common = workload_common(args, described)
        return described.workload(compute_s=compute_seconds(args, described.numel), **common)
    common = workload_common(args)
    if args.buckets:
        sizes = [parse_count(s) for s in str(args.buckets).split(",") if s.strip()]
        cal = calibration_from_args(args)
        if args.compute_ms is None and not (cal and cal.get("compute_s")):
            raise CommpressError("--buckets needs --compute-ms (or a --platform calibration "
                                 "file with a compute time)")
        return Workload.from_bucket_sizes(
            sizes, compute_s=compute_seconds(args, sum(sizes)),
            backward_fraction=common["backward_fraction"], optimizer_s=common["optimizer_s"],
            grad_bytes=common["grad_bytes"], name=f"{len(sizes)} buckets",
        )
    if args.demo_model:
        model = build_model(preset(args.demo_model))
        shapes = [tuple(p.shape) for p in model.parameters()]
        numel = sum(p.numel() for p in model.parameters())
        return Workload.from_shapes(shapes, compute_s=compute_seconds(args, numel),
                                    name=f"TinyGPT {args.demo_model}", **common)
    if not args.params:
        raise CommpressError("give the model: --params 1.3e9, --buckets ..., --demo-model, "
                             "--model pkg.module:build, --hf-config config.json or --shapes FILE")
    params = parse_count(args.params)
    return Workload.from_params(params, compute_s=compute_seconds(args, params),
                                hidden=args.hidden, **common)


def cluster_from_args(
    args: argparse.Namespace, *, nodes: int | None = None, inter_bw: Any = None
) -> Cluster:
    links = getattr(args, "links", None)
    cal = calibration_from_args(args)
    if not links and nodes is None and inter_bw is None and cal is not None and cal.get(
        "cluster"
    ):  # a sweep's grid of clusters keeps its own
        return Cluster.from_measured(cal["cluster"])
    if links:
        data = read_json(links, f"--links {links}")
        return Cluster.from_measured(data, gpus_per_node=args.gpus_per_node)
    return Cluster.build(
        nodes=nodes if nodes is not None else args.nodes,
        gpus_per_node=args.gpus_per_node,
        inter_bw=inter_bw if inter_bw is not None else args.inter_bw,
        intra_bw=args.intra_bw,
        inter_latency=args.inter_latency,
        intra_latency=args.intra_latency,
        inter_efficiency=args.inter_efficiency,
    )


def speeds_from_args(args: argparse.Namespace) -> SpeedTable:
    path = args.codec_speeds or os.environ.get(SPEEDS_ENV)
    if path:
        return SpeedTable.load(path)
    cal = calibration_from_args(args)
    if cal is not None and cal.get("codec_speeds"):
        return SpeedTable.from_dict(cal["codec_speeds"])
    return SpeedTable.builtin(getattr(args, "codec_device", "gpu"))


def platform_from_args(args: argparse.Namespace) -> Platform:
    platform = Platform.load(args.platform) if args.platform else Platform()
    if args.overlap_efficiency is not None:
        platform = replace(platform, overlap_efficiency=args.overlap_efficiency)
    return platform


def offload_from_args(args: argparse.Namespace) -> Offload | None:
    if not args.offload_bw:
        if args.offload_decompress_bw:
            raise CommpressError("--offload-decompress-bw needs --offload-bw")
        return None
    decompress = parse_bandwidth(args.offload_decompress_bw) if args.offload_decompress_bw \
        else None
    return Offload(parse_bandwidth(args.offload_bw), parse_duration(args.offload_latency),
                   decompress_bandwidth=decompress)


def model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        strategy=args.strategy,
        algorithm=args.algorithm,
        granularity=args.granularity,
        speeds=speeds_from_args(args),
        platform=platform_from_args(args),
        offload=offload_from_args(args),
    )


__all__ = [
    "SPEEDS_ENV",
    "add_cluster_args",
    "add_model_args",
    "add_workload_args",
    "cluster_from_args",
    "model_kwargs",
    "model_shapes_from_args",
    "workload_from_args",
]
