"""Training data for the built-in workload: the Python standard library's own source code.

The corpus needs no download and is the same on every machine that runs the same Python
version, which makes the demo reproducible offline. Text is modelled at the byte level
(vocabulary 256), so there is no tokenizer to ship.

Split. The corpus is cut once: the first ``1 - VAL_FRACTION`` of its bytes are the training
split and the rest is the validation split. Because files are concatenated in sorted path order,
the validation split holds whole modules the model never trains on.

Batches. Step ``s`` of a run with seed ``seed`` draws ``batch_size`` window offsets from a
generator seeded with ``(seed, s)``; every rank draws the *same* global batch and keeps rows
``[rank * b, (rank + 1) * b)`` with ``b = batch_size // world_size``. Ranks therefore see
distinct data, and the union over ranks is exactly the single-process batch of the same seed.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from commpress.errors import CommpressError

#: Fraction of the corpus (its tail) held out for validation.
VAL_FRACTION = 0.1
#: Put between files so the model can tell where one module ends and the next begins.
FILE_SEPARATOR = b"\n\x00\n"
#: Top-level stdlib entries left out: third-party packages, the huge regression-test suite
#: (with deliberately odd encodings), and build-machine specific files.
_EXCLUDED_TOP = ("site-packages", "dist-packages", "test", "__pycache__")
_EXCLUDED_PREFIX = ("config-", "_sysconfigdata")
SPLITS = ("train", "val")


def _stdlib_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        if rel == Path("."):
            dirnames[:] = [
                d for d in dirnames
                if d not in _EXCLUDED_TOP and not d.startswith(_EXCLUDED_PREFIX)
            ]
        else:
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            if name.endswith(".py") and not name.startswith(_EXCLUDED_PREFIX):
                files.append(rel / name)
    # Sort by POSIX path string so the order does not depend on os.walk or the platform.
    return sorted(files, key=lambda p: p.as_posix())


@functools.lru_cache(maxsize=8)
def stdlib_corpus(max_bytes: int | None = None) -> bytes:
    """The text of the standard library's ``.py`` files, concatenated in sorted path order.

    Deterministic for a given Python installation and needs no network. Files are separated by
    :data:`FILE_SEPARATOR`. The result is cached, so repeated calls are free.

    Args:
        max_bytes: stop reading once this many bytes are collected and truncate to exactly
            ``max_bytes``. ``None`` reads everything (about 15 MB for CPython 3.11 without
            its ``test`` package). Small values (a few hundred KB) are plenty for tests and
            short demos and read much faster.
    """
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise CommpressError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CommpressError(f"the standard library directory {str(root)!r} does not exist")
    chunks: list[bytes] = []
    total = 0
    for rel in _stdlib_files(root):
        try:
            data = (root / rel).read_bytes()
        except OSError:  # unreadable file (permissions, broken link): skip, stay deterministic
            continue
        chunks.append(data)
        chunks.append(FILE_SEPARATOR)
        total += len(data) + len(FILE_SEPARATOR)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = b"".join(chunks)
    if max_bytes is not None:
        corpus = corpus[:max_bytes]
    if len(corpus) == 0:
        raise CommpressError(f"no .py files found under {str(root)!r}")
    return corpus


def split_corpus(corpus: bytes, split: str) -> bytes:
    """The ``"train"`` (head) or ``"val"`` (tail, :data:`VAL_FRACTION`) part of ``corpus``."""
    if split not in SPLITS:
        raise CommpressError(f"split must be one of {SPLITS}, got {split!r}")
    cut = len(corpus) - int(len(corpus) * VAL_FRACTION)
    return corpus[:cut] if split == "train" else corpus[cut:]


@functools.lru_cache(maxsize=8)
def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def batches(
    corpus: bytes,
    *,
    batch_size: int,
    context: int,
    seed: int,
    split: str = "train",
    rank: int = 0,
    world_size: int = 1,
    start_step: int = 0,
    device: torch.device | str | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless ``(inputs, targets)`` batches of byte tokens for next-byte prediction.

    Algorithm, for step ``s = start_step, start_step + 1, ...``:

    1. Seed a CPU generator with ``(seed, s)`` and draw ``batch_size`` window starts uniformly
       from the chosen split (the same global batch on every rank).
    2. Keep this rank's rows ``[rank * b, (rank + 1) * b)``, ``b = batch_size // world_size``.
    3. Gather ``context + 1`` bytes per row; inputs are the first ``context``, targets the
       last ``context`` (shifted by one). Both are ``int64`` of shape ``(b, context)``.

    Args:
        corpus: bytes from :func:`stdlib_corpus` (or any bytes).
        batch_size: the *global* batch (rows summed over all ranks); must be a multiple of
            ``world_size``. Larger batches lower gradient noise; on 2 CPU cores 8 to 32 rows
            of 64 bytes keep a step well under 0.1 s for the default model.
        context: tokens per row; must not exceed the model's ``GPTConfig.context``.
        seed: data-order seed. Keep it equal on all ranks, or the shards overlap.
        split: ``"train"`` or ``"val"`` (see :func:`split_corpus`).
        rank, world_size: this worker's shard of every step's batch.
        start_step: the step to start at, to resume a run with identical data.
        device: where to put the batches (``None``: CPU). Sampling happens on CPU so the data
            order is identical on every device type.
    """
    for name, value in (("batch_size", batch_size), ("context", context),
                        ("world_size", world_size)):
        if not isinstance(value, int) or value <= 0:
            raise CommpressError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise CommpressError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
    if batch_size % world_size != 0:
        raise CommpressError(
            f"batch_size ({batch_size}) must be a multiple of world_size ({world_size}): "
            "it is the global batch, split evenly across ranks"
        )
    data = _as_tensor(split_corpus(corpus, split))
    n_starts = data.numel() - context
    if n_starts < 1:
        raise CommpressError(
            f"the {split!r} split has {data.numel()} bytes, fewer than context + 1 = "
            f"{context + 1}; pass a larger corpus (stdlib_corpus(max_bytes=...))"
        )
    per_rank = batch_size // world_size
    offsets = torch.arange(context + 1)
    step = start_step
    while True:
        g = torch.Generator().manual_seed(_mix(seed, step))
        starts = torch.randint(0, n_starts, (batch_size,), generator=g)
        mine = starts[rank * per_rank:(rank + 1) * per_rank]
        window = data[mine[:, None] + offsets].long()
        if device is not None:
            window = window.to(device)
        yield window[:, :-1], window[:, 1:]
        step += 1


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed from ``(seed, step)`` that differs for every pair in practice."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


@torch.no_grad()
def eval_loss(
    model: nn.Module,
    corpus: bytes,
    *,
    context: int,
    batch_size: int = 16,
    n_batches: int = 4,
    seed: int = 12345,
    split: str = "val",
    device: torch.device | str | None = None,
) -> float:
    """Mean next-byte cross-entropy (nats per byte) of ``model`` on fixed validation windows.

    The windows depend only on ``seed``, so two evaluations of the same weights agree exactly
    and evaluations across training are comparable. The model is put in eval mode for the
    call and its previous mode is restored.

    Args:
        model: anything mapping ``(B, T)`` int64 tokens to ``(B, T, 256)`` logits (a
            :class:`~commpress.demo.model.TinyGPT`, or a DDP wrapper of one).
        context: window length. Use the model's context.
        batch_size, n_batches: ``batch_size * n_batches`` windows are scored. The standard
            error of the estimate shrinks like ``1 / sqrt(batch_size * n_batches * context)``
            (roughly, windows overlap little); 64 windows of 64 bytes give about +-0.02 nats.
        device: where to run (``None``: the device of the model's first parameter).
    """
    if device is None:
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        it = batches(corpus, batch_size=batch_size, context=context, seed=seed, split=split,
                     device=device)
        for _ in range(n_batches):
            x, y = next(it)
            logits = model(x)
            total += float(nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)))
        return total / n_batches
    finally:
        model.train(was_training)
