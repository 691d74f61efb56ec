"""Real models for the performance model: parameter names, shapes and dtypes.

Wire sizes depend on shapes (PowerSGD compresses a ``(4096, 4096)`` matrix 512-fold at rank 4
and sends a bias as it is), so the model is best described by its real parameters. A
:class:`ModelShapes` comes from

* an ``nn.Module`` (:func:`shapes_of_module`), or a function that builds one,
  ``"pkg.module:build"`` or ``"path/to/file.py:build"`` (:func:`shapes_from_callable`): the
  function is called under ``torch.device("meta")``, so parameters have shapes but no
  storage and a 70B model costs nothing;
* a Hugging Face config (:func:`shapes_from_hf_config`): a ``config.json`` file, a directory
  holding one, or a model name already in the local cache (offline, ``local_files_only``);
  the model class named in the config's ``architectures`` (else ``AutoModel``) is built with
  ``from_config`` on the meta device. Needs ``transformers`` (``pip install
  commpress[models]``);
* a shapes file (:func:`shapes_from_file`): JSON (a list of ``{"name", "shape", "dtype"}``
  objects, or an object mapping names to shapes) or CSV (columns ``name,shape[,dtype]``,
  shapes written ``64x3x3x3``, ``[64, 3, 3, 3]`` or ``64 3 3 3``; ``[]`` for a 0-d tensor).

Every parameter that requires a gradient is kept, in ``parameters()`` order, with its shape as
it is (4-D convolution kernels, embeddings, norms, biases); :meth:`ModelShapes.workload`
groups them into DDP's buckets (:func:`~commpress.perfmodel.model.ddp_bucket_indices`). Nothing
here runs a training step.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import io
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commpress.errors import ConfigError
from commpress.perfmodel.model import (
    DDP_BUCKET_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    Workload,
    ddp_bucket_indices,
)

#: Parameter dtypes accepted in shapes files, with their bytes per element.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4, "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2, "float64": 8, "fp64": 8, "double": 8,
}
_CANONICAL = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
              "bf16": "bfloat16", "fp64": "float64", "double": "float64"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamShape:
    """One parameter: its name, shape (``()`` for a scalar) and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"a parameter needs a non-empty name, got {self.name!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                   for d in self.shape):
            raise ConfigError(
                f"parameter {self.name!r}: shape must be non-negative integers, got "
                f"{self.shape!r}"
            )
        dtype = self.dtype.replace("torch.", "")
        if dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"parameter {self.name!r}: unknown dtype {self.dtype!r}; accepted: "
                f"{', '.join(sorted(DTYPE_BYTES))}"
            )
        object.__setattr__(self, "dtype", _CANONICAL.get(dtype, dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def element_size(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """A model's trainable parameters, in ``parameters()`` order."""

    name: str
    params: tuple[ParamShape, ...]

    def __post_init__(self) -> None:
        if not self.params:
            raise ConfigError(f"model {self.name!r} has no parameters that require gradients")
        seen: set[str] = set()
        for p in self.params:
            if p.name in seen:
                raise ConfigError(f"model {self.name!r}: parameter {p.name!r} listed twice")
            seen.add(p.name)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [p.shape for p in self.params]

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element: the parameters' dtype (the widest when mixed)."""
        return max(p.element_size for p in self.params)

    def bucket_indices(
        self, *, grad_bytes: int | None = None, bucket_bytes: float = DDP_BUCKET_BYTES,
        first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
    ) -> list[list[int]]:
        """DDP's buckets as indices into :attr:`params`, in the order they become ready."""
        return ddp_bucket_indices(self.shapes, grad_bytes=grad_bytes or self.grad_bytes,
                                  bucket_bytes=bucket_bytes,
                                  first_bucket_bytes=first_bucket_bytes)

    def bucket_names(self, **kwargs: Any) -> list[list[str]]:
        """Parameter names per DDP bucket (see :meth:`bucket_indices`)."""
        return [[self.params[i].name for i in b] for b in self.bucket_indices(**kwargs)]

    def workload(self, *, compute_s: float, grad_bytes: int | None = None,
                 **kwargs: Any) -> Workload:
        """:meth:`Workload.from_shapes` of these shapes (``grad_bytes``: the parameters'
        dtype unless given)."""
        kwargs.setdefault("name", self.name)
        return Workload.from_shapes(self.shapes, compute_s=compute_s,
                                    grad_bytes=grad_bytes or self.grad_bytes, **kwargs)

    def summary(self) -> dict[str, Any]:
        """Counts by kind of shape (what a codec treats differently)."""
        kinds: dict[str, int] = {}
        for p in self.params:
            kind = {0: "scalars", 1: "vectors", 2: "matrices"}.get(len(p.shape), "tensors")
            kinds[kind] = kinds.get(kind, 0) + 1
        return {"name": self.name, "parameters": len(self.params), "elements": self.numel,
                **kinds}

    def to_records(self) -> list[dict[str, Any]]:
        """JSON-ready records, the format :func:`shapes_from_file` reads."""
        return [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype}
                for p in self.params]


# ---------------------------------------------------------------------------- modules
def shapes_of_module(module: Any, *, name: str | None = None) -> ModelShapes:
    """The trainable parameters of an ``nn.Module`` (or of the module inside a
    ``DistributedDataParallel``), on any device, meta included."""
    import torch

    inner = getattr(module, "module", module) if isinstance(
        module, torch.nn.parallel.DistributedDataParallel) else module
    if not isinstance(inner, torch.nn.Module):
        raise ConfigError(f"expected an nn.Module, got {type(module).__name__}")
    params = tuple(
        ParamShape(name=n, shape=tuple(int(d) for d in p.shape),
                   dtype=str(p.dtype).replace("torch.", ""))
        for n, p in inner.named_parameters() if p.requires_grad
    )
    return ModelShapes(name or type(inner).__name__, params)


def load_callable(target: str) -> Callable[..., Any]:
    """``"pkg.module:fn"`` (imported) or ``"path/to/file.py:fn"`` (loaded from the file)."""
    path, sep, attr = target.rpartition(":")
    if not sep or not path or not attr:
        raise ConfigError(
            f"--model {target!r}: expected 'pkg.module:function' or 'path/to/file.py:function'"
        )
    if path.endswith(".py") or "/" in path or "\\" in path:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--model {target!r}: no file {file}")
        mod_name = f"_commpress_model_{abs(hash(str(file.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, file)
        if spec is None or spec.loader is None:
            raise ConfigError(f"--model {target!r}: cannot load {file} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(mod_name, None)
            raise ConfigError(f"--model {target!r}: importing {file} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            raise ConfigError(f"--model {target!r}: cannot import {path!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"--model {target!r}: {path} has no callable {attr!r}")
    return fn


def shapes_from_callable(target: str | Callable[[], Any]) -> ModelShapes:
    """Call a model builder (``"pkg.module:fn"``, ``"file.py:fn"`` or a callable) with no
    arguments under ``torch.device("meta")`` and describe the module it returns."""
    import torch

    fn = load_callable(target) if isinstance(target, str) else target
    label = target if isinstance(target, str) else getattr(fn, "__name__", "model")
    try:
        with torch.device("meta"):
            module = fn()
    except Exception as exc:
        raise ConfigError(f"building the model {label!r} on the meta device failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    return shapes_of_module(module, name=f"{label} ({type(module).__name__})")


# ---------------------------------------------------------------------------- Hugging Face
def _hf_config(source: str) -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(
            "--hf-config needs transformers: pip install 'commpress[models]' (or transformers)"
        ) from exc
    path = Path(source)
    try:
        if path.is_file():
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or "model_type" not in data:
                raise ConfigError(f"{path} is not a Hugging Face config.json (no 'model_type')")
            model_type = data.pop("model_type")
            return transformers.AutoConfig.for_model(model_type, **data)
        return transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"cannot read the Hugging Face config {source!r} offline (a config.json file, a "
            f"directory holding one, or a model name already in the local cache): {exc}"
        ) from exc


def shapes_from_hf_config(source: str) -> ModelShapes:
    """A ``transformers`` model built from its config on the meta device, offline.

    ``source`` is a ``config.json`` file, a directory holding one, or a model name already in
    the local Hugging Face cache (nothing is downloaded). The class named first in the
    config's ``architectures`` is built when ``transformers`` has it (so a causal LM gets its
    head; tied weights count once), else ``AutoModel``.
    """
    import torch

    config = _hf_config(source)  # first: it says how to install transformers when missing
    import transformers

    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    builder = cls if cls is not None and hasattr(cls, "_from_config") else None
    try:
        with torch.device("meta"):
            if builder is not None:
                module = builder._from_config(config)
            else:
                module = transformers.AutoModel.from_config(config)
    except Exception as exc:
        raise ConfigError(f"building {source!r} from its config failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    return shapes_of_module(module, name=f"{Path(source).name or source} "
                                         f"({type(module).__name__})")


# ---------------------------------------------------------------------------- shapes files
def _parse_shape(text: Any, where: str) -> tuple[int, ...]:
    if isinstance(text, (list, tuple)):
        items: Iterable[Any] = text
    elif isinstance(text, int) and not isinstance(text, bool):
        items = [text]
    elif isinstance(text, str):
        t = text.strip().strip("[]()").replace("x", " ").replace("X", " ").replace(",", " ")
        items = t.split()
    else:
        raise ConfigError(f"{where}: cannot read a shape from {text!r}")
    try:
        dims = tuple(int(d) for d in items)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: shape {text!r} is not a list of integers") from None
    return dims


def _records(data: Any, where: str) -> list[ParamShape]:
    if isinstance(data, Mapping) and "params" in data:
        data = data["params"]
    if isinstance(data, Mapping):
        return [ParamShape(name=str(k), shape=_parse_shape(v, f"{where}: {k}"))
                for k, v in data.items()]
    if not isinstance(data, Sequence) or isinstance(data, str):
        raise ConfigError(f"{where}: expected a list of {{name, shape, dtype}} objects or an "
                          "object mapping names to shapes")
    out = []
    for i, rec in enumerate(data):
        if not isinstance(rec, Mapping) or "shape" not in rec:
            raise ConfigError(f"{where}: entry {i} needs at least a 'shape', got {rec!r}")
        unknown = sorted(set(rec) - {"name", "shape", "dtype"})
        if unknown:
            raise ConfigError(f"{where}: entry {i} has unknown key(s) {', '.join(unknown)}")
        out.append(ParamShape(name=str(rec.get("name") or f"param{i}"),
                              shape=_parse_shape(rec["shape"], f"{where}: entry {i}"),
                              dtype=str(rec.get("dtype") or "float32")))
    return out


def shapes_from_file(path: str | Path) -> ModelShapes:
    """Parameters listed in a JSON or CSV file (see the module docstring)."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read shapes file {file}: {exc}") from exc
    where = f"shapes file {file}"
    if file.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        fields = [f.strip() for f in reader.fieldnames or []]
        if "shape" not in fields:
            raise ConfigError(f"{where}: the CSV header needs a 'shape' column (name,shape,dtype)")
        rows = [{k.strip(): (v or "").strip() for k, v in row.items() if k} for row in reader]
        params = _records(rows, where)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc}); CSV files need a .csv suffix") from exc
        params = _records(data, where)
    return ModelShapes(file.stem, tuple(params))


__all__ = [
    "DTYPE_BYTES",
    "ModelShapes",
    "ParamShape",
    "load_callable",
    "shapes_from_callable",
    "shapes_from_file",
    "shapes_from_hf_config",
    "shapes_of_module",
]
