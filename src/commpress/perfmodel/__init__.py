"""Performance model: will gradient compression pay on this cluster, for this model?

* :mod:`~commpress.units` - ``"100gbit"``, ``"600GB/s"``, ``"200us"``, ``"1.3e9"``.
* :mod:`~commpress.perfmodel.collectives` - alpha-beta costs of ring, tree and recursive
  halving/doubling collectives, hierarchical exchanges (SqueezeNIC's equations), clusters.
* :mod:`~commpress.perfmodel.shapes` - real models: parameter shapes from an ``nn.Module``
  built on the meta device, a Hugging Face config or a shapes file.
* :mod:`~commpress.perfmodel.ratio` - ``ratio``, a model-only codec: payload = dense / cr.
* :mod:`~commpress.perfmodel.codec_costs` - wire bytes and rounds from the codecs' formulas,
  encode/decode time ``max(c0, n / throughput)`` from a speed table (built-in or calibrated),
  one tensor's exchange under each strategy.
* :mod:`~commpress.perfmodel.timeline` - the per-bucket event timeline of a DDP step.
* :mod:`~commpress.perfmodel.model` - workloads, platform constants, :func:`predict`,
  :func:`compare` (against the FP16 baseline).
* :mod:`~commpress.perfmodel.advisor` - :func:`advise`: a codec per bucket, or no compression.
* :mod:`~commpress.perfmodel.calibration` - fit platform constants on half of the measured
  runs, report the error on the other half.

>>> from commpress.perfmodel import Cluster, Workload, compare
>>> cluster = Cluster.build(nodes=4, gpus_per_node=8, inter_bw="25gbit")
>>> result = compare(Workload.from_params(1.3e9, compute_s=0.25), cluster, "powersgd:rank=4")
>>> result.speedup  # doctest: +SKIP
"""

from commpress.perfmodel.advisor import NO_COMPRESSION, Advice, advise
from commpress.perfmodel.calibration import (
    Measurement,
    ValidationReport,
    calibrate_and_validate,
    fit_platform,
    split_half,
    validate,
)
from commpress.perfmodel.codec_costs import (
    CodecSpeed,
    ExchangeConfig,
    Offload,
    SpeedTable,
    calibrate_speeds,
    exchange_segments,
    measure_nmse,
    wire_profile,
)
from commpress.perfmodel.collectives import TCP_EFFICIENCY, Cluster, Link
from commpress.perfmodel.model import (
    Comparison,
    Platform,
    Prediction,
    Setup,
    Workload,
    compare,
    predict,
    predict_baseline,
)
from commpress.perfmodel.ratio import RatioCodec, model_codec
from commpress.perfmodel.shapes import (
    ModelShapes,
    ParamShape,
    shapes_from_callable,
    shapes_from_file,
    shapes_from_hf_config,
    shapes_of_module,
)
from commpress.perfmodel.timeline import Segment, StepTimeline, simulate_step

__all__ = [
    "NO_COMPRESSION",
    "TCP_EFFICIENCY",
    "Advice",
    "Cluster",
    "CodecSpeed",
    "Comparison",
    "ExchangeConfig",
    "Link",
    "Measurement",
    "ModelShapes",
    "Offload",
    "ParamShape",
    "Platform",
    "Prediction",
    "RatioCodec",
    "Segment",
    "Setup",
    "SpeedTable",
    "StepTimeline",
    "ValidationReport",
    "Workload",
    "advise",
    "calibrate_and_validate",
    "calibrate_speeds",
    "compare",
    "exchange_segments",
    "fit_platform",
    "measure_nmse",
    "model_codec",
    "predict",
    "predict_baseline",
    "shapes_from_callable",
    "shapes_from_file",
    "shapes_from_hf_config",
    "shapes_of_module",
    "simulate_step",
    "split_half",
    "validate",
    "wire_profile",
]
