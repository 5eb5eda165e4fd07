"""Limits are facts: a compiled kernel that allows fewer work-items than the profile asked
for is rebuilt smaller with one warning, and still computes the right thing."""
import numpy as np
import pyopencl as cl
import pytest
from cases import compare, decode_args, make_case
from naive import naive_decode

import clattn


def test_kernel_work_group_size_shrinks_the_geometry(device, monkeypatch):
    real = cl.Kernel.get_work_group_info

    def fake(self, param, dev):  # a driver whose kernel fits only 64 work-items per group
        if param == cl.kernel_work_group_info.WORK_GROUP_SIZE and \
                self.function_name == "clattn_decode":
            return 64
        return real(self, param, dev)

    monkeypatch.setattr(cl.Kernel, "get_work_group_info", fake)
    spec = clattn.AttentionSpec(16, 2, 64, page_size=8, dtype="float32")
    dec = clattn.BatchDecode(spec, device, profile="generic")
    before = int(np.prod(dec.geometry.local_size()))
    assert before > 64
    with pytest.warns(RuntimeWarning, match="work-items per group"):
        dec.build()
    assert int(np.prod(dec.geometry.local_size())) <= 64
    assert dec.setup.limits.max_work_group_size <= 64  # the kernel's limit, refitted
    case = make_case(spec, [0, 1, 30, 77], seed=3)
    args, kw = decode_args(case)
    out, lse, _ = dec.run(*args, **kw)
    compare(out, lse, *naive_decode(*args, **kw), spec.dtype)
