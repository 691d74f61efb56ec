"""Shared inputs of the multi-process collective tests (test_driver, test_strategies,
test_queue, test_collectives_load): integer-valued inputs whose sums are exact in every float
dtype, and a toy multi-round codec with its exact expected result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from commpress.codecs.base import Codec, CodecContext, Payload
from commpress.codecs.protocol import AllGather, AllReduce, Protocol, Reduced

SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (2,), (7,), (33, 5)]
STRATS = ["auto", "allreduce", "allgather", "ring", "hierarchical", "hierarchical-compress-first"]


def int_valued(
    rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-4, 5, shape, generator=g).to(dtype)


# ---------------------------------------------------------------------------- a toy codec
@dataclass(frozen=True, slots=True, kw_only=True)
class TwoRoundInt(Codec):
    """A deterministic multi-round codec (not registered): round 1 all-reduces max |x|, round 2
    all-reduces int32 lanes ``round(x / scale * 1000)``, then an all-gather of a marker. Its
    aggregate is a sum of integers, so it is exact and independent of the order of additions."""

    codec_id: ClassVar[str] = "test-two-round"
    summable: ClassVar[bool] = True
    multi_round: ClassVar[bool] = True

    def _encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        return self.make_payload(x, {"values": x.reshape(-1).to(torch.float32)})

    def _decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        v = self.part(payload, "values", numel=payload.numel)
        return v.to(payload.dtype).reshape(payload.shape)

    def reduce(self, tensor: torch.Tensor, ctx: CodecContext) -> Protocol:
        x = tensor.detach().reshape(-1).float()
        peak = x.abs().max() if x.numel() else torch.zeros(())
        got = yield AllReduce(tensors={"peak": peak.reshape(1)}, op="max")
        scale = float(got["peak"][0]) or 1.0
        lanes = torch.round(x / scale * 1000).to(torch.int32)
        summed = yield AllReduce(tensors={"lanes": lanes})
        marker = self.make_payload(tensor, {"values": torch.full((ctx.rank + 1,), 1.0)})
        gathered = yield AllGather(marker)
        assert [p.parts["values"].numel() for p in gathered] == list(range(1, ctx.world_size + 1))
        total = (summed["lanes"].double() * scale / 1000).to(tensor.dtype).reshape(tensor.shape)
        return Reduced(total=self.finish_total(total, ctx))


def two_round_expected(inputs: list[torch.Tensor], average: bool) -> torch.Tensor:
    xs = [t.reshape(-1).float() for t in inputs]
    scale = float(torch.stack([x.abs().max() for x in xs]).max()) if xs[0].numel() else 0.0
    scale = scale or 1.0
    lanes = sum(torch.round(x / scale * 1000).to(torch.int32) for x in xs)
    total = (lanes.double() * scale / 1000).to(inputs[0].dtype).reshape(inputs[0].shape)
    return total / len(inputs) if average and len(inputs) > 1 else total
