"""``advise``: which codec for which bucket, or no compression at all.

Algorithm of :func:`advise`:

1. Build the :class:`~commpress.perfmodel.model.Workload` (a parameter count, bucket sizes,
   an ``nn.Module`` or a ``DistributedDataParallel`` model) and the
   :class:`~commpress.perfmodel.collectives.Cluster` (a description, or measured links such as
   the emulated cluster's link check).
2. For every candidate codec, get its error: from ``nmse_table`` when given, otherwise
   :func:`~commpress.perfmodel.codec_costs.measure_nmse` (the worse of a Gaussian and a
   heavy-tailed sample). Candidates above ``max_nmse`` are infeasible. The FP16 baseline
   ("no compression": DDP with PyTorch's ``fp16_compress_hook``) is always feasible.
3. Predict the step with each feasible codec on every bucket and start from the fastest of
   these uniform choices (baseline included).
4. Coordinate descent over buckets: for each bucket try every feasible codec with the other
   buckets fixed and keep a change when the whole step gets faster (buckets interact through
   the shared network and GPU, so each trial runs the full timeline). Repeat until a pass
   changes nothing or ``max_passes`` passes are done.
5. If the best assignment is not at least ``min_speedup`` times faster than the baseline,
   recommend "no compression": a gain inside the model's error is not worth a lossy codec.

Tuning:
    * ``max_nmse``: per-step normalized error allowed. Without error feedback keep it low
      (0.1-0.3); with error feedback, sparsifiers with NMSE near 1 still converge, so raise it
      to 1 to let them compete.
    * ``min_speedup``: the predicted gain required; 1.05 by default, to stay clear of the
      model's typical error. Use 1.0 to see any predicted gain.
    * ``nmse_table``: errors measured on your own gradients (``commpress capture``) are better
      than the synthetic samples, especially for PowerSGD, whose error on real (low-rank)
      gradients is much lower than on random matrices.
"""

from __future__ import annotations

import glob
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from commpress.codecs.registry import codec_ids
from commpress.errors import CommpressError, error_context
from commpress.perfmodel.codec_costs import Offload, SpeedTable, measure_nmse, spec_key
from commpress.perfmodel.collectives import Cluster
from commpress.perfmodel.model import (
    BASELINE_CODEC,
    Platform,
    Prediction,
    SpeedupRange,
    Workload,
    predict,
    predict_baseline,
    speedup_range,
)
from commpress.perfmodel.ratio import model_codec
from commpress.report import render_table
from commpress.units import format_count, format_seconds

#: Candidates tried by default (those whose codec is registered). Random-K is left out: it is
#: a baseline for the top-k family, and its per-step NMSE (0.99 at 1 %, unscaled) hides that
#: it keeps only ``k/d`` of the gradient's energy per step where top-k keeps the largest part,
#: so it learns far slower per step than the error budget suggests (pass it with --codec).
DEFAULT_CANDIDATES: tuple[str, ...] = (
    "powersgd:rank=4",
    "topk:ratio=0.01",
    "dgc:ratio=0.01",
    "topkc",
    "thc",
    "qsgd",
    "terngrad",
    "sign",
    "minmax:bits=4",
    "netzip",
)
NO_COMPRESSION = "no compression"


@dataclass(frozen=True)
class CodecOption:
    """A candidate with its error, feasibility and uniform (all buckets) prediction."""

    spec: str  # as the caller wrote it
    nmse: float
    feasible: bool
    uniform: Prediction | None

    @property
    def total(self) -> float:
        return self.uniform.total if self.uniform is not None else math.nan


@dataclass(frozen=True)
class Advice:
    """The recommendation.

    Attributes:
        choices: codec spec per bucket (the baseline's spec where no compression pays).
        prediction: the step with ``choices``.
        baseline: the FP16 baseline step.
        options: every candidate, with its error and uniform prediction.
        workload, cluster: what was advised on.
        max_nmse, min_speedup: the constraints used.
        bucket_names: the parameter names of each bucket, when the model was given (then
            :meth:`policy` can key a mixed choice by name).
    """

    choices: tuple[str, ...]
    prediction: Prediction
    baseline: Prediction
    options: tuple[CodecOption, ...]
    workload: Workload
    cluster: Cluster
    max_nmse: float | None
    min_speedup: float
    bucket_names: tuple[tuple[str, ...], ...] | None = None
    speedup_range: SpeedupRange | None = None

    @property
    def speedup(self) -> float:
        return self.baseline.total / self.prediction.total

    @property
    def compress(self) -> bool:
        """False when the advice is "no compression"."""
        return any(c != BASELINE_CODEC for c in self.choices)

    @property
    def recommendation(self) -> str:
        """``"no compression"``, a codec spec, or ``"mixed: a (n buckets), b (m buckets)"``."""
        if not self.compress:
            return NO_COMPRESSION
        counts: dict[str, int] = {}
        for c in self.choices:
            counts[c] = counts.get(c, 0) + 1
        if len(counts) == 1:
            return next(iter(counts))
        parts = [f"{c} ({k} bucket{'s' if k > 1 else ''})"
                 for c, k in sorted(counts.items(), key=lambda kv: -kv[1])]
        return "mixed: " + ", ".join(parts)

    def policy(self) -> dict[str, str]:
        """The advice as a policy: ``{name glob: codec spec}`` with ``"*"`` the default, which
        ``commpress.ddp.register(model, policy=...)`` accepts (directly, or as a file written
        by ``commpress advise --emit-policy``). A mixed choice is keyed by parameter names and
        needs :attr:`bucket_names`."""
        counts: dict[str, int] = {}
        for c in self.choices:
            counts[c] = counts.get(c, 0) + 1
        default = max(counts, key=lambda c: counts[c])
        rules = {"*": default}
        if len(counts) == 1:
            return rules
        if self.bucket_names is None or len(self.bucket_names) != len(self.choices):
            raise CommpressError(
                f"the advice mixes codecs ({self.recommendation}); a policy for it names "
                "parameters, so give the model (a module, or --demo-model) rather than a "
                "parameter count or bucket sizes"
            )
        for names, choice in zip(self.bucket_names, self.choices, strict=True):
            if choice != default:
                rules.update({glob.escape(n): choice for n in names})
        return rules

    def summary(self) -> str:
        """One paragraph: what to do and why."""
        base = self.baseline.total
        feasible = [o for o in self.options if o.feasible]
        over = [o.spec for o in self.options if not o.feasible]
        budget = "none" if self.max_nmse is None else f"NMSE <= {self.max_nmse:g}"
        rng = self.speedup_range
        if self.compress:
            head = (
                f"Use {self.recommendation}: the model predicts a step of "
                f"{format_seconds(self.prediction.total)} against {format_seconds(base)} with "
                f"the {BASELINE_CODEC} baseline ({self.speedup:.2f}x"
                + (f", {rng.low:.2f}-{rng.high:.2f}x within the calibration's spread"
                   if rng is not None else "") + ")."
            )
        elif rng is not None:
            head = (
                f"Do not compress: keep {BASELINE_CODEC} ({format_seconds(base)} per step). "
                f"The best choice is predicted {rng.nominal:.2f}x faster, but within the "
                f"calibration's spread it ranges {rng.low:.2f}-{rng.high:.2f}x: the gain "
                "does not exceed the model's uncertainty."
            )
        else:
            head = (
                f"Do not compress: keep {BASELINE_CODEC} ({format_seconds(base)} per step). No "
                f"codec within the error budget is predicted at least {self.min_speedup:g}x "
                "faster."
            )
        tail = (
            f" {len(feasible)} of {len(self.options)} candidates were within the error budget "
            f"({budget} per step)"
            + (f"; over it: {', '.join(over)}" if over else "")
            + ". Error budget and predictions come from a model: check the gain with "
            "`commpress demo` or a short run of your own."
        )
        return head + tail

    def report(self, *, verbose: bool = False) -> str:
        """The summary, the candidates table, and (``verbose``) the per-bucket table."""
        base = self.baseline.total
        lines = [
            f"model: {format_count(self.workload.params)} parameters in "
            f"{len(self.workload.buckets)} buckets; compute "
            f"{format_seconds(self.workload.compute_s)} per step",
            f"cluster: {self.cluster.describe()}",
            "",
            self.summary(),
            "",
        ]
        rows = [[BASELINE_CODEC + " (baseline)", "-", "yes", format_seconds(base), 1.0]]
        for o in self.options:
            rows.append([
                o.spec,
                o.nmse,
                o.feasible,
                format_seconds(o.total) if o.uniform else "-",
                base / o.total if o.uniform else math.nan,
            ])
        budget = "none" if self.max_nmse is None else f"{self.max_nmse:g}"
        lines.append(f"candidates on every bucket (error budget: NMSE <= {budget}):")
        lines.append(render_table(["codec", "nmse", "within budget", "step", "speedup"], rows))
        lines.append("")
        if verbose:
            per = [[i, n, c] for i, (n, c) in
                   enumerate(zip(self.workload.bucket_numels, self.choices, strict=True))]
            lines.append("per bucket (ready order):")
            lines.append(render_table(["bucket", "elements", "codec"], per))
            lines.append("")
        lines.append(
            f"recommendation: {self.recommendation}; predicted step "
            f"{format_seconds(self.prediction.total)} vs {format_seconds(base)} with "
            f"{BASELINE_CODEC} ({self.speedup:.3f}x)"
        )
        if not self.compress:
            lines.append(
                f"(no candidate within the error budget is predicted to be at least "
                f"{self.min_speedup:g}x faster than the {BASELINE_CODEC} baseline)"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "recommendation": self.recommendation,
            "compress": self.compress,
            "choices": list(self.choices),
            "predicted_s": self.prediction.total,
            "baseline_s": self.baseline.total,
            "speedup": self.speedup,
            "speedup_range": (None if self.speedup_range is None
                              else [self.speedup_range.low, self.speedup_range.high]),
            "breakdown": self.prediction.breakdown(),
            "max_nmse": self.max_nmse,
            "min_speedup": self.min_speedup,
            "summary": self.summary(),
            "options": [
                {"codec": o.spec, "nmse": o.nmse, "feasible": o.feasible,
                 "uniform_s": o.total if o.uniform else None}
                for o in self.options
            ],
        }


def as_workload(model: Any, *, compute_s: float | None = None, **kwargs: Any) -> Workload:
    """A :class:`Workload` from a workload, parameter count, list of bucket sizes (elements),
    ``nn.Module`` or DDP model. ``compute_s`` (forward + backward) is needed except for a
    parameter count, where it is estimated
    (:func:`~commpress.perfmodel.model.estimate_compute_s`)."""
    if isinstance(model, Workload):
        return model
    if isinstance(model, bool):
        raise CommpressError("model must be a Workload, a parameter count, bucket sizes or a "
                             "torch module")
    if isinstance(model, (int, float)):
        return Workload.from_params(float(model), compute_s=compute_s, **kwargs)
    if isinstance(model, Sequence) and not isinstance(model, str):
        if compute_s is None:
            raise CommpressError("bucket sizes need compute_s (forward + backward seconds)")
        return Workload.from_bucket_sizes(list(model), compute_s=compute_s, **kwargs)
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(model, torch.nn.Module):
        if compute_s is None:
            raise CommpressError("a module needs compute_s (forward + backward seconds)")
        return Workload.from_module(model, compute_s=compute_s, **kwargs)
    raise CommpressError(
        f"cannot build a workload from {type(model).__name__}; pass a Workload, a parameter "
        "count, a list of bucket sizes or an nn.Module / DistributedDataParallel model"
    )


def default_candidates() -> list[str]:
    """:data:`DEFAULT_CANDIDATES` whose codec id is registered."""
    known = set(codec_ids())
    return [c for c in DEFAULT_CANDIDATES if c.partition(":")[0] in known]


def advise(
    model: Any,
    cluster: Cluster | Mapping[str, Any],
    *,
    compute_s: float | None = None,
    candidates: Sequence[str] | None = None,
    max_nmse: float | None = 0.5,
    nmse_table: Mapping[str, float] | None = None,
    min_speedup: float = 1.05,
    strategy: str = "auto",
    algorithm: str = "ring",
    speeds: SpeedTable | None = None,
    platform: Platform | None = None,
    offload: Offload | None = None,
    max_passes: int = 2,
    progress: Callable[[int, int], None] | None = None,
    bucket_names: Sequence[Sequence[str]] | None = None,
    granularity: str = "hook",
) -> Advice:
    """Recommend a codec per bucket, or no compression (see the module docstring).

    Args:
        model: a :class:`Workload`, parameter count, list of bucket sizes (elements), or an
            ``nn.Module`` / ``DistributedDataParallel`` model.
        cluster: a :class:`Cluster` or a mapping for :meth:`Cluster.from_measured` (measured
            links of the emulated cluster, or a flat description).
        compute_s: forward + backward seconds per step (estimated for a parameter count).
        candidates: codec specs to consider (default: :func:`default_candidates`).
        max_nmse: error budget per step (``None``: no budget).
        nmse_table: known errors by spec (as written in ``candidates``, or in
            :func:`~commpress.perfmodel.codec_costs.spec_key` form); missing ones are measured.
        min_speedup: predicted speedup over the baseline needed to recommend compression.
        strategy, algorithm, speeds, platform, offload: as in
            :func:`~commpress.perfmodel.model.predict`.
        max_passes: coordinate-descent passes over the buckets (0: the best uniform choice,
            one codec for every bucket).
        progress: called with ``(done, total)`` trial counts.
        bucket_names: parameter names per bucket, in the workload's bucket order (see
            :func:`~commpress.perfmodel.model.ddp_bucket_indices`), for :meth:`Advice.policy`.
        granularity: how a bucket's tensors are reduced, as in
            :func:`~commpress.perfmodel.model.predict`; ``"hook"`` (default) as commpress's
            DDP hook does, which takes the advice (a bucket's PowerSGD rounds batched).
    """
    workload = as_workload(model, compute_s=compute_s)
    cl = cluster if isinstance(cluster, Cluster) else Cluster.from_measured(cluster)
    if min_speedup <= 0:
        raise CommpressError(f"min_speedup must be > 0, got {min_speedup!r}")
    if isinstance(max_passes, bool) or not isinstance(max_passes, int) or max_passes < 0:
        raise CommpressError(f"max_passes must be an integer >= 0, got {max_passes!r}")
    if max_nmse is not None and not max_nmse >= 0:
        raise CommpressError(f"max_nmse must be >= 0 or None, got {max_nmse!r}")
    specs = list(candidates) if candidates is not None else default_candidates()
    kwargs: dict[str, Any] = dict(strategy=strategy, algorithm=algorithm, speeds=speeds,
                                  platform=platform, offload=offload, granularity=granularity)
    baseline = predict_baseline(workload, cl, algorithm=algorithm, speeds=speeds,
                                platform=platform)
    options: list[CodecOption] = []
    table = dict(nmse_table or {})
    for spec in specs:
        with error_context(f"candidate {spec!r}"):
            codec = model_codec(spec)
            key = spec_key(codec)
            if key == BASELINE_CODEC:
                continue
            label = spec if isinstance(spec, str) else key
            err = table.get(label, table.get(key))
            if err is None:
                err = measure_nmse(codec)
            feasible = max_nmse is None or err <= max_nmse
            uniform = predict(workload, cl, codec, **kwargs) if feasible else None
        options.append(CodecOption(label, float(err), feasible, uniform))

    def evaluate(assignment: list[str]) -> Prediction:
        if all(a == BASELINE_CODEC for a in assignment):
            return baseline
        return predict(workload, cl, assignment, **kwargs)

    feasible_specs = [o.spec for o in options if o.feasible]
    choices_pool = [BASELINE_CODEC, *dict.fromkeys(feasible_specs)]  # a spec given twice: once
    n = len(workload.buckets)
    best_total = baseline.total
    assign = [BASELINE_CODEC] * n
    best_pred = baseline
    for o in options:
        if o.uniform is not None and o.uniform.total < best_total:
            best_total, assign, best_pred = o.uniform.total, [o.spec] * n, o.uniform
    # each pass tries every other choice for every bucket: the choice a bucket held when its
    # turn came is skipped, not the one it moved to, so a pass is exactly this many trials
    total_trials = max_passes * n * (len(choices_pool) - 1)
    done = 0
    if len(choices_pool) > 1:
        for _ in range(max_passes):
            changed = False
            for i in range(n):
                held = assign[i]
                for spec in choices_pool:
                    if spec == held:
                        continue
                    trial = list(assign)
                    trial[i] = spec
                    pred = evaluate(trial)
                    done += 1
                    if progress is not None:
                        progress(done, total_trials)
                    if pred.total < best_total * (1 - 1e-9):
                        best_total, assign, best_pred, changed = pred.total, trial, pred, True
            if not changed:
                break
        if progress is not None and done < total_trials:
            progress(done, done)  # converged: the passes left are not run, the total shrinks
    rng: SpeedupRange | None = None
    if baseline.total / best_total >= min_speedup and any(a != BASELINE_CODEC for a in assign):
        rng = speedup_range(workload, cl, assign, speeds=speeds, platform=platform,
                            strategy=strategy, algorithm=algorithm, offload=offload,
                            granularity=granularity)
        if rng.low <= 1.0:  # the gain is inside the calibration's spread
            assign, best_pred = [BASELINE_CODEC] * n, baseline
    if baseline.total / best_total < min_speedup:
        assign, best_pred = [BASELINE_CODEC] * n, baseline
    return Advice(
        choices=tuple(assign),
        prediction=best_pred,
        baseline=baseline,
        options=tuple(options),
        workload=workload,
        cluster=cl,
        max_nmse=max_nmse,
        min_speedup=min_speedup,
        bucket_names=None if bucket_names is None else tuple(tuple(b) for b in bucket_names),
        speedup_range=rng,
    )


__all__ = [
    "DEFAULT_CANDIDATES",
    "NO_COMPRESSION",
    "Advice",
    "CodecOption",
    "advise",
    "as_workload",
    "default_candidates",
]
