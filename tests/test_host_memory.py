"""Page pools in huge pages of host memory on CPU devices (clattn.host_memory)."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyopencl as cl
import pytest
from cases import compare
from conftest import device_indices
from naive import naive_decode

import clattn
from clattn import host_memory


@pytest.mark.parametrize("text, mode", [
    ("always [madvise] never\n", "madvise"),
    ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"),
    ("garbage\n", ""),
])
def test_thp_mode(tmp_path, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert host_memory.thp_mode(str(f)) == mode


def test_thp_mode_missing_file(tmp_path):
    assert host_memory.thp_mode(str(tmp_path / "absent")) == ""


class _Dev:
    def __init__(self, kind: int) -> None:
        self.type = kind


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")
def test_which_devices_get_huge_pages():
    t = cl.device_type
    assert host_memory.wants_huge_pages(_Dev(t.CPU), "madvise")
    assert host_memory.wants_huge_pages(_Dev(t.CPU), "always")
    assert not host_memory.wants_huge_pages(_Dev(t.CPU), "never")
    assert not host_memory.wants_huge_pages(_Dev(t.CPU), "")
    assert not host_memory.wants_huge_pages(_Dev(t.GPU), "madvise")
    # Oclgrind reports every type: its own allocation keeps its bounds checks exact
    assert not host_memory.wants_huge_pages(_Dev(int(t.ALL)), "madvise")


def _vma_flags(address: int) -> dict:
    """The smaps fields of the mapping holding ``address`` in this process."""
    fields: dict = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    return fields


def _thp_expected() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and host_memory.thp_mode() in ("always", "madvise")


@pytest.mark.parametrize("address, nbytes, expect", [
    (0, 4 << 20, (0, 4 << 20)),                          # aligned: every huge page
    (4096, 4 << 20, (2 << 20, 2 << 20)),                 # the one whole page inside
    ((2 << 20) - 64, (4 << 20) + 128, (2 << 20, 4 << 20)),
    (4096, (2 << 20), (2 << 20, 0)),                     # no whole huge page inside
    (0, (2 << 20) - 1, (0, 0)),
])
def test_huge_page_range(address, nbytes, expect):
    lo, length = host_memory.huge_page_range(address, nbytes)
    assert (lo, length) == expect
    assert lo % host_memory.HUGE_PAGE == 0 and length % host_memory.HUGE_PAGE == 0
    if length:  # never past either end of the range
        assert address <= lo and lo + length <= address + nbytes


def test_advise_huge_pages_marks_the_range():
    """The advice reaches the kernel: the whole huge pages of a range become eligible."""
    m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        address = np.frombuffer(m, np.uint8).ctypes.data + 4096
        lo, length = host_memory.huge_page_range(address, 6 << 20)
        done = host_memory.advise_huge_pages(address, 6 << 20)
        if not _thp_expected():
            pytest.skip("no MADV_HUGEPAGE or THP mode 'never' here")
        assert done == length >= 2 << 20
        vma = _vma_flags(lo)
        if "THPeligible" in vma:  # Linux >= 5.0 says whether the range may get huge pages
            assert vma["THPeligible"] == "1", vma
    finally:
        m.close()


def _pool_address(pages) -> int:
    """Where the runtime keeps a pool (a CPU device maps its buffers in place)."""
    host, _ = cl.enqueue_map_buffer(pages.queue, pages.base_data, cl.map_flags.READ, 0,
                                    (pages.nbytes,), np.uint8)
    try:
        return host.ctypes.data
    finally:
        host.base.release(pages.queue).wait()


def test_empty_pages_on_a_cpu_device(device, get_decoder):
    """A CPU device's pool of at least one huge page is advised huge pages where it lies; a
    decode over it matches the float64 reference."""
    spec = clattn.AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype="float16")
    dec = get_decoder(spec, device)
    pages = dec.empty_pages(1024)   # 8 MiB: at least three whole huge pages
    assert pages.shape == spec.pool_shape(1024) and pages.dtype == spec.pool_dtype
    if host_memory.wants_huge_pages(device):
        assert _thp_expected()
        lo, length = host_memory.huge_page_range(_pool_address(pages), pages.nbytes)
        assert length >= 2 << 20
        for at in (lo, lo + length - 1):
            vma = _vma_flags(at)
            if "THPeligible" in vma:
                assert vma["THPeligible"] == "1", vma
    rng = np.random.default_rng(5)
    host_pages = rng.standard_normal(pages.shape).astype(pages.dtype)
    pages.set(host_pages)
    q = rng.standard_normal((2, 8, 64)).astype(np.float16)
    indptr = np.array([0, 30, 64], np.int32)
    indices = rng.permutation(1024)[:64].astype(np.int32)
    last = np.array([7, 16], np.int32)
    r = dec.run(q, pages, indptr, indices, last)
    ref_out, ref_lse = naive_decode(q, host_pages, indptr, indices, last)
    compare(r.out, r.lse, ref_out, ref_lse, np.float16)


def test_which_pools_are_advised(device, get_decoder, monkeypatch):
    """The advice covers the pool's own memory, and only pools of a huge page or more."""
    calls = []
    real = host_memory.advise_huge_pages
    monkeypatch.setattr(host_memory, "advise_huge_pages",
                        lambda address, nbytes: calls.append((address, nbytes)) or
                        real(address, nbytes))
    spec = clattn.AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype="float16")
    dec = get_decoder(spec, device)
    small = dec.empty_pages(64)   # 512 KiB
    assert small.shape == spec.pool_shape(64) and not calls
    big = dec.empty_pages(512)   # 4 MiB
    if host_memory.wants_huge_pages(device):
        assert calls == [(_pool_address(big), big.nbytes)]
    else:
        assert not calls


def test_empty_pages_on_the_cpu_backend():
    spec = clattn.AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                                dtype="float32")
    pages = clattn.BatchDecode(spec, backend="cpu").empty_pages(3)
    assert isinstance(pages, np.ndarray) and pages.shape == spec.pool_shape(3)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_empty_pages_rejects(bad):
    spec = clattn.AttentionSpec(num_qo_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                                dtype="float32")
    with pytest.raises(ValueError, match="num_pages"):
        clattn.BatchDecode(spec, backend="cpu").empty_pages(bad)


_LIFETIME_SCRIPT = r"""
import gc, sys
import numpy as np, pyopencl as cl, pyopencl.array
import clattn
from cases import compare
from naive import naive_decode

spec = clattn.AttentionSpec(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                            dtype="float16")
dec = clattn.BatchDecode(spec, device=sys.argv[1])
n = 2048   # 128 MiB, 8 sequences of 4096 rows: milliseconds of kernel time
pages = dec.empty_pages(n)
rng = np.random.default_rng(9)
host_pages = rng.standard_normal(pages.shape).astype(pages.dtype)
pages.set(host_pages)
queue = pages.queue
q = cl.array.to_device(queue, rng.standard_normal((8, 32, 128)).astype(np.float16))
indptr = np.arange(9, dtype=np.int32) * 256
indices = rng.permutation(n).astype(np.int32)
last = np.full(8, 16, np.int32)
tables = [cl.array.to_device(queue, t) for t in (indptr, indices, last)]

# 1. a decode still running when its pool is dropped
r = dec.run(q, pages, *tables)
mapped = pages.map_to_host()                       # 2. a mapping of the pool
sub = pages.base_data.get_sub_region(0, 1 << 20)   # 3. a sub-buffer of it
del pages
gc.collect()
ref_out, ref_lse = naive_decode(q.get()[:1], host_pages, indptr[:2], indices, last[:1])
compare(r.out.get()[:1], r.lse.get()[:1], ref_out, ref_lse, np.float16)
assert np.array_equal(mapped[:3], host_pages[:3])
back = np.empty(1 << 19, np.float16)
cl.enqueue_copy(queue, back, sub)
assert np.array_equal(back, host_pages.reshape(-1)[:1 << 19])
del mapped, sub
print("same as the reference")

# 4. exit with decodes in flight over a pool no one holds any more
pages = dec.empty_pages(n)
pages.set(host_pages)
for _ in range(30):
    dec.run(q, pages, *tables)
"""


def test_a_pool_outlives_what_still_uses_it(device):
    """A pool dropped while a decode reads it, while a mapping or a sub-buffer of it lives,
    and a process exiting with decodes in flight: the memory lives as long as the buffer
    (an earlier pool in memory clattn mapped itself crashed in each case). Run in a child
    process, so that such a death fails this test alone."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _LIFETIME_SCRIPT, device_indices(device)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "same as the reference" in res.stdout, \
        f"exit {res.returncode}: {res.stderr[-2000:]}"
