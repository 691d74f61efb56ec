"""numba's disk cache keyed by every kernel module at once (commpress.codecs.kernels.numba_cache).

A kernel cached from one file that calls a jitted function of another file must be compiled
anew when only that other file changes (numba alone keys a function's cache by its own file).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")

_HELPER = "import numba\n\n@numba.njit\ndef f(x):\n    return x + {k}\n"
_KERNEL = textwrap.dedent(
    """
    import numba
    from helper import f

    @numba.njit(cache=True)
    def g(x):
        return f(x) * 2
    """
)
_RUN = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {d!r})
    if {share}:
        from commpress.codecs.kernels import numba_cache
        assert numba_cache.share_stamp({d!r}), numba_cache.unavailable
    import kern
    print(kern.g(1), len(kern.g.stats.cache_hits))
    """
)


def _run(directory: Path, share: bool, cache_dir: Path | None = None) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    env["NUMBA_DISABLE_JIT"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", _RUN.format(d=str(directory), share=share)],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def _write_helper(directory: Path, k: int, mtime: float) -> None:
    path = directory / "helper.py"
    path.write_text(_HELPER.format(k=k))
    os.utime(path, (mtime, mtime))


def test_an_edit_of_a_called_module_recompiles_the_cached_kernel(tmp_path: Path) -> None:
    share = True  # False (numba alone) fails the third assertion: see the test below
    (tmp_path / "kern.py").write_text(_KERNEL)
    _write_helper(tmp_path, 1, 1_000_000_000)
    assert _run(tmp_path, share) == (4, 0)  # compiled and cached
    assert _run(tmp_path, share) == (4, 1)  # loaded from the cache
    # only helper.py changes (as an edit of numba_cpu.py alone, with THC's kernels in
    # numba_transforms.py inlining its noise): g must be compiled anew, not loaded stale
    _write_helper(tmp_path, 2, 1_000_000_100)
    assert _run(tmp_path, share) == (6, 0)
    assert _run(tmp_path, share) == (6, 1)


def test_numba_alone_would_load_the_stale_kernel(tmp_path: Path) -> None:
    """The hazard the shared stamp removes (numba 0.68): without it the cached kernel of
    the unchanged file is loaded after the other file changed. Skipped where numba itself
    recompiles (a later numba may track dependencies)."""
    (tmp_path / "kern.py").write_text(_KERNEL)
    _write_helper(tmp_path, 1, 1_000_000_000)
    assert _run(tmp_path, False) == (4, 0)
    _write_helper(tmp_path, 2, 1_000_000_100)
    value, hits = _run(tmp_path, False)
    if value == 6:
        pytest.skip("this numba recompiles a kernel whose callee's file changed")
    assert (value, hits) == (4, 1)


def test_numba_cache_dir_is_still_honoured(tmp_path: Path) -> None:
    """With ``NUMBA_CACHE_DIR`` set, numba writes every cache there (its first locator); the
    shared stamp must keep that choice (not write next to the sources instead)."""
    src = tmp_path / "src"
    src.mkdir()
    cache = tmp_path / "cache"
    (src / "kern.py").write_text(_KERNEL)
    _write_helper(src, 1, 1_000_000_000)
    assert _run(src, True, cache_dir=cache) == (4, 0)
    assert list(cache.rglob("kern.g-*.nbi")), "nothing cached in NUMBA_CACHE_DIR"
    assert not list(src.rglob("*.nbi")), "cached next to the sources despite NUMBA_CACHE_DIR"
    assert _run(src, True, cache_dir=cache) == (4, 1)
    _write_helper(src, 2, 1_000_000_100)  # the shared stamp still applies there
    assert _run(src, True, cache_dir=cache) == (6, 0)
