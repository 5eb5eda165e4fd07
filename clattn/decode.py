"""The app-facing decode API: build once per model configuration, run per layer."""
from __future__ import annotations

import threading
import warnings
from typing import Any, NamedTuple

import numpy as np

from . import reference, runtime
from .codegen import decode_geometry, merge_geometry, render_decode, render_merge
from .plan import Plan, make_plan
from .rope import kernel_turns, parse_rope_scaling, rope_tables
from .setup import DeviceSetup, device_setup, warn_cpu_fallback
from .spec import LSE_DTYPE, AttentionSpec, default_sm_scale
from .validate import check_decode, chunk_lengths, is_host

BACKENDS = ("auto", "opencl", "cpu")


class DecodeResult(NamedTuple):
    """``out [B, H_qo, D]``, ``lse [B, H_qo]`` (base 2) and the event that completes them."""

    out: Any
    lse: Any
    event: Any


def _buf(a: Any, dummy: Any = None) -> tuple[Any, int]:
    """(buffer, element offset) of a pyopencl array, views included (empty -> dummy)."""
    if a.base_data is None:  # a zero-size array has no buffer; the kernel reads none of it
        return dummy, 0
    item = np.dtype(a.dtype).itemsize
    if a.offset % item:
        raise ValueError("array view offset is not a whole number of elements")
    if a.offset // item >= 2**31:
        raise ValueError(f"array view starts {a.offset // item} elements into its buffer; "
                         f"views beyond 2**31 elements are not supported: pass the buffer "
                         f"nearer its start")
    return a.base_data, a.offset // item


class BatchDecode:
    """Paged-KV decode attention for one model configuration on one device.

    >>> dec = BatchDecode(AttentionSpec(32, 8, 128))            # doctest: +SKIP
    >>> out, lse, event = dec.run(q, pages, indptr, indices, last_page_len)  # doctest: +SKIP

    ``device``: None (``PYOPENCL_CTX`` or the default device), a name such as
    ``"pocl"``/``"intel"``, or a pyopencl Device/Context/CommandQueue.
    ``backend``: ``"auto"`` (OpenCL when a device exists, else the CPU fallback with one
    warning), ``"opencl"`` or ``"cpu"``. ``profile``: None (the registry's choice for the
    device), a profile name, a :class:`~clattn.profiles.Profile` or a dict of overrides.
    """

    def __init__(self, spec: AttentionSpec, device: Any = None, *, backend: str = "auto",
                 profile: Any = None) -> None:
        if not isinstance(spec, AttentionSpec):
            raise TypeError(f"spec: expected an AttentionSpec, got {type(spec).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: allowed {BACKENDS}")
        self.spec = spec
        self._lock = threading.Lock()
        self.setup: DeviceSetup | None = None
        if backend != "cpu":
            dev = runtime.select_device(device)
            if dev is None:
                if backend == "opencl":
                    raise runtime.NoDeviceError("backend='opencl' but no OpenCL device is present")
                warn_cpu_fallback("no OpenCL device found")
            else:
                queue = device if isinstance(device, runtime.cl().CommandQueue) else None
                rt = runtime.Runtime(dev, queue.context, queue) if queue is not None else \
                    runtime.Runtime.for_device(device if isinstance(device, runtime.cl().Context)
                                               else dev)
                self.setup = device_setup(rt, profile)
        self.backend = "opencl" if self.setup else "cpu"
        self._kernel = None
        self._merge = None
        self._turns: dict = {}
        self._ws: tuple | None = None
        self._plan_tables: dict = {}
        self._ws_event = None  # the last launch that used the workspace
        if self.setup:
            prof = self.setup.profile
            self.geometry = decode_geometry(spec, prof, self.setup.limits)
            for note in self.geometry.notes:
                warnings.warn(f"clattn: {note}", RuntimeWarning, stacklevel=2)
            self.merge_geometry = merge_geometry(spec.head_dim, spec.dtype, prof, self.setup.limits)

    # -- introspection -------------------------------------------------------------
    @property
    def profile(self):
        return self.setup.profile if self.setup else None

    def source(self) -> str:
        """The OpenCL C this object runs (rendered for its device's profile)."""
        if not self.setup:
            raise RuntimeError("the CPU backend runs numpy code, not OpenCL")
        return render_decode(self.spec, self.geometry)

    def _kernels(self) -> tuple[Any, Any]:
        with self._lock:
            if self._kernel is None:
                rt = self.setup.runtime
                self._kernel = self._fitted_decode_kernel(rt)
                mprg = rt.program(render_merge(self.spec.head_dim, self.spec.dtype, "float32",
                                               self.merge_geometry))
                self._merge = runtime.cl().Kernel(mprg, "clattn_merge_varlen")
            return self._kernel, self._merge

    def _fitted_decode_kernel(self, rt: Any) -> Any:
        """Build the decode kernel; if the compiled kernel allows fewer work-items than
        the geometry asks (CL_KERNEL_WORK_GROUP_SIZE: registers, private memory), shrink
        the thread limit and rebuild, with one warning, instead of failing at launch."""
        cl = runtime.cl()
        while True:
            kernel = cl.Kernel(rt.program(self.source()), "clattn_decode")
            want = int(np.prod(self.geometry.local_size()))
            try:
                allowed = int(kernel.get_work_group_info(
                    cl.kernel_work_group_info.WORK_GROUP_SIZE, rt.device))
            except Exception:  # noqa: BLE001 - a driver without the query: trust the build
                return kernel
            if allowed >= want or self.geometry.strategy != "tiled":
                return kernel
            limit = 1 << (max(allowed, self.geometry.bdx).bit_length() - 1)
            prof = self.setup.profile
            prof = prof.with_(thread_limit=min(limit, prof.thread_limit // 2))
            geometry = decode_geometry(self.spec, prof, self.setup.limits)
            if int(np.prod(geometry.local_size())) >= want:
                raise RuntimeError(f"decode kernel needs {want} work-items per group; "
                                   f"{rt.device.name!r} allows {allowed} for it")
            warnings.warn(f"clattn: the decode kernel allows {allowed} work-items per group on "
                          f"{rt.device.name!r}, the profile asked for {want}: thread_limit "
                          f"reduced to {prof.thread_limit}", RuntimeWarning, stacklevel=4)
            self.setup.profile, self.geometry = prof, geometry

    def build(self) -> "BatchDecode":
        """Compile now (otherwise the first run compiles)."""
        if self.setup:
            self._kernels()
        return self

    # -- planning ------------------------------------------------------------------
    def plan(self, page_indptr: np.ndarray, last_page_len: np.ndarray | None = None, *,
             length_info: np.ndarray | None = None, window_offset: np.ndarray | None = None,
             sink_size: np.ndarray | None = None, split: bool | int | None = None) -> Plan:
        """Decide split-KV for a batch from its host page table (reuse it for every layer).

        ``split``: None (decide from the device), False (never), or rows per partition.
        """
        spec = self.spec
        chunk = chunk_lengths(spec, page_indptr, last_page_len, length_info=length_info,
                              window_offset=window_offset, sink_size=sink_size)
        B = len(chunk)
        if not self.setup:
            return make_plan(chunk, 1, 1, _cpu_profile(), spec.page_size, split=False)
        wg = B * spec.num_kv_heads * self.geometry.gdz
        cus = int(self.setup.info.get("max_compute_units") or 1)
        return make_plan(chunk, wg, cus, self.setup.profile, spec.page_size, split=split)

    def _workspace(self, n_ws: int) -> tuple[Any, Any]:
        cl = runtime.cl()
        H, D = self.spec.num_qo_heads, self.spec.head_dim
        if self._ws is None or self._ws[0] < n_ws:
            ctx = self.setup.runtime.context
            n = max(n_ws, 1)
            self._ws = (n, cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n * H * D * 4),
                        cl.Buffer(ctx, cl.mem_flags.READ_WRITE, n * H * 4))
        return self._ws[1], self._ws[2]

    # -- running -------------------------------------------------------------------
    def run(self, q: Any, pages: Any, page_indptr: Any, page_indices: Any,
            last_page_len: Any = None, *, length_info: Any = None, window_offset: Any = None,
            sink_size: Any = None, q_pos: Any = None, k_pos_offset: Any = None,
            rotary_mode: int = 0, rope_scale: float = 1.0, rope_theta: float = 1e4,
            sm_scale: float | None = None, out: Any = None, lse: Any = None,
            plan: Plan | None = None, split: bool | int | None = None, queue: Any = None,
            wait_for: list | None = None) -> DecodeResult:
        """Decode one token per sequence; returns ``DecodeResult(out, lse, event)``.

        numpy inputs are copied in and the results come back as numpy arrays (the call
        waits); pyopencl arrays stay on the device and the call returns at once with the
        event. ``plan``: a :meth:`plan` result to reuse (else planned here from host
        tables, or no split for device tables). ``split`` as in :meth:`plan`.
        """
        spec = self.spec
        kw = dict(length_info=length_info, window_offset=window_offset, sink_size=sink_size,
                  q_pos=q_pos, k_pos_offset=k_pos_offset, rotary_mode=rotary_mode,
                  rope_scale=rope_scale, rope_theta=rope_theta, sm_scale=sm_scale)
        if not self.setup:
            o, s = reference.batch_decode(spec, *_host_all(q, pages, page_indptr, page_indices,
                                                            last_page_len), **_host_kw(kw),
                                          out=out, lse=lse)
            return DecodeResult(o, s, None)
        args = check_decode(spec, q, pages, page_indptr, page_indices, last_page_len,
                            out=out, lse=lse, **kw)
        cl = runtime.cl()
        rt = self.setup.runtime
        queue = queue or rt.queue
        host_mode = is_host(q)
        B, H, D = args.B, spec.num_qo_heads, spec.head_dim
        if plan is None:
            if args.chunk is not None:
                plan = make_plan(args.chunk, B * spec.num_kv_heads * self.geometry.gdz,
                                 int(self.setup.info.get("max_compute_units") or 1),
                                 self.setup.profile, spec.page_size, split=split)
            else:
                plan = make_plan(np.zeros(B, np.int64), 1, 1, self.setup.profile,
                                 spec.page_size, split=False)
        elif len(plan.part_indptr) != B + 1:
            raise ValueError(f"plan: made for {len(plan.part_indptr) - 1} sequences, the call has {B}")
        elif args.chunk is not None and plan.split and \
                np.any(np.maximum(1, -(-args.chunk // plan.part_rows)) >
                       np.diff(plan.part_indptr)):
            raise ValueError("plan: the page table grew since the plan was made; plan again")

        used: list = []  # every device array the launch touches: its events gate the launch

        def dev(a: Any) -> Any:
            if a is None:
                return None
            d = cl.array.to_device(queue, np.ascontiguousarray(a)) if is_host(a) else a
            used.append(d)
            return d

        dummy = (rt.dummy_int(), 0)
        dq, dpages = dev(q), dev(pages)
        dindptr, dindices = dev(page_indptr), dev(page_indices)
        if length_info is not None:
            lb, lo0 = _buf(dev(length_info), rt.dummy_int())
            last_b = (lb, lo0)
            wo_b = (lb, lo0 + B) if spec.sliding_window else dummy
            sk_b = (lb, lo0 + 2 * B) if spec.sliding_window else dummy
        else:
            last_b = _buf(dev(args.last_page_len), rt.dummy_int())
            wo_b = _buf(dev(window_offset), rt.dummy_int()) if spec.sliding_window else dummy
            sk_b = _buf(dev(sink_size), rt.dummy_int()) if spec.sliding_window else dummy
        qp_b = _buf(dev(q_pos), rt.dummy_int()) if rotary_mode else dummy
        kp_b = _buf(dev(k_pos_offset), rt.dummy_int()) if rotary_mode else dummy
        dout = dev(out) if (out is not None and not is_host(out)) else \
            cl.array.empty(queue, (B, H, D), spec.np_dtype)
        dlse = dev(lse) if (lse is not None and not is_host(lse)) else \
            cl.array.empty(queue, (B, H), LSE_DTYPE)
        turns, long_from, att = self._rope_buffer(rotary_mode, rope_theta, rope_scale)
        ws_o, ws_s = self._workspace(plan.n_ws) if plan.split else (rt.dummy_int(), rt.dummy_int())
        pindptr = self._plan_table(plan, queue) if plan.split else None
        if pindptr is not None:
            used.append(pindptr)

        kernel, merge = self._kernels()
        scale = default_sm_scale(D) if sm_scale is None else float(sm_scale)
        i32, f32 = np.int32, np.float32
        for name, a in (("q", dq), ("pages", dpages), ("page_indptr", dindptr),
                        ("page_indices", dindices), ("out", dout), ("lse", dlse)):
            if a.context != rt.context:
                raise ValueError(f"{name}: lives in another OpenCL context than this BatchDecode's "
                                 f"device ({rt.device.name!r}); create it on dec.setup.runtime.context")
        qb, pb, ib, xb, ob, sb = (_buf(a, rt.dummy_int()) for a in
                                  (dq, dpages, dindptr, dindices, dout, dlse))
        kargs = [qb[0], i32(qb[1]), pb[0], np.uint64(pb[1]), i32(args.num_pages),
                 ib[0], i32(ib[1]), xb[0], i32(xb[1]), i32(args.nnz),
                 last_b[0], i32(last_b[1]), wo_b[0], i32(wo_b[1]), sk_b[0], i32(sk_b[1]),
                 qp_b[0], i32(qp_b[1]), kp_b[0], i32(kp_b[1]),
                 ob[0], i32(ob[1]), sb[0], i32(sb[1]),
                 ws_o, ws_s, i32(plan.n_ws),
                 pindptr.data if plan.split else rt.dummy_int(), i32(1 if plan.split else 0),
                 i32(plan.part_rows if plan.split else 0),
                 i32(rotary_mode), f32(scale), turns, i32(long_from), f32(att)]
        evt = None
        if B > 0:
            gsz = self.geometry.global_size(B, spec.num_kv_heads,
                                            plan.num_parts if plan.split else 1)
            with self._lock:  # set_args + enqueue of a shared kernel object must not interleave
                waits = list(wait_for or []) + [e for a in used for e in (a.events or [])]
                if plan.split and self._ws_event is not None:
                    waits.append(self._ws_event)  # split runs share the workspace: serialise
                evt = kernel(queue, gsz, self.geometry.local_size(), *kargs, wait_for=waits or None)
                if plan.split:
                    mg, ml = self.merge_geometry.sizes(B * H, D)
                    evt = merge(queue, mg, ml, ws_o, i32(0), ws_s, i32(0), pindptr.data, i32(0),
                                i32(-1), i32(1), i32(plan.n_ws), ob[0], i32(ob[1]), sb[0],
                                i32(sb[1]), i32(B), i32(H), wait_for=[evt])
                    self._ws_event = evt
            dout.add_event(evt)
            dlse.add_event(evt)
        if host_mode or (out is not None and is_host(out)) or (lse is not None and is_host(lse)):
            o = dout.get(queue=queue) if B > 0 else np.zeros((B, H, D), spec.np_dtype)
            s = dlse.get(queue=queue) if B > 0 else np.zeros((B, H), LSE_DTYPE)
            if out is not None and is_host(out):
                out[...] = o
                o = out
            if lse is not None and is_host(lse):
                lse[...] = s
                s = lse
            return DecodeResult(o, s, evt)
        return DecodeResult(dout, dlse, evt)

    def _plan_table(self, plan: Plan, queue: Any) -> Any:
        """The plan's partition table on the device (uploaded once per plan, kept for 8 plans)."""
        hit = self._plan_tables.get(id(plan))
        if hit is None or hit[0] is not plan:
            cl = runtime.cl()
            hit = (plan, cl.array.to_device(queue, plan.part_indptr))
            self._plan_tables[id(plan)] = hit
            while len(self._plan_tables) > 8:
                self._plan_tables.pop(next(iter(self._plan_tables)))
        return hit[1]

    def _rope_buffer(self, rotary_mode: int, theta: float, scale: float) -> tuple[Any, int, float]:
        rt = self.setup.runtime
        if not rotary_mode:
            return rt.dummy_int(), 2**31 - 1, 1.0
        key = (float(theta), float(scale))
        if key not in self._turns:
            while len(self._turns) >= 16:  # a caller varying rope_scale per call: stay bounded
                self._turns.pop(next(iter(self._turns)))
            cl = runtime.cl()
            spec = self.spec
            scaling = parse_rope_scaling(spec.rope_scaling, spec.max_position_embeddings)
            inv, att, long_from = rope_tables(spec.rotary_dim, float(theta), scaling,
                                              spec.max_position_embeddings)
            turns = kernel_turns(inv, scale)
            buf = cl.Buffer(rt.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR,
                            hostbuf=turns)
            self._turns[key] = (buf, int(long_from), float(att))
        return self._turns[key]


def _cpu_profile():
    from .profiles.record import Profile
    return Profile(name="cpu-fallback", strategy="rows")


def _host(a: Any) -> Any:
    return a if a is None or is_host(a) else a.get()


def _host_all(*arrays: Any) -> list:
    return [_host(a) for a in arrays]


def _host_kw(kw: dict) -> dict:
    return {k: (_host(v) if hasattr(v, "shape") else v) for k, v in kw.items()}
