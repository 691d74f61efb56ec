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
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.errors import CommpressError
from dist_utils import run_workers

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

        start = time.perf_counter()
        losses = _train(model, state, range(cfg["steps"]), opt, rank, record)
        seconds = time.perf_counter() - start
        params = _flat_params(model)
        out.append({
            "name": cfg["name"],
            "losses": losses,
            "digest": _digest(params),
            "params": params if cfg.get("keep_params") else None,
            "plans": plans,
            "seconds": seconds,
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
        # element-wise casts take the same batched path at either granularity
        both = cid not in ("identity", "fp16", "bf16")
        for granularity in ("parameter", "bucket") if both else ("parameter",):
            configs.append({
                "name": f"{cid}/{granularity}",
                "hook": {"args": {"codec": cid, "granularity": granularity}},
                # several buckets in flight, so multi-round codecs interleave with autograd
                "bucket_cap_mb": 0.01,
                "steps": steps,
            })
    return configs


def test_every_registered_codec_keeps_replicas_bit_identical() -> None:
    """Each registered codec (default parameters, automatic error feedback), per parameter and
    per bucket, 2 steps on 2 ranks (the second uses the state the first left: PowerSGD's Q,
    error-feedback memory): parameters stay bit-identical across ranks, the loss finite."""
    configs = _every_codec_configs(steps=2)
    table = _by_name(run_workers(_run_configs, 2, configs, timeout=400))
    assert set(table) == {c["name"] for c in configs}
    for name, per_rank in table.items():
        losses = per_rank[0]["losses"]
        assert all(math.isfinite(v) for v in losses), (name, losses)
        # every step went through the hook: the state recorded a plan per step
        assert sorted(per_rank[0]["plans"]) == [0, 1], name


def _powersgd_configs(steps: int) -> list[dict[str, Any]]:
    ours = {"codec": "powersgd", "rank": 2, "warmup_steps": 2, "min_compression_rate": 2.0}
    theirs = {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2,
              "min_compression_rate": 2.0, "use_error_feedback": True, "warm_start": True}
    return [
        {"name": "plain", "hook": {"kind": "plain"}, "steps": steps},
        {"name": "ours", "hook": {"args": ours}, "steps": steps},
        {"name": "torch", "hook": {"kind": "torch-powersgd", "args": theirs}, "steps": steps},
    ]


def test_powersgd_reaches_the_loss_of_pytorch_powersgd_hook() -> None:
    """Our PowerSGD and PyTorch's powerSGD_hook at equal rank (2), equal warm-up (2 steps) and
    equal min_compression_rate (2), both with error feedback and warm start, one DDP bucket
    (PyTorch's hook chains its rounds in future callbacks; with several buckets in flight it
    can pair different collectives across ranks on gloo, see docs/ddp.md)."""
    steps = 30
    # PyTorch's hook calls torch.cuda.synchronize(<the CPU device>) whenever CUDA is available,
    # which fails for a CPU model (seen with torch 2.11 on a GPU machine): hide the GPUs.
    table = _by_name(run_workers(
        _run_configs, 2, _powersgd_configs(steps), timeout=300, env={"CUDA_VISIBLE_DEVICES": ""}
    ))
    tail = {name: sum(r[0]["losses"][-5:]) / 5 for name, r in table.items()}
    # Tolerance: both methods compress the same matrices to rank 2 with error feedback and
    # differ only in details (orthogonalisation, the random initial Q, fp16 instead of fp32
    # for the tensors PowerSGD would not shrink 2x). The loss falls from 5.5 to ~3.7 in 30
    # steps and the two runs track each other to ~0.05% (observed); we require the mean loss
    # of the last 5 steps to agree within 1%, and to be within 3% of uncompressed training.
    assert abs(tail["ours"] - tail["torch"]) <= 0.01 * tail["torch"], tail
    for name in ("ours", "torch"):
        assert abs(tail[name] - tail["plain"]) <= 0.03 * tail["plain"], tail
    # and training did make progress
    assert tail["ours"] < table["ours"][0]["losses"][0] - 0.5, tail


def _load_configs(steps: int) -> list[dict[str, Any]]:
    tiny = 0.001  # ~1 KB buckets: nearly one bucket per parameter, many in flight at once
    return [
        {"name": "plain", "hook": {"kind": "plain"}, "steps": steps, "bucket_cap_mb": tiny},
        {"name": "powersgd", "bucket_cap_mb": tiny, "steps": steps,
         "hook": {"args": {"codec": "powersgd", "rank": 2, "min_numel": 256}}},
        {"name": "topkc", "bucket_cap_mb": tiny, "steps": steps,
         "hook": {"args": {"codec": "topkc"}}},
        {"name": "dgc-momentum", "bucket_cap_mb": tiny, "steps": steps,
         "hook": {"args": {"codec": "topk", "ratio": 0.05, "momentum": 0.5}}},
        {"name": "mixed-policy", "bucket_cap_mb": tiny, "steps": steps,
         "hook": {"args": {"codec": "powersgd", "policy": {"*.bias": "identity",
                                                           "embedding.*": "topkc",
                                                           "final.*": "fp16"}}}},
    ]


def test_many_buckets_with_multi_round_codecs_no_hang_identical_replicas() -> None:
    """Load: ~1 KB buckets (dozens per step, many in flight while autograd runs), multi-round
    codecs (PowerSGD: 2 all-reduces; TopKC: several rounds) and mixed policies, 4 steps, under
    a hard timeout: every run finishes and replicas stay bit-identical."""
    table = _by_name(run_workers(_run_configs, 2, _load_configs(4), timeout=300))
    assert table["plain"][0]["buckets"] >= 10, table["plain"][0]["buckets"]
    for name, per_rank in table.items():
        assert all(math.isfinite(v) for v in per_rank[0]["losses"]), name
    plans = table["mixed-policy"][0]["plans"][3]
    assert plans["blocks.0.mlp.fc.bias"] == ("identity", "lossless")
    assert plans["embedding.tok.weight"][0] == "topkc"
    assert plans["final.proj.weight"] == ("fp16", "codec")
    assert plans["blocks.0.attn.qkv.weight"] == ("powersgd", "codec")


def _resume(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Train 6 steps straight, and 3 steps + checkpoint + a fresh model/hook/optimizer resumed
    from it + 3 steps; return both runs' final parameters and what the state recorded."""
    def fresh() -> tuple[DDP, Any, torch.optim.Optimizer]:
        model = _build(0.01)
        state = commpress.ddp.register(model, **args)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        return model, state, opt

    plans: dict[int, dict[str, tuple[str, str]]] = {}

    def record(step: int, st: Any) -> None:
        plans[step] = {k: (p.codec.codec_id, p.reason) for k, p in st.plans.items()}

    model, state, opt = fresh()
    first = _train(model, state, range(3), opt, rank, record)
    blob = pickle.dumps({"model": model.module.state_dict(), "opt": opt.state_dict(),
                         "hook": state.state_dict()})
    whole = pickle.loads(pickle.dumps(state))  # the state object pickles without its group
    straight = _train(model, state, range(3, 6), opt, rank, record)

    ckpt = pickle.loads(blob)
    model2, state2, opt2 = fresh()
    model2.module.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    state2.load_state_dict(ckpt["hook"])
    resumed = _train(model2, state2, range(3, 6), opt2, rank)
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)  # torch.save works too
    return {
        "straight": _flat_params(model), "resumed": _flat_params(model2),
        "losses": (first + straight, first + resumed), "plans": plans,
        "whole_step": whole.step, "whole_group": whole.process_group,
        "residual_keys": sorted(ckpt["hook"]["memory"]["residual"]),
        "q_keys": sorted(ckpt["hook"]["codec_states"]),
    }


def test_checkpoint_resume_is_bit_identical_and_schedule_rules_apply() -> None:
    """PowerSGD (rank 2) with error feedback, 1 warm-up step, min_numel 1000 (vectors go in
    fp16): a run resumed from a step-3 checkpoint (model, optimizer and hook state) continues
    exactly like the uninterrupted run, on both ranks."""
    args = {"codec": "powersgd", "rank": 2, "warmup_steps": 1, "min_numel": 1000,
            "error_feedback": True}
    results = run_workers(_resume, 2, args, timeout=240)
    for r in results:
        assert torch.equal(r["straight"], r["resumed"])
        assert r["losses"][0] == r["losses"][1]
        assert r["whole_step"] == 3 and r["whole_group"] is None
        # the checkpoint held error-feedback memory and PowerSGD's Q for the matrices only
        assert "blocks.0.attn.qkv.weight" in r["residual_keys"]
        assert "blocks.0.attn.qkv.weight" in r["q_keys"]
        assert "blocks.0.ln1.weight" not in r["q_keys"]
    assert torch.equal(results[0]["straight"], results[1]["straight"])
    plans = results[0]["plans"]
    # step 0: warm-up sends everything uncompressed; afterwards matrices use PowerSGD and
    # vectors (< 1000 elements) use the fp16 fallback
    assert set(plans[0].values()) == {("identity", "warmup")}
    assert plans[1]["blocks.0.attn.qkv.weight"] == ("powersgd", "codec")
    assert plans[1]["blocks.0.ln1.weight"] == ("fp16", "min_numel")


# ------------------------------------------------------------- issue 4: robustness of the hook
class _WithUnused(torch.nn.Module):
    """Two trained layers, a frozen one and (optionally) one the forward never touches."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 32)
        self.frozen = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.b = torch.nn.Linear(32, 8)
        if unused:
            self.unused = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.frozen(torch.relu(self.a(x)))))


def _small_ddp(find_unused_parameters: bool = False) -> DDP:
    return DDP(_WithUnused(unused=find_unused_parameters), bucket_cap_mb=0.001,
               find_unused_parameters=find_unused_parameters)


def _small_train(model: DDP, steps: range, rank: int, accumulate: int = 1) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for s in steps:
        opt.zero_grad()
        for micro in range(accumulate):
            g = torch.Generator().manual_seed(1000 * s + 10 * micro + rank)
            x = torch.randn(4, 16, generator=g)
            if micro < accumulate - 1:
                with model.no_sync():
                    model(x).pow(2).mean().backward()
            else:
                model(x).pow(2).mean().backward()
        opt.step()


def _hook_robustness_worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # 1. find_unused_parameters + an unused layer + a frozen layer, several steps, with and
    #    without no_sync accumulation: DDP's own collectives on the model's group run beside
    #    the hook's (on its own group), so no "Received data size doesn't match".
    for name, codec, accumulate in (("plain", None, 1), ("identity", "identity", 1),
                                    ("powersgd", "powersgd", 1), ("plain-acc", None, 2),
                                    ("identity-acc", "identity", 2), ("topk-acc", "topk", 2)):
        model = _small_ddp(find_unused_parameters=True)
        if codec is not None:
            commpress.ddp.register(model, codec, timeout=20.0)
        try:
            _small_train(model, range(4), rank, accumulate)
            out[name] = _flat_params(model)
        except Exception as exc:  # reported, so the test shows which configuration broke
            out[name] = f"{type(exc).__name__}: {exc}"
    # 2. mismatched configurations: every rank gets a clear CommpressError, nothing aborts.
    for name, ours in (("fp16/bf16", [{"codec": "fp16"}, {"codec": "bf16"}]),
                       ("powersgd rank", [{"codec": "powersgd", "rank": 1},
                                          {"codec": "powersgd", "rank": 2}]),
                       ("topk ratio", [{"codec": "topk", "ratio": 0.1},
                                       {"codec": "topk", "ratio": 0.3}])):
        model = _small_ddp()
        commpress.ddp.register(model, timeout=20.0, **ours[rank])
        try:
            _small_train(model, range(2), rank)
            out[name] = "no error"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    # ranks on different kernel backends (PowerSGD's numba decode rounds differently from
    # its torch path): refused like any other setting
    from commpress.codecs import kernels

    with kernels.use_backend("torch" if rank else "auto"):
        model = _small_ddp()
        commpress.ddp.register(model, "powersgd", timeout=20.0)
        try:
            _small_train(model, range(2), rank)
            out["kernels"] = "no error"
        except Exception as exc:
            out["kernels"] = f"{type(exc).__name__}: {exc}"
    # 3. the pickled state (PowerSGDState pattern) continues bit-identically on a fresh DDP
    #    model of the same architecture registered with model.register_comm_hook.
    for codec in ({"codec": "topk", "ratio": 0.25}, {"codec": "powersgd", "rank": 1}):
        model = _small_ddp()
        state = commpress.ddp.register(model, **codec)
        _small_train(model, range(2), rank)
        blob = pickle.dumps(state)
        weights = pickle.dumps(model.module.state_dict())
        _small_train(model, range(2, 4), rank)
        fresh = _small_ddp()
        fresh.module.load_state_dict(pickle.loads(weights))
        fresh.register_comm_hook(pickle.loads(blob), commpress.ddp.comm_hook)
        try:
            _small_train(fresh, range(2, 4), rank)
            out[f"resume {codec['codec']}"] = torch.equal(_flat_params(model),
                                                          _flat_params(fresh))
        except Exception as exc:
            out[f"resume {codec['codec']}"] = f"{type(exc).__name__}: {exc}"
    return out


def test_hook_survives_unused_frozen_no_sync_refuses_mismatches_and_resumes_from_pickle() -> None:
    results = run_workers(_hook_robustness_worker, 2, timeout=240)
    for name in ("plain", "identity", "powersgd", "plain-acc", "identity-acc", "topk-acc"):
        values = [r[name] for r in results]
        assert all(isinstance(v, torch.Tensor) for v in values), (name, values)
        assert torch.equal(values[0], values[1]), f"{name}: replicas differ"
    # identity is lossless: at world size 2 "sum then halve" equals DDP's "halve then sum"
    # bit for bit (see test_lossless_and_fp16_paths_match_plain_ddp_and_pytorch_fp16_hook)
    assert torch.equal(results[0]["identity"], results[0]["plain"])
    assert torch.equal(results[0]["identity-acc"], results[0]["plain-acc"])
    for name in ("fp16/bf16", "powersgd rank", "topk ratio", "kernels"):
        for rank, r in enumerate(results):
            message = r[name]
            # A MismatchError (a CommpressError); DDP shows the exception's own type name.
            assert "MismatchError" in message and "ranks disagree on hook settings" in message, (
                rank, name, message)
            assert "Unable to cast" not in message, message
    for codec in ("topk", "powersgd"):
        assert all(r[f"resume {codec}"] is True for r in results), [
            r[f"resume {codec}"] for r in results]
