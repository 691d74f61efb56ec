"""``ratio``: a model-only pseudo-codec whose payload is the dense tensor divided by a ratio.

Analyses such as SqueezeNIC's (``../shared/papers/squeezenic.md``, equations (1)-(3)) reason
about a compressor only through its compression rate: "the compressed gradient has size
``r z``". ``ratio`` lets :func:`~commpress.perfmodel.model.predict` (and ``commpress
predict/sweep/advise --codec``) answer that kind of question:

* ``ratio:cr=4``: the payload is ``input bytes / 4`` (``cr`` = dense bytes over wire bytes);
* ``ratio:r=0.25``: the same, written as SqueezeNIC's ``r`` (wire bytes over dense bytes);
* ``ratio:4`` / ``ratio:0.25``: a bare number is ``cr`` when it is at least 1, ``r`` below 1;
* ``exchange=allgather``: payloads are gathered instead of summed by an all-reduce (a codec
  whose payloads do not add, such as Top-K).

It is element-wise in the model's sense (a bucket is exchanged as one flat tensor, like the
fp16 baseline) and lossless as far as error budgets go: it has no error model, so
:func:`~commpress.perfmodel.codec_costs.measure_nmse` gives it 0. Its encode/decode speed comes
from the speed table's ``"ratio"`` entry (else ``"*"``), or from an offload device. It is not
in the codec registry: it compresses nothing, and training with it is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from commpress.codecs.base import Codec, CodecContext, Payload, param, require, shape_numel
from commpress.codecs.registry import get_codec, parse_codec_spec
from commpress.errors import CommpressError, ConfigError

#: The pseudo-codec's id (``--codec ratio:cr=4``).
RATIO_ID = "ratio"


@dataclass(frozen=True, slots=True, kw_only=True)
class RatioCodec(Codec):
    """Model-only: a payload of ``ceil(numel * itemsize / cr)`` bytes, one round."""

    codec_id: ClassVar[str] = RATIO_ID
    elementwise: ClassVar[bool] = True
    summary: ClassVar[str] = "model only: payload = dense bytes / cr (no data is compressed)"

    cr: float = param(4.0, "compression ratio: dense bytes / wire bytes (> 0)")
    exchange: Literal["allreduce", "allgather"] = param(
        "allreduce", "how payloads travel: summed by an all-reduce, or gathered"
    )

    def validate(self) -> None:
        require(math.isfinite(self.cr) and self.cr > 0, "cr must be a finite number > 0",
                self.cr)

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.exchange == "allreduce"

    def wire_bytes(
        self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32, *,
        world_size: int = 1,
    ) -> int:
        """``ceil(numel * itemsize / cr)`` (a relative ``1e-12`` below, so that ratios such
        as ``1 / 0.1`` do not add a byte to an exact division)."""
        dense = shape_numel(shape) * dtype.itemsize
        return math.ceil(dense / self.cr * (1.0 - 1e-12))

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        raise CommpressError(
            "codec 'ratio' is a model-only pseudo-codec (commpress predict/sweep/advise); it "
            "compresses nothing and cannot encode tensors"
        )

    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        raise CommpressError("codec 'ratio' is a model-only pseudo-codec; it cannot decode")


def parse_ratio(spec: str | Mapping[str, Any]) -> RatioCodec:
    """A :class:`RatioCodec` from ``"ratio:cr=4"``, ``"ratio:r=0.25"``, ``"ratio:4"``,
    ``"ratio:0.25,exchange=allgather"`` or a config mapping (``{"id": "ratio", "cr": 4}``)."""
    if isinstance(spec, str):
        head, _, rest = spec.partition(":")
        items = [s.strip() for s in rest.split(",") if s.strip()]
        bare = [s for s in items if "=" not in s]
        if len(bare) > 1:
            raise ConfigError(f"codec spec {spec!r}: one bare ratio at most")
        config = parse_codec_spec(":".join([head, ",".join(s for s in items if "=" in s)]))
        if bare:
            try:
                value = float(bare[0])
            except ValueError:
                raise ConfigError(
                    f"codec spec {spec!r}: {bare[0]!r} is not a number (ratio:cr=4, "
                    "ratio:r=0.25, ratio:4 or ratio:0.25)"
                ) from None
            config["cr" if value >= 1 else "r"] = value
    else:
        config = dict(spec)
    config.pop("id", None)
    if "r" in config:
        if "cr" in config:
            raise ConfigError("give ratio's cr (dense/wire) or r (wire/dense), not both")
        r = config.pop("r")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1e300:
            raise ConfigError(f"ratio: r must be a number > 0, got {r!r}")
        config["cr"] = 1.0 / float(r)
    names = {name for name, _, _ in RatioCodec.parameters()}
    unknown = sorted(set(config) - names)
    if unknown:
        raise ConfigError(
            f"ratio: unknown parameter(s) {', '.join(unknown)}; accepted: cr, r, exchange"
        )
    return RatioCodec(**config)


def model_codec(spec: str | Mapping[str, Any] | Codec) -> Codec:
    """A codec for the performance model: the ``ratio`` pseudo-codec, or a registered codec
    (:func:`~commpress.codecs.registry.get_codec`)."""
    if isinstance(spec, str) and spec.partition(":")[0].strip() == RATIO_ID:
        return parse_ratio(spec)
    if isinstance(spec, Mapping) and spec.get("id") == RATIO_ID:
        return parse_ratio(spec)
    return get_codec(spec)


__all__ = ["RATIO_ID", "RatioCodec", "model_codec", "parse_ratio"]
