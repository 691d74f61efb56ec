"""CUDA paths: codecs on GPU tensors, collectives and the DDP hook with CUDA tensors.

Every test here needs a CUDA device and is skipped without one (CI has none); they run on GPU
machines with ``pytest tests/test_cuda.py``. What they check:

* every registered codec encodes on the GPU (payload parts stay on the input's device),
  decodes back to the input's device and dtype, and is as accurate as on the CPU (NMSE within
  a factor of two of the CPU figure: random streams differ between devices); lossless codecs
  and the identity are bit-exact, and the simulated aggregation of four workers matches the
  CPU's accuracy;
* ``commpress.all_reduce`` with CUDA tensors under gloo (two processes sharing the GPUs
  round-robin) for every strategy: results stay on the GPU, are bit-identical on every rank
  and exact for integer-valued inputs; compressed send/recv of activations; a DDP model on
  the GPU trained with the hook keeps bit-identical replicas;
* the same under NCCL: world size 1 always, world size 2 where two GPUs exist (NCCL refuses
  two ranks on one GPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import commpress
from commpress.codecs.base import CodecContext
from commpress.codecs.simulate import simulate
from commpress.testing import gaussian, nmse
from dist_utils import run_workers

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)"
)

STRATEGIES = ["auto", "allgather", "ring", "hierarchical", "hierarchical-compress-first"]
LOSSLESS = {"identity", "netzip"}
GPU_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nmse_on(codec: commpress.Codec, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    ctx = CodecContext(key="t", step=1)
    payload = codec.encode(x, ctx)
    for name, part in payload.parts.items():
        assert part.device == x.device, f"{codec}: part {name!r} left {x.device}"
    out = codec.decode(payload, ctx)
    assert out.device == x.device and out.dtype == x.dtype and out.shape == x.shape, codec
    return nmse(out.float().cpu(), x.float().cpu()), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec_id", commpress.codec_ids())
def test_codec_round_trip_on_the_gpu(codec_id: str, dtype: torch.dtype) -> None:
    codec = commpress.get_codec(codec_id)
    x = gaussian(96 * 130, seed=3, dtype=dtype).reshape(96, 130)
    cpu_err, cpu_out = _nmse_on(codec, x)
    gpu_err, gpu_out = _nmse_on(codec, x.cuda())
    if codec_id in LOSSLESS:
        assert torch.equal(gpu_out.cpu().view(torch.uint8), x.view(torch.uint8)), codec_id
        return
    assert gpu_err <= 2.0 * cpu_err + 1e-6, f"{codec_id} {dtype}: {gpu_err} vs cpu {cpu_err}"
    assert gpu_err >= 0.5 * cpu_err - 1e-6, f"{codec_id} {dtype}: {gpu_err} vs cpu {cpu_err}"
    # Deterministic codecs give the same bits (top-k only in fp32: 16-bit inputs have ties
    # in magnitude, which CPU and GPU break differently).
    if codec_id in ("fp16", "bf16") or (codec_id == "topk" and dtype == torch.float32):
        assert torch.equal(gpu_out.cpu(), cpu_out), codec_id


@pytest.mark.parametrize("codec_id", commpress.codec_ids())
def test_simulated_aggregation_on_the_gpu(codec_id: str) -> None:
    codec = commpress.get_codec(codec_id)
    inputs = [gaussian(64 * 96, seed=10 + r).reshape(64, 96) for r in range(4)]
    exact = torch.stack(inputs).sum(0)
    errors = {}
    for device in ("cpu", "cuda"):
        sim = simulate(codec, [t.to(device) for t in inputs], step=2)
        assert all(t.device.type == device for t in sim.totals), codec_id
        for t in sim.totals[1:]:
            assert torch.equal(t, sim.totals[0]), f"{codec_id}: workers differ on {device}"
        errors[device] = nmse(sim.totals[0].cpu(), exact)
    assert errors["cuda"] <= 2.0 * errors["cpu"] + 1e-6, (codec_id, errors)


def _int_valued(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-4, 5, (n,), generator=g).float()


def _collectives_worker(rank: int, world: int, backend: str) -> dict[str, Any]:
    device = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {}
    xs = [_int_valued(r, 1001) for r in range(world)]
    exact = torch.stack(xs).sum(0)
    # Hierarchical layouts: one rank per node (the compressed inter-node exchange) and all
    # ranks on one node (the intra-node reduce-scatter and all-gather).
    layouts = {(s, 1) for s in STRATEGIES} | {(s, world) for s in STRATEGIES if "hier" in s}
    for strategy, local_size in sorted(layouts):
        for codec in ("identity", "fp16", "netzip"):
            for bucket in (None, 1024):
                name = f"{codec}/{strategy}/{local_size}/{bucket}"
                got = commpress.all_reduce(
                    xs[rank].to(device),
                    codec,
                    op="sum",
                    strategy=strategy,  # type: ignore[arg-type]
                    key=name,
                    bucket_bytes=bucket,
                    local_size=local_size,
                )
                assert got.device == device, f"{name}: result on {got.device}"
                assert torch.equal(got.cpu(), exact), f"{name}: not the exact sum"
                out[name] = got.cpu()
    # Lossy and multi-round codecs: identical on every rank, close to the mean.
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 96, generator=g).to(device)
    for codec in ("qsgd", "topk:ratio=0.1", "powersgd:rank=4", "thc", "topkc", "terngrad"):
        for offload in (False, True):
            name = f"{codec}/offload={offload}"
            got = commpress.all_reduce(x, codec, key=name, step=1, offload=offload)
            assert got.device == device and got.shape == x.shape, name
            out[name] = got.cpu()
    # Activations: compressed point-to-point between ranks 0 and 1.
    if world >= 2 and rank < 2:
        act = torch.randn(8, 33, 17, generator=torch.Generator().manual_seed(7)).to(device)
        for codec in (None, "fp16"):
            if rank == 0:
                commpress.send(act.to(torch.bfloat16), 1, codec, key="act")
            else:
                got = commpress.recv(0, codec, key="act", device=device)
                assert got.device == device, got.device
                if codec is None:
                    assert torch.equal(got.cpu(), act.to(torch.bfloat16).cpu())
                out[f"p2p/{codec}"] = got.cpu()
    return out


def _ddp_worker(rank: int, world: int, backend: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {}
    for codec in ("fp16", "powersgd:rank=2", "topk:ratio=0.1", "netzip"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        ).to(device)
        ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=0.01)
        commpress.ddp.register(ddp, codec)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(100 + rank)
        xb = torch.randn(16, 32, generator=g).to(device)
        yb = torch.randn(16, 4, generator=g).to(device)
        losses = []
        for _ in range(6):  # one fixed batch per rank: the loss must fall
            loss = torch.nn.functional.mse_loss(ddp(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
        assert torch.isfinite(flat).all(), codec
        out[codec] = (flat, losses)
    return out


def _run(fn: Any, world: int, backend: str) -> list[dict[str, Any]]:
    return run_workers(
        fn, world, backend, backend=backend, env={"CUDA_TEST_DEVICE": "1"}, timeout=300
    )


def _assert_identical(results: list[dict[str, Any]]) -> None:
    for rank in range(1, len(results)):
        for name, value in results[0].items():
            if name.startswith("p2p/"):
                continue
            other = results[rank][name]
            a, b = (value[0], other[0]) if isinstance(value, tuple) else (value, other)
            assert torch.equal(a, b), f"{name}: rank {rank} differs from rank 0"


def _backends() -> list[Any]:
    nccl_ok = torch.distributed.is_nccl_available() if torch.cuda.is_available() else False
    return [
        pytest.param("gloo", 2, id="gloo-2ranks"),
        pytest.param(
            "nccl",
            1,
            id="nccl-1rank",
            marks=pytest.mark.skipif(not nccl_ok, reason="this PyTorch has no NCCL"),
        ),
        pytest.param(
            "nccl",
            2,
            id="nccl-2ranks",
            marks=pytest.mark.skipif(
                GPU_COUNT < 2 or not nccl_ok, reason="NCCL needs one GPU per rank (2 GPUs)"
            ),
        ),
    ]


@pytest.mark.parametrize(("backend", "world"), _backends())
def test_collectives_with_cuda_tensors(backend: str, world: int) -> None:
    results = _run(_collectives_worker, world, backend)
    _assert_identical(results)
    if world >= 2:
        assert "p2p/None" in results[1] and "p2p/fp16" in results[1]


@pytest.mark.parametrize(("backend", "world"), _backends())
def test_ddp_hook_on_the_gpu_keeps_replicas_identical(backend: str, world: int) -> None:
    results = _run(_ddp_worker, world, backend)
    _assert_identical(results)
    for codec, (_, losses) in results[0].items():
        assert losses[-1] < losses[0], f"{codec}: loss did not fall {losses}"
