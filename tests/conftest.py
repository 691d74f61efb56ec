"""Test configuration: deterministic torch, few threads (CI machines have 2 cores), and the
numba kernels compiled once before the first test."""

import torch

torch.manual_seed(0)
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_sessionstart(session: object) -> None:
    """Compile the numba kernels (or load them from numba's disk cache) before any test runs.

    On a fresh checkout the first kernel call compiles for minutes on a loaded 2-core machine.
    Done inside a multi-process test, every worker compiles at once and the test's deadlines
    run out (tests/test_activations.py's send/recv, 20 s per message, failed so in a fresh
    clone's CI); done here, once, the workers load the cached kernels in about a second."""
    from commpress.codecs import codec_ids, get_codec, kernels
    from commpress.codecs.base import CodecContext

    if not kernels.available():
        return
    kernels.warm_up()
    if "netzip" in codec_ids():  # the activations' default codec and its numba kernels
        netzip = get_codec("netzip")
        x = torch.linspace(-1.0, 1.0, 4096)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            netzip.decode(netzip.encode(x.to(dtype), CodecContext()), CodecContext())


def pytest_collection_finish(session: object) -> None:
    """Under Triton's interpreter (``TRITON_INTERPRET=1``, which the Triton test modules set
    as they are collected: triton must not be imported before), every interpreted launch of
    the session gets its float arguments as a GPU does (tests/triton_interp.py), whichever
    test module runs first."""
    import importlib.util
    import os

    if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
        from triton_interp import floats_as_compiled

        floats_as_compiled()
