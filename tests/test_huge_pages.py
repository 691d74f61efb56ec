"""The codecs' fresh large CPU tensors (decodes, payloads, gathered totals) are advised onto
transparent huge pages before they are written (``commpress.procs.advise_huge_pages``), so a
fresh 64 MB output is not page-faulted 4 KiB at a time; ``use_huge_pages(False)`` turns it off.

The advice is checked where the kernel records it: the ``hg`` flag of the memory mapping that
holds a tensor's middle, in ``/proc/self/smaps`` (Linux), in a fresh process whose mappings no
earlier test touched. The values themselves are covered by the codecs' own tests (the memory
is the same ``torch.empty`` memory; only its page size differs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from commpress import procs
from commpress.codecs import kernels

SPECS = ("fp16", "bf16", "minmax", "qsgd", "terngrad", "sign", "topk", "randomk", "dgc",
         "topkc", "thc", "powersgd")

PROBE = """
import json, sys, torch
from commpress import procs
from commpress.codecs import CodecContext, get_codec

def advised(t):
    # the mapping holding the tensor's middle (its first page, shared with the allocator's
    # header, stays outside the whole pages that are advised)
    a = t.data_ptr() + t.numel() * t.element_size() // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= a < hi
            elif head == "VmFlags:" and inside:
                return "hg" in line.split()[1:]
    print("NO-VMFLAGS")  # a kernel (or sandbox) whose smaps lacks the flags
    sys.exit(0)

if sys.argv[1] == "off":
    assert procs.use_huge_pages(False) is True
n = 10 << 20  # 40 MiB of float32
x = torch.randn(2560, 4096)
out = {"plain torch.empty": advised(torch.empty(n))}
for spec in sys.argv[2].split(","):
    codec, ctx = get_codec(spec), CodecContext()
    out[spec + " decode"] = advised(codec.decode(codec.encode(x, ctx), ctx))
wide = torch.randn(4 * n).bfloat16()
out["fp16 encode of bf16"] = advised(get_codec("fp16").encode(wide[: 2 * n], CodecContext())
                                     .parts["values"])
out["qsgd codes of bf16"] = advised(get_codec("qsgd").encode(wide, CodecContext()).parts["codes"])
codec, ctx = get_codec("minmax"), CodecContext()
payloads = [codec.encode(x, ctx), codec.encode(-x, ctx)]
out["minmax sum_decoded total"] = advised(codec.sum_decoded(payloads, ctx))
print(json.dumps(out))
"""

_linux_smaps = sys.platform.startswith("linux") and Path("/proc/self/smaps").exists()


#: settings that make torch or glibc put ordinary memory on huge pages themselves (then a
#: plain torch.empty would be advised too, and the probe could not tell)
_OWN_HUGE_PAGES = ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_")


def _probe(mode: str) -> dict[str, bool]:
    env = {k: v for k, v in os.environ.items() if k not in _OWN_HUGE_PAGES}
    done = subprocess.run([sys.executable, "-c", PROBE, mode, ",".join(SPECS)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.strip().endswith("NO-VMFLAGS"):
        pytest.skip("/proc/self/smaps shows no VmFlags here")
    result: dict[str, bool] = json.loads(done.stdout.splitlines()[-1])
    return result


def _advice_taken() -> bool:
    t = torch.empty(8 << 20, dtype=torch.uint8)
    return procs.advise_huge_pages(t.data_ptr(), t.numel())


@pytest.mark.skipif(not _linux_smaps, reason="Linux's /proc/self/smaps shows the advice")
def test_fresh_large_codec_outputs_are_advised_onto_huge_pages() -> None:
    """Every codec's fresh decode of 40 MiB, the fp16 cast's payload of a bfloat16 input,
    QSGD's codes and a gathered total sit in advised memory; a plain ``torch.empty`` of the
    same size does not (so the check can tell); with ``use_huge_pages(False)`` none does."""
    if not _advice_taken():
        pytest.skip("this kernel refuses MADV_HUGEPAGE (transparent huge pages compiled out)")
    on = _probe("on")
    assert on.pop("plain torch.empty") is False
    assert on and all(on.values()), {k: v for k, v in on.items() if not v}
    assert len(on) == len(SPECS) + 3
    off = _probe("off")
    assert not any(off.values()), {k: v for k, v in off.items() if v}


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, start: int, length: int, advice: int) -> int:
        self.calls.append((start, length, advice))
        return 0


def test_advise_huge_pages_advises_the_whole_pages_of_large_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rec = _Recorder()
    monkeypatch.setattr(procs, "_madvise_fn", [rec])
    mib, page = 1 << 20, procs._PAGE
    # an unaligned block: the advice covers the whole pages inside it, no byte outside
    assert procs.advise_huge_pages(page * 10 + 16, 8 * mib)
    start, length, advice = rec.calls[-1]
    assert (start, advice) == (page * 11, 14)
    assert start + length == (page * 10 + 16 + 8 * mib) // page * page
    # an aligned one: all of it
    assert procs.advise_huge_pages(page * 3, procs.HUGE_PAGE_MIN_BYTES)
    assert rec.calls[-1][:2] == (page * 3, procs.HUGE_PAGE_MIN_BYTES)
    # below the threshold: nothing asked
    assert not procs.advise_huge_pages(page, procs.HUGE_PAGE_MIN_BYTES - 1)
    assert len(rec.calls) == 2
    # turned off: nothing asked, and the switch says what it was
    assert procs.use_huge_pages(False) is True
    try:
        assert not procs.advise_huge_pages(4096, 64 * mib)
        assert len(rec.calls) == 2
    finally:
        assert procs.use_huge_pages(True) is False
    # a refusal of the kernel is reported, not raised
    monkeypatch.setattr(procs, "_madvise_fn", [lambda *_: -1])
    assert not procs.advise_huge_pages(4096, 64 * mib)
    # where there is no madvise (not Linux, not glibc): nothing
    monkeypatch.setattr(procs, "_madvise_fn", [None])
    assert not procs.advise_huge_pages(4096, 64 * mib)


def test_use_huge_pages_refuses_anything_but_a_bool() -> None:
    for bad in (1, 0, "yes", None):
        with pytest.raises(ValueError, match="must be a bool"):
            procs.use_huge_pages(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_kernels_empty_and_zeros_are_torch_tensors_of_the_shape_asked(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Large or small, the tensors are plain contiguous torch tensors of the shape and dtype
    asked (``zeros`` all zero); a large CPU one is advised over its own memory."""
    rec = _Recorder()
    monkeypatch.setattr(procs, "_madvise_fn", [rec])
    for shape in ((3, 5), 0, (), (1024, 4096)):
        t = kernels.empty(shape, dtype)
        z = kernels.zeros(shape, dtype, "cpu")
        want = torch.empty(shape).shape
        assert t.shape == z.shape == want and t.dtype == z.dtype == dtype
        assert t.is_contiguous() and z.is_contiguous() and not z.any()
    nbytes = 1024 * 4096 * dtype.itemsize
    big = [c for c in rec.calls if c[1] > nbytes // 2]
    if nbytes >= procs.HUGE_PAGE_MIN_BYTES:
        assert len(big) == 2 and all(c[1] <= nbytes for c in big), rec.calls
    else:
        assert not rec.calls


def _advised_by(call: Any, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the tensor ``call()`` returns lies in a range that the call itself advised (a
    recording madvise, so no earlier mapping can answer for it)."""
    rec = _Recorder()
    monkeypatch.setattr(procs, "_madvise_fn", [rec])
    t = call()
    mid = t.data_ptr() + t.numel() * t.element_size() // 2
    return any(start <= mid < start + length for start, length, _ in rec.calls)


def test_every_fresh_output_site_advises_its_own_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sites beyond the decodes, each asked for one 8-32 MiB tensor: the cast's payload of
    a float32 input, QSGD's codes (new and kept), THC's codes, gathered totals (float32 and
    bfloat16), a copy for error feedback, the driver's gather buffer and packed bytes."""
    from commpress.codecs import CodecContext, get_codec
    from commpress.collectives.driver import GATHER_BUFFERS, pack_bytes

    x = torch.randn(2 << 20, generator=torch.Generator().manual_seed(0))  # 8 MiB
    wide = torch.randn(8 << 20, generator=torch.Generator().manual_seed(1)).bfloat16()
    ctx = CodecContext()
    fp16, qsgd, thc, minmax = (get_codec(s) for s in ("fp16", "qsgd", "thc", "minmax"))
    pair = [minmax.encode(x, ctx), minmax.encode(-x, ctx)]
    half = [minmax.encode(wide, ctx), minmax.encode(-wide, ctx)]
    cases = {
        "fp16 encode of fp32": lambda: fp16.encode(wide.float(), ctx).parts["values"],
        "qsgd codes of bf16": lambda: qsgd.encode(wide, ctx).parts["codes"],
        "qsgd codes kept (scratch=)": lambda: qsgd.encode(wide, ctx, scratch={}).parts["codes"],
        "thc codes": lambda: thc.encode(wide.float(), ctx).parts["codes"],
        "minmax sum_decoded total": lambda: minmax.sum_decoded(pair, ctx),
        "minmax sum_decoded bf16 total": lambda: minmax.sum_decoded(half, ctx, average=True),
        "copy_of": lambda: kernels.copy_of(x),
        "gather buffer": lambda: GATHER_BUFFERS.take(9 << 20),
        "pack_bytes": lambda: pack_bytes([x]),
    }
    missed = [name for name, call in cases.items() if not _advised_by(call, monkeypatch)]
    assert not missed, missed
