"""Performance model: will gradient compression pay on this cluster, for this model?

* :mod:`~commpress.perfmodel.units` - ``"100gbit"``, ``"600GB/s"``, ``"200us"``, ``"1.3e9"``.
* :mod:`~commpress.perfmodel.collectives` - alpha-beta costs of ring, tree and recursive
  halving/doubling collectives, hierarchical exchanges (SqueezeNIC's equations), clusters.
* :mod:`~commpress.perfmodel.codec_costs` - wire bytes and rounds measured from the codecs,
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
    "Offload",
    "Platform",
    "Prediction",
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
    "predict",
    "predict_baseline",
    "simulate_step",
    "split_half",
    "validate",
    "wire_profile",
]
