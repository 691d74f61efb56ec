"""The DDP comm hook on real 2-rank gloo groups, training the built-in tiny GPT.

Each test spawns one gloo group (``tests/dist_utils.run_workers``, with a timeout, so nothing
can hang) and runs several training configurations in it, because starting processes is the
expensive part on a 2-core machine. Every configuration starts from the same weights and sees
the same data (rank ``r`` of step ``t`` gets its own fixed batch), so runs can be compared
step by step.
"""

from __future__ import annotations

import hashlib
import io
import math
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.errors import CommpressError

# A small model keeps each configuration to well under a second per step on one core.
MODEL = {"vocab_size": 256, "context": 16, "d_model": 32, "n_layers": 2, "n_heads": 2,
         "mlp_ratio": 2}
BATCH = 8
LR = 0.05


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: windows of stdlib source at fixed random offsets."""
    from commpress.demo.data import stdlib_corpus

    text = torch.frombuffer(bytearray(stdlib_corpus(max_bytes=200_000)), dtype=torch.uint8)
    g = torch.Generator().manual_seed(1000 * step + rank)
    ctx = MODEL["context"]
    starts = torch.randint(0, text.numel() - ctx - 1, (BATCH,), generator=g)
    x = torch.stack([text[s : s + ctx] for s in starts.tolist()]).long()
    y = torch.stack([text[s + 1 : s + ctx + 1] for s in starts.tolist()]).long()
    return x, y


def _build(bucket_cap_mb: float) -> DDP:
    from commpress.demo.model import GPTConfig, build_model

    model = build_model(GPTConfig(**MODEL), seed=0)
    return DDP(model, bucket_cap_mb=bucket_cap_mb)


def _flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]


def _install(model: DDP, hook: dict[str, Any]) -> Any:
    """Install the hook a configuration names; returns the commpress state (or None)."""
    kind = hook.get("kind", "commpress")
    if kind == "plain":
        return None
    if kind == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if kind == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(process_group=None, **hook["args"])
        model.register_comm_hook(state, ps.powerSGD_hook)
        return state
    return commpress.ddp.register(model, **hook["args"])


def _train(
    model: DDP, state: Any, steps: range, opt: torch.optim.Optimizer, rank: int,
    on_step: Callable[[int, Any], None] | None = None,
) -> list[float]:
    losses = []
    for step in steps:
        x, y = _data(step, rank)
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 y.reshape(-1))
        loss.backward()
        opt.step()
        # the loss averaged over ranks: what "the training loss" is under data parallelism
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(float(avg) / dist.get_world_size())
        if on_step is not None:
            on_step(step, state)
    return losses


def _run_configs(rank: int, world: int, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train each configuration from the same start; report losses and parameter digests."""
    torch.manual_seed(0)
    out = []
    for cfg in configs:
        model = _build(cfg.get("bucket_cap_mb", 25.0))
        state = _install(model, cfg["hook"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        plans: dict[int, dict[str, tuple[str, str]]] = {}

        def record(step: int, st: Any, plans: dict[int, Any] = plans) -> None:
            if isinstance(st, commpress.ddp.DDPCompressionState):
                plans[step] = {k: (p.codec.codec_id, p.reason) for k, p in st.plans.items()}

        losses = _train(model, state, range(cfg["steps"]), opt, rank, record)
        params = _flat_params(model)
        out.append({
            "name": cfg["name"],
            "losses": losses,
            "digest": _digest(params),
            "params": params if cfg.get("keep_params") else None,
            "plans": plans,
            "buckets": len(model.reducer._get_zeros_like_grad_buckets())
            if hasattr(model.reducer, "_get_zeros_like_grad_buckets") else None,
        })
    return out


def _by_name(results: list[list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """{config name: [rank 0 result, rank 1 result]}; asserts replicas are bit-identical."""
    table: dict[str, list[dict[str, Any]]] = {}
    for per_rank in zip(*results, strict=True):
        name = per_rank[0]["name"]
        digests = {r["digest"] for r in per_rank}
        assert len(digests) == 1, f"{name}: parameters differ across ranks: {digests}"
        assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)
        table[name] = list(per_rank)
    return table


# ----------------------------------------------------------------------------- tests


def test_register_rejects_non_ddp_models() -> None:
    with pytest.raises(CommpressError, match="DistributedDataParallel"):
        commpress.ddp.register(torch.nn.Linear(2, 2), "fp16")  # type: ignore[arg-type]


def test_lossless_and_fp16_paths_match_plain_ddp_and_pytorch_fp16_hook() -> None:
    steps = 6
    configs: list[dict[str, Any]] = [
        {"name": "plain", "hook": {"kind": "plain"}},
        {"name": "identity", "hook": {"args": {"codec": "identity"}}},
        {"name": "identity-bucket", "hook": {"args": {"codec": "identity",
                                                      "granularity": "bucket"}}},
        {"name": "fp16", "hook": {"args": {"codec": "fp16"}}},
        {"name": "torch-fp16", "hook": {"kind": "torch-fp16"}},
    ]
    if "netzip" in commpress.codec_ids():
        configs.append({"name": "netzip", "hook": {"args": {"codec": "netzip"}}})
    for cfg in configs:
        cfg["steps"] = steps
    table = _by_name(run_workers(_run_configs, 2, configs, timeout=240))
    plain = table["plain"][0]
    # Lossless codecs at world size 2: gloo's sum a + b is commutative and the division by 2 is
    # exact in binary floating point, so our "sum then halve" equals DDP's "halve then sum"
    # bit for bit, at every step and for the final parameters.
    for name in ("identity", "identity-bucket", "netzip"):
        if name in table:
            assert table[name][0]["losses"] == plain["losses"], name
            assert table[name][0]["digest"] == plain["digest"], name
    # Our fp16 path does PyTorch's arithmetic (cast, divide by the world size in fp16, sum in
    # fp16, cast back), so it is bit-identical to fp16_compress_hook.
    assert table["fp16"][0]["losses"] == table["torch-fp16"][0]["losses"]
    assert table["fp16"][0]["digest"] == table["torch-fp16"][0]["digest"]
    # fp16 vs fp32: each gradient element carries a relative rounding error <= 2^-10 (cast and
    # sum). The loss then moves by at most ~lr * ||g||^2 * 2^-10 per step, far below 1e-3 of
    # the loss (~5.5) over 6 steps; the first step's loss is computed before any update, so it
    # is exactly equal.
    fp16 = table["fp16"][0]["losses"]
    assert fp16[0] == plain["losses"][0]
    for a, b in zip(fp16, plain["losses"], strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (fp16, plain["losses"])


def _every_codec_configs(steps: int) -> list[dict[str, Any]]:
    configs = []
    for cid in commpress.codec_ids():
        for granularity in ("parameter", "bucket"):
            configs.append({
                "name": f"{cid}/{granularity}",
                "hook": {"args": {"codec": cid, "granularity": granularity}},
                # several buckets in flight, so multi-round codecs interleave with autograd
                "bucket_cap_mb": 0.05,
                "steps": steps,
            })
    return configs


def test_every_registered_codec_keeps_replicas_bit_identical() -> None:
    """Each registered codec (default parameters, automatic error feedback), per parameter and
    per bucket, 3 steps on 2 ranks: parameters stay bit-identical across ranks and the loss
    stays finite."""
    configs = _every_codec_configs(steps=3)
    table = _by_name(run_workers(_run_configs, 2, configs, timeout=400))
    assert set(table) == {c["name"] for c in configs}
    for name, per_rank in table.items():
        losses = per_rank[0]["losses"]
        assert all(math.isfinite(v) for v in losses), (name, losses)
        # every step went through the hook: the state recorded a plan per step
        assert sorted(per_rank[0]["plans"]) == [0, 1, 2], name
