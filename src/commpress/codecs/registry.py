"""The registry of codec ids: ``get_codec("topk", ratio=0.01)`` and friends."""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from commpress.codecs.base import Codec
from commpress.errors import ConfigError

_REGISTRY: dict[str, type[Codec]] = {}
#: Codecs built from spec strings (codecs are frozen, so equal specs can share one).
_FROM_SPEC: dict[str, Codec] = {}

C = TypeVar("C", bound=type[Codec])


def register_codec(cls: C) -> C:
    """Class decorator adding a codec class to the registry under its ``codec_id``."""
    codec_id = getattr(cls, "codec_id", None)
    if not isinstance(codec_id, str) or not codec_id:
        raise ConfigError(f"{cls.__name__} has no codec_id string")
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{cls.__name__} must be a dataclass to be registered")
    existing = _REGISTRY.get(codec_id)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        raise ConfigError(
            f"codec id {codec_id!r} is already registered by {existing.__module__}."
            f"{existing.__qualname__}"
        )
    _REGISTRY[codec_id] = cls
    _FROM_SPEC.clear()
    return cls


def codec_ids() -> list[str]:
    """All registered ids, sorted."""
    return sorted(_REGISTRY)


def list_codecs() -> list[type[Codec]]:
    """All registered codec classes, sorted by id."""
    return [_REGISTRY[i] for i in codec_ids()]


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """``" (did you mean 'topk'?)"`` for the closest of ``choices``, or ``""``."""
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered:  # 'TOPK': the same id in another case
        return f" (did you mean {lowered[word.lower()]!r}?)"
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def codec_class(codec_id: str) -> type[Codec]:
    """The class registered under ``codec_id``; unknown ids list the known ones."""
    try:
        return _REGISTRY[codec_id]
    except KeyError:
        raise ConfigError(
            f"unknown codec id {codec_id!r}{did_you_mean(str(codec_id), codec_ids())}; known "
            f"ids: {', '.join(codec_ids())}"
        ) from None


def parse_codec_spec(spec: str) -> dict[str, Any]:
    """Parse ``"powersgd:rank=4,warm_start=true"`` into ``{"id": "powersgd", "rank": 4, ...}``.

    Values are read as JSON where possible (numbers, ``true``/``false``, ``null``), ``nan`` and
    ``inf`` as floats (so that the codec's range check names them), and as plain strings
    otherwise. A parameter given twice is refused (the last one used to win silently).
    """
    codec_id, _, rest = spec.partition(":")
    config: dict[str, Any] = {"id": codec_id.strip()}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"codec spec {spec!r}: expected name=value, got {item!r}")
        if name == "id":
            raise ConfigError(f"codec spec {spec!r}: the codec id goes before the ':', not "
                              "among its parameters")
        if name in config:
            raise ConfigError(f"codec spec {spec!r}: parameter {name!r} is given twice")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            special = raw.strip().lower().lstrip("+-") in ("nan", "inf", "infinity")
            value = float(raw) if special else raw
        config[name] = value
    return config


def get_codec(spec: str | Mapping[str, Any] | Codec, **params: Any) -> Codec:
    """Build a codec from an id plus keyword parameters, a config mapping, or a spec string.

    >>> get_codec("topk", ratio=0.01)              # doctest: +SKIP
    >>> get_codec({"id": "topk", "ratio": 0.01})   # doctest: +SKIP
    >>> get_codec("powersgd:rank=4")               # doctest: +SKIP
    """
    if isinstance(spec, Codec):
        if params:
            config = {**spec.get_config(), **params}
            return get_codec(config)
        return spec
    if isinstance(spec, str):
        if not params:
            cached = _FROM_SPEC.get(spec)
            if cached is not None:
                return cached
            codec = get_codec(parse_codec_spec(spec))
            if len(_FROM_SPEC) >= 1024:
                _FROM_SPEC.clear()
            _FROM_SPEC[spec] = codec
            return codec
        config = parse_codec_spec(spec)
    elif isinstance(spec, Mapping):
        config = dict(spec)
    else:
        raise ConfigError(
            f"a codec is given by an id string or a config mapping, got {type(spec).__name__}"
        )
    if "id" not in config:
        raise ConfigError(f"codec config has no 'id' key: {config!r}")
    codec_id = config.pop("id")
    config.update(params)
    cls = codec_class(codec_id)
    accepted = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(config) - set(accepted))
    if unknown:
        hint = did_you_mean(unknown[0], accepted) if len(unknown) == 1 else ""
        raise ConfigError(
            f"{codec_id}: unknown parameter(s) {', '.join(unknown)}{hint}; accepted: "
            f"{', '.join(accepted) if accepted else '(none)'}"
        )
    return cls(**config)
