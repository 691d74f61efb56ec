"""numba's disk cache, keyed by every kernel module at once.

numba caches a compiled function next to its source file (or in a user-wide directory) and
reuses it while that file's stamp (its content's hash in recent numba, its time and size in
older ones) is unchanged. A kernel compiled in one module inlines functions and LLVM
intrinsics from another (THC's kernels in :mod:`.numba_transforms` use :mod:`.numba_cpu`'s
noise and vector codes), so an edit of :mod:`.numba_cpu` alone would leave
:mod:`.numba_transforms`' cached machine code stale: a silent wrong result for anyone who
updates an editable install (``git pull``) with a warm cache. :func:`share_stamp` makes the
stamp of every function defined in a directory's ``.py`` files the hash of all of them, so an
edit of any kernel module recompiles every kernel.

It adds three cache locators (numba's ``NUMBA_CACHE_DIR``, in-tree and user-wide ones, in
numba's order, with that stamp, for that directory only) in front of numba's own, so
``NUMBA_CACHE_DIR`` still wins where set. numba has no public hook for this; where its private
classes are missing (another numba version) nothing changes and the reason is kept in
:data:`unavailable`.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

#: Why :func:`share_stamp` could not install its locators (``None``: it could, or was not
#: asked to).
unavailable: str | None = None

_lock = threading.Lock()
_shared: set[str] = set()
_stamps: dict[tuple[tuple[str, int, int], ...], bytes] = {}


def directory_stamp(directory: str) -> bytes:
    """The SHA-256 of the names and contents of ``directory``'s ``.py`` files (in name
    order); recomputed only when a file's time or size changed."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))
    paths = [os.path.join(directory, n) for n in names]
    key = tuple((p, (st := os.stat(p)).st_mtime_ns, st.st_size) for p in paths)
    stamp = _stamps.get(key)
    if stamp is None:
        h = hashlib.sha256()
        for name, path in zip(names, paths, strict=True):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
            h.update(b"\0")
        stamp = _stamps[key] = h.digest()
    return stamp


def share_stamp(directory: str) -> bool:
    """Key numba's disk cache of the functions defined in ``directory``'s ``.py`` files by
    :func:`directory_stamp` of that directory (see the module docs), before they are compiled
    with ``cache=True``. Returns whether the locators are in place (see :data:`unavailable`)."""
    global unavailable
    directory = os.path.realpath(directory)
    with _lock:
        if directory in _shared:
            return True
        try:
            from numba.core import caching

            # public names in numba 0.68, underscored in earlier releases
            # numba's own order: NUMBA_CACHE_DIR when set, else next to the source, else
            # the user-wide directory
            impl, *bases = (getattr(caching, name, None) or getattr(caching, "_" + name)
                            for name in ("CacheImpl", "UserProvidedCacheLocator",
                                         "InTreeCacheLocator", "UserWideCacheLocator"))
            ours = [_locator(base, directory) for base in bases]
            impl._locator_classes = [*ours, *impl._locator_classes]
        except (ImportError, AttributeError) as exc:
            unavailable = f"{type(exc).__name__}: {exc}"
            return False
        _shared.add(directory)
        return True


def _locator(base: type, directory: str) -> type:
    """``base`` (a numba cache locator class) for the functions of ``directory``'s files,
    stamped by :func:`directory_stamp`."""

    class Locator(base):
        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            if os.path.dirname(os.path.realpath(py_file)) != directory:
                return None
            return super().from_function(py_func, py_file)

        def get_source_stamp(self) -> Any:
            return directory_stamp(directory)

    Locator.__name__ = Locator.__qualname__ = f"Shared{base.__name__.lstrip('_')}"
    return Locator
