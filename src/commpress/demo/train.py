"""A plain training loop for :class:`~commpress.demo.model.TinyGPT`, single-process or DDP.

Use it from Python::

    from commpress.demo.train import train
    result = train(steps=200, batch_size=16, lr=3e-3)
    print(result.losses[-1], result.eval_loss)

or under torchrun (gloo on CPU, nccl on CUDA; one process per GPU)::

    torchrun --nproc_per_node 2 -m commpress.demo.train --steps 200 --batch-size 32

Under an initialized ``torch.distributed`` process group the model is wrapped in
``DistributedDataParallel`` and ``ddp_hook(ddp_model)`` may register a communication hook
(for example a commpress codec hook), which is how compression is exercised end to end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from commpress.demo.data import batches, eval_loss, stdlib_corpus
from commpress.demo.model import GPTConfig, TinyGPT, build_model, preset
from commpress.errors import CommpressError, exit_status

#: Corpus size used when ``train`` is not given one: 2 MB reads in well under a second and is
#: far more text than a short demo run sees (200 steps x 16 rows x 64 bytes = 0.2 MB).
DEFAULT_CORPUS_BYTES = 2_000_000


@dataclass
class TrainResult:
    """What :func:`train` measured.

    Attributes:
        losses: training loss of every step (this rank's shard of the batch, before the
            optimizer step).
        step_times: wall-clock seconds of every step (forward, backward, communication,
            optimizer), with the device synchronized at both ends.
        eval_losses: ``(step, validation loss)`` pairs; ``step`` counts optimizer steps done.
        eval_loss: the validation loss after the last step (``None`` if ``eval_batches=0``).
        config: the model configuration.
        world_size, rank: the process group the run used (1, 0 without one).
        model: the trained (unwrapped) model.
    """

    losses: list[float]
    step_times: list[float]
    eval_losses: list[tuple[int, float]]
    eval_loss: float | None
    config: GPTConfig
    world_size: int = 1
    rank: int = 0
    model: TinyGPT | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (everything but the model)."""
        return {
            "losses": self.losses,
            "step_times": self.step_times,
            "eval_losses": [list(p) for p in self.eval_losses],
            "eval_loss": self.eval_loss,
            "config": self.config.to_dict(),
            "world_size": self.world_size,
            "rank": self.rank,
        }


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float = 0.1
) -> torch.optim.AdamW:
    """AdamW with betas (0.9, 0.95) and decoupled weight decay on parameters of 2 or more
    dimensions (linear weights and embedding tables), none on biases and LayerNorm gains."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def lr_at(step: int, lr: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then constant."""
    if warmup <= 0 or step >= warmup:
        return lr
    return lr * (step + 1) / warmup


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    config: GPTConfig | None = None,
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    ddp_hook: Callable[[nn.Module], Any] | None = None,
    log_every: int = 0,
    eval_every: int = 0,
    eval_batches: int = 4,
    grad_clip: float | None = 1.0,
    warmup: int = 0,
    weight_decay: float = 0.1,
    corpus: bytes | None = None,
    device: torch.device | str | None = None,
    progress: bool | None = None,
    on_step: Callable[[int, TinyGPT, float], None] | None = None,
    stop: Callable[[list[tuple[int, float]]], bool] | None = None,
) -> TrainResult:
    """Train a fresh :func:`build_model` ``(config, seed)`` for ``steps`` AdamW steps.

    Algorithm, per step ``s``:

    1. Take this rank's shard of the global batch ``s`` (:func:`~commpress.demo.data.batches`
       with ``seed``), run forward and the cross-entropy loss.
    2. Backward. Under DDP, gradients are averaged across ranks during backward (through
       ``ddp_hook``'s communication hook if one was registered).
    3. Clip the global gradient norm to ``grad_clip`` (if set), apply the warm-up learning
       rate, take the AdamW step, record loss and wall-clock time.
    4. Every ``eval_every`` steps (and after the last) compute the validation loss.

    Args:
        config: model shape (default :class:`GPTConfig`).
        steps: optimizer steps to take.
        batch_size: *global* rows per step, split evenly across ranks (must be a multiple of
            the world size). 16 rows of 64 bytes make ~40 ms steps for the default model on 2
            CPU cores; scale up on GPUs.
        lr: peak learning rate. 3e-3 suits the tiny model; use ~1e-3 for "small"/"medium".
        seed: seeds both the weights and the data order (identical on every rank).
        ddp_hook: called once with the ``DistributedDataParallel`` model, typically to call
            ``register_comm_hook``. Needs an initialized process group.
        log_every: print a line every this many steps on rank 0 (0: never).
        eval_every: validation every this many steps (0: only after the last step).
        eval_batches: batches of ``batch_size`` windows per validation (0: no validation).
        grad_clip: max global gradient norm (``None``: no clipping). 1.0 guards the first
            steps of from-scratch training against spikes.
        warmup: steps of linear learning-rate warm-up (0: none).
        weight_decay: AdamW decoupled weight decay on matrices.
        corpus: training text (default ``stdlib_corpus(DEFAULT_CORPUS_BYTES)``).
        device: default ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.
        progress: tqdm bar on rank 0; ``None`` shows one for runs of 100 steps or more.
        on_step: called as ``on_step(step, model, loss)`` after each optimizer step (for
            example to snapshot weights). ``model`` is the unwrapped model.
        stop: called with the ``(step, eval loss)`` pairs so far after every evaluation;
            ``True`` ends training there (early stopping; the last evaluation is then the
            final one). Under DDP it must decide the same on every rank (eval losses are
            computed from identical replicas on identical windows, so a rule of them does).
    """
    config = config if config is not None else GPTConfig()
    if not isinstance(steps, int) or steps < 0:
        raise CommpressError(f"steps must be a non-negative int, got {steps!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise CommpressError(f"lr must be a positive finite number, got {lr!r}")
    if grad_clip is not None and not grad_clip > 0:
        raise CommpressError(f"grad_clip must be positive or None, got {grad_clip!r}")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1
    if ddp_hook is not None and not distributed:
        raise CommpressError(
            "ddp_hook needs an initialized torch.distributed process group: run under "
            "torchrun, or call torch.distributed.init_process_group first"
        )
    if device is None:
        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    corpus = corpus if corpus is not None else stdlib_corpus(DEFAULT_CORPUS_BYTES)

    model = build_model(config, seed=seed, device=device)
    runner: nn.Module = model
    if distributed:
        ids = [device.index] if device.type == "cuda" else None
        runner = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if ddp_hook is not None:
            ddp_hook(runner)
    optimizer = make_optimizer(model, lr, weight_decay)
    data = batches(corpus, batch_size=batch_size, context=config.context, seed=seed,
                   rank=rank, world_size=world_size, device=device)

    show_bar = (rank == 0) and (progress if progress is not None else steps >= 100)
    bar_ctx: Any = contextlib.nullcontext()
    if show_bar:
        from tqdm.auto import tqdm

        bar_ctx = tqdm(total=steps, desc="train", unit="step", file=sys.stderr)

    def evaluate() -> float:
        return eval_loss(model, corpus, context=config.context, batch_size=batch_size,
                         n_batches=eval_batches, device=device)

    losses: list[float] = []
    times: list[float] = []
    evals: list[tuple[int, float]] = []
    stopped = False
    model.train()
    with bar_ctx as bar:
        for step in range(steps):
            x, y = next(data)
            _sync(device)
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, lr, warmup)
            loss = model.loss(runner(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            value = float(loss.detach())  # synchronizes the device
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(value)
            if not math.isfinite(value):
                raise CommpressError(
                    f"training diverged at step {step}: loss is {value}; lower lr ({lr}) or "
                    "enable grad_clip"
                )
            if on_step is not None:
                on_step(step, model, value)
            if eval_every and eval_batches and (step + 1) % eval_every == 0 and step + 1 < steps:
                evals.append((step + 1, evaluate()))
                if stop is not None and stop(list(evals)):
                    stopped = True
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}")
            if log_every and rank == 0 and (step + 1) % log_every == 0:
                print(f"step {step + 1:5d}  loss {value:.4f}  {times[-1] * 1e3:.1f} ms",
                      file=sys.stderr if show_bar else sys.stdout)
            if stopped:
                break
    if stopped:
        final: float | None = evals[-1][1]
    else:
        final = evaluate() if eval_batches else None
        if final is not None:
            evals.append((len(losses), final))
    return TrainResult(
        losses=losses, step_times=times, eval_losses=evals, eval_loss=final, config=config,
        world_size=world_size, rank=rank, model=model,
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m commpress.demo.train",
        description="Train the built-in tiny GPT on the Python standard library's source. "
        "Runs single-process, or data-parallel under torchrun (reads RANK, WORLD_SIZE, "
        "LOCAL_RANK; gloo on CPU, nccl on CUDA).",
    )
    p.add_argument("--model", default="tiny", help="size preset: tiny, small or medium")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="global rows per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES)
    p.add_argument("--device", default=None, help="default: cuda:LOCAL_RANK if available")
    p.add_argument("--json", default=None, help="write rank 0's TrainResult summary here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m commpress.demo.train`` (torchrun-compatible)."""
    args = _parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    started_group = False
    if world_size > 1 and not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and args.device in (None, "cuda")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
        started_group = True
    try:
        result = train(
            preset(args.model), steps=args.steps, batch_size=args.batch_size, lr=args.lr,
            seed=args.seed, warmup=args.warmup, grad_clip=args.grad_clip or None,
            eval_every=args.eval_every, log_every=args.log_every,
            corpus=stdlib_corpus(args.corpus_bytes), device=args.device,
        )
        if result.rank == 0:
            mean_ms = 1e3 * sum(result.step_times) / max(1, len(result.step_times))
            last = result.losses[-1] if result.losses else float("nan")
            print(f"done: {args.steps} steps on {result.world_size} rank(s), final train loss "
                  f"{last:.4f}, eval loss {result.eval_loss}, mean step {mean_ms:.1f} ms")
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(result.to_dict(), fh, indent=1)
    finally:
        if started_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
