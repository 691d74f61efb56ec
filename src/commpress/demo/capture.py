"""Capture real gradients and activations from the built-in workload, for offline study.

Codec benchmarks on Gaussian noise can mislead: real gradients are heavy-tailed and their
statistics drift as training proceeds (large and structured in the first steps of
pretraining from scratch, smaller and noisier later), and the exponent bytes of bf16
activations and gradients are far more compressible than their mantissas. ``capture`` trains
the tiny GPT from scratch and, at chosen steps, saves:

* ``grads``: every parameter's gradient after backward (what data-parallel training
  all-reduces), named like the parameter (``blocks.0.attn.qkv.weight``);
* ``acts``: the output of the embedding (``embed``) and of every block (``blocks.3``), the
  tensors that cross pipeline-stage boundaries in the forward pass, shape ``(B, T, d_model)``;
* ``act_grads``: the gradient of the loss with respect to each of those outputs (what crosses
  the boundary in the backward pass), with the same names and shapes.

Training itself runs in fp32. Each kind is written once per dtype as
``DIR/{kind}_step{NNNN}_{dtype}.safetensors`` with ``dtype`` in ``bf16``, ``fp16``, ``fp32``;
the half-precision files are round-to-nearest casts of the fp32 tensors (what a bf16/fp16
all-reduce or activation send would put on the wire; fp16 values below ~6e-8 flush to zero,
as they would without loss scaling). ``DIR/index.json`` lists every file with its kind,
step, phase, dtype and tensor shapes, plus the model configuration and the loss at each step.
Read it back with :func:`read_index` and :func:`load_capture`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from commpress.demo.data import batches, stdlib_corpus
from commpress.demo.model import GPTConfig, TinyGPT, build_model
from commpress.demo.train import DEFAULT_CORPUS_BYTES, lr_at, make_optimizer
from commpress.errors import CommpressError, error_context

INDEX_NAME = "index.json"
INDEX_FORMAT = "commpress-capture"
INDEX_VERSION = 1
KINDS = ("grads", "acts", "act_grads")
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
#: Default capture points: the first steps of pretraining from scratch, and three steps after
#: 300 more, when the loss has left its initial plateau. The whole default capture (tiny
#: model, batch 16) takes ~15 s on 2 CPU cores.
DEFAULT_EARLY = (0, 1, 2)
DEFAULT_LATE = (300, 301, 302)


def file_name(kind: str, step: int, dtype: str) -> str:
    """``"{kind}_step{step:04d}_{dtype}.safetensors"``."""
    return f"{kind}_step{step:04d}_{dtype}.safetensors"


class _ActivationRecorder:
    """Forward hooks on the embedding and every block that keep the output and, through a
    tensor hook, the gradient flowing back into it. Active only while ``armed``."""

    def __init__(self, model: TinyGPT) -> None:
        self.armed = False
        self.acts: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        named: list[tuple[str, nn.Module]] = [("embed", model.embedding)]
        named += [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in named]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if not self.armed:
                return
            self.acts[name] = output.detach().clone()

            def keep_grad(grad: torch.Tensor) -> None:
                self.grads[name] = grad.detach().clone()

            if output.requires_grad:
                output.register_hook(keep_grad)

        return hook

    def take(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        acts = self.acts
        grads = {n: self.grads[n] for n in acts if n in self.grads}  # depth order, not backward
        self.acts, self.grads = {}, {}
        return acts, grads

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _parse_steps(steps: Sequence[int], what: str) -> list[int]:
    out = []
    for s in steps:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise CommpressError(f"{what} steps must be non-negative ints, got {s!r}")
        out.append(s)
    return sorted(set(out))


def capture(
    out_dir: str | Path,
    *,
    config: GPTConfig | None = None,
    early: Sequence[int] = DEFAULT_EARLY,
    late: Sequence[int] = DEFAULT_LATE,
    batch_size: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    warmup: int = 0,
    grad_clip: float | None = 1.0,
    dtypes: Sequence[str] = ("bf16", "fp16", "fp32"),
    kinds: Sequence[str] = KINDS,
    corpus: bytes | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Train from scratch for ``max(early + late) + 1`` steps and save tensors at those steps.

    Algorithm:

    1. Build the model (:func:`~commpress.demo.model.build_model` with ``seed``) and the same
       AdamW optimizer and data order as :func:`~commpress.demo.train.train`.
    2. For every step: forward and backward; at a capture step, the forward hooks keep the
       embedding and block outputs, tensor hooks keep their gradients, and after backward
       every parameter's gradient is copied (before clipping, i.e. as DDP would send it).
    3. Clip, take the optimizer step. Captured tensors are written at once, in each dtype,
       so memory holds one step at a time.
    4. Write ``index.json`` and return its content.

    Args:
        out_dir: output directory (created; existing capture files in it are overwritten).
        config: model shape (default: the tiny :class:`GPTConfig`); see ``PRESETS`` in
            :mod:`commpress.demo.model` for bigger ones.
        early, late: steps to capture (0-based, counted before their optimizer step),
            labelled ``"early"`` and ``"late"`` in the index. Late steps around a few hundred
            show gradients after the initial loss drop; push them further (and expect
            proportionally longer runs) to study later training.
        batch_size: rows per step (one process). Activations hold ``batch_size * context *
            d_model`` values per block.
        lr, seed, warmup, grad_clip: as in :func:`~commpress.demo.train.train`.
        dtypes: any of ``"bf16"``, ``"fp16"``, ``"fp32"``.
        kinds: any of ``"grads"``, ``"acts"``, ``"act_grads"``.
        corpus: training text (default ``stdlib_corpus(DEFAULT_CORPUS_BYTES)``).
        device: where to train (default CPU; ``"cuda"`` for bigger presets).
        progress: show a tqdm bar.
    """
    config = config if config is not None else GPTConfig()
    early_steps = _parse_steps(early, "early")
    late_steps = _parse_steps(late, "late")
    steps = sorted(set(early_steps) | set(late_steps))
    if not steps:
        raise CommpressError("nothing to capture: give at least one early or late step")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise CommpressError(f"dtypes must be a non-empty subset of {list(DTYPES)}, got "
                             f"{list(dtypes)}")
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise CommpressError(f"kinds must be a non-empty subset of {list(KINDS)}, got "
                             f"{list(kinds)}")
    out = Path(out_dir)
    with error_context(f"creating capture directory {str(out)!r}"):
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CommpressError(str(exc)) from exc
    device = torch.device(device) if device is not None else torch.device("cpu")
    corpus = corpus if corpus is not None else stdlib_corpus(DEFAULT_CORPUS_BYTES)

    model = build_model(config, seed=seed, device=device)
    optimizer = make_optimizer(model, lr)
    data = batches(corpus, batch_size=batch_size, context=config.context, seed=seed,
                   device=device)
    recorder = _ActivationRecorder(model)
    wanted = set(steps)
    files: list[dict[str, Any]] = []
    losses: dict[str, float] = {}
    total = steps[-1] + 1
    t0 = time.perf_counter()
    bar: Any = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="capture", unit="step")
    try:
        model.train()
        for step in range(total):
            x, y = next(data)
            recorder.armed = step in wanted
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, lr, warmup)
            loss = model.loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            recorder.armed = False
            if step in wanted:
                value = float(loss.detach())
                losses[str(step)] = value
                acts, act_grads = recorder.take()
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                         if p.grad is not None}
                groups = {"grads": grads, "acts": acts, "act_grads": act_grads}
                phase = "early" if step in early_steps else "late"
                for kind in kinds:
                    for dt in dtypes:
                        files.append(_write(out, kind, step, phase, dt, groups[kind]))
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step()
            if bar is not None:
                bar.update(1)
    finally:
        recorder.remove()
        if bar is not None:
            bar.close()
    index: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "model": config.to_dict(),
        "n_parameters": model.num_parameters(),
        "training": {
            "batch_size": batch_size, "lr": lr, "seed": seed, "warmup": warmup,
            "grad_clip": grad_clip, "optimizer": "AdamW(betas=(0.9, 0.95), wd=0.1)",
            "corpus_bytes": len(corpus), "steps_run": total, "device": str(device),
        },
        "steps": {"early": early_steps, "late": late_steps},
        "dtypes": list(dtypes),
        "kinds": list(kinds),
        "loss": losses,
        "seconds": round(time.perf_counter() - t0, 3),
        "files": files,
    }
    with error_context(f"writing {str(out / INDEX_NAME)!r}"):
        try:
            (out / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
        except OSError as exc:
            raise CommpressError(str(exc)) from exc
    return index


def _write(out: Path, kind: str, step: int, phase: str, dtype: str,
           tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    name = file_name(kind, step, dtype)
    cast = {n: t.to(DTYPES[dtype]).contiguous().cpu() for n, t in tensors.items()}
    with error_context(f"writing {str(out / name)!r}"):
        try:
            save_file(cast, str(out / name), metadata={
                "kind": kind, "step": str(step), "phase": phase, "dtype": dtype,
            })
        except OSError as exc:
            raise CommpressError(str(exc)) from exc
    return {
        "file": name, "kind": kind, "step": step, "phase": phase, "dtype": dtype,
        "tensors": {n: list(t.shape) for n, t in cast.items()},
        "numel": sum(t.numel() for t in cast.values()),
        "nbytes": sum(t.numel() * t.element_size() for t in cast.values()),
    }


def read_index(directory: str | Path) -> dict[str, Any]:
    """The ``index.json`` of a capture directory, checked for format and version."""
    path = Path(directory) / INDEX_NAME
    if not path.is_file():
        raise CommpressError(f"{str(path)!r} not found: run `commpress capture --out "
                             f"{directory}` first")
    with error_context(f"reading {str(path)!r}"):
        index = json.loads(path.read_text())
    if index.get("format") != INDEX_FORMAT or index.get("version") != INDEX_VERSION:
        raise CommpressError(f"{str(path)!r} is not a commpress capture index (format "
                             f"{INDEX_FORMAT!r} version {INDEX_VERSION})")
    return index


def load_capture(
    directory: str | Path, *, kind: str, step: int, dtype: str = "bf16"
) -> dict[str, torch.Tensor]:
    """The named tensors of one captured file, e.g. ``load_capture(d, kind="grads", step=0)``.

    Tensors come back on CPU in the file's dtype, in the order the index lists them (the
    model's parameter order, or embed then blocks in depth order).
    """
    index = read_index(directory)
    for entry in index["files"]:
        if (entry["kind"], entry["step"], entry["dtype"]) == (kind, step, dtype):
            with error_context(f"loading {entry['file']!r}"):
                loaded = load_file(str(Path(directory) / entry["file"]))
            return {n: loaded[n] for n in entry["tensors"]}
    have = sorted({(e["kind"], e["step"], e["dtype"]) for e in index["files"]})
    raise CommpressError(f"no captured file for kind={kind!r} step={step} dtype={dtype!r}; "
                         f"available (kind, step, dtype): {have}")
