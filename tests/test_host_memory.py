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

import clattn
from clattn import host_memory
from cases import compare
from naive import naive_decode


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


def test_empty_pages_on_a_cpu_device(device, get_decoder):
    """A CPU device's pool is host memory, 2 MiB aligned and advised huge pages; a decode
    over it matches the float64 reference."""
    spec = clattn.AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype="float16")
    dec = get_decoder(spec, device)
    pages = dec.empty_pages(512)   # 4 MiB: two huge pages
    assert pages.shape == spec.pool_shape(512) and pages.dtype == spec.pool_dtype
    huge = host_memory.wants_huge_pages(device)
    flags = pages.base_data.get_info(cl.mem_info.FLAGS)
    assert bool(flags & cl.mem_flags.USE_HOST_PTR) == huge
    if huge:
        host = pages.base_data.hostbuf
        address = np.asarray(host).ctypes.data
        assert address % host_memory.HUGE_PAGE == 0
        vma = _vma_flags(address)
        if "THPeligible" in vma:  # Linux >= 5.0 says whether the range may get huge pages
            assert vma["THPeligible"] == "1", vma
    rng = np.random.default_rng(5)
    host_pages = rng.standard_normal(pages.shape).astype(pages.dtype)
    pages.set(host_pages)
    q = rng.standard_normal((2, 8, 64)).astype(np.float16)
    indptr = np.array([0, 30, 64], np.int32)
    indices = rng.permutation(512)[:64].astype(np.int32)
    last = np.array([7, 16], np.int32)
    r = dec.run(q, pages, indptr, indices, last)
    ref_out, ref_lse = naive_decode(q, host_pages, indptr, indices, last)
    compare(r.out, r.lse, ref_out, ref_lse, np.float16)


def test_a_pool_below_one_huge_page_is_plain(device, get_decoder):
    spec = clattn.AttentionSpec(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                                dtype="float16")
    pages = get_decoder(spec, device).empty_pages(64)   # 512 KiB
    assert not pages.base_data.get_info(cl.mem_info.FLAGS) & cl.mem_flags.USE_HOST_PTR


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


_DROP_SCRIPT = r"""
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
r = dec.run(q, pages, *tables)
del pages
gc.collect()
ref_out, ref_lse = naive_decode(q.get()[:1], host_pages, indptr[:2], indices, last[:1])
compare(r.out.get()[:1], r.lse.get()[:1], ref_out, ref_lse, np.float16)
print("same as the reference")
"""


def test_dropping_a_pool_while_its_decode_runs(device_id):
    """A pool in host memory dropped right after a launch that reads it: the memory stays
    mapped until the queue is done (else the kernel reads unmapped memory and the process
    dies). Run in a child process, so that such a death fails this test alone."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _DROP_SCRIPT, device_id], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "same as the reference" in res.stdout, \
        f"exit {res.returncode}: {res.stderr[-2000:]}"
