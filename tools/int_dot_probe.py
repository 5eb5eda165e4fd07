"""Does an integer K pass pay on this OpenCL driver? A probe for quantized decode.

Times one KV head's K pass (G = 4 query heads, head_dim 128, 65536 rows, the rows
kernel's shape of work: one work-item walks a run of rows) four ways, alternated:
f16 keys converted to f32 and multiply-added; q8_0 codes converted to f32 (what
clattn's rows kernel does); codes widened to int16 and multiplied with an int16 q in
pmaddwd's pattern (even + odd lane products); and, where the device has
cl_khr_integer_dot_product, 4-way int8 dot products (``dot_acc_sat``). Prints ns per row
and the ratio to f16. Usage: ``python tools/int_dot_probe.py intel|pocl``.
"""
import sys

import numpy as np
import pyopencl as cl

D, G, N = 128, 4, 1 << 16  # head_dim, group size, rows in all
WI = 64  # work-items, each walking N / WI rows
src = r"""
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#define D 128
#define G 4
/* q of the G heads in registers, as vectors of 16 T */
#define LOAD_Q(T) T##16 qv[G][D/16]; \
  for (int g = 0; g < G; ++g) for (int c = 0; c < D/16; ++c) qv[g][c] = vload16(c, q + g*D)
inline float hsum16(float16 a) { float8 b = a.lo + a.hi; float4 c = b.lo + b.hi; float2 d = c.lo + c.hi; return d.x + d.y; }
__kernel void kf16(__global const half* k, __global const float* q, __global float* s, int rows) {
  int w = get_global_id(0); int r0 = w * rows;
  LOAD_Q(float);
  for (int r = r0; r < r0 + rows; ++r) {
    __global const half* kr = k + (size_t)r * D;
    float16 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = 0;
    for (int c = 0; c < D/16; ++c) { float16 kv = vload_half16(c, kr);
      for (int g = 0; g < G; ++g) acc[g] = fma(qv[g][c], kv, acc[g]); }
    for (int g = 0; g < G; ++g) s[(size_t)r * G + g] = hsum16(acc[g]);
  }
}
__kernel void ki8f(__global const char* k, __global const half* ks, __global const float* q, __global float* s, int rows) {
  int w = get_global_id(0); int r0 = w * rows;
  LOAD_Q(float);
  for (int r = r0; r < r0 + rows; ++r) {
    __global const char* kr = k + (size_t)r * D;
    float tot[G];
    for (int g = 0; g < G; ++g) tot[g] = 0;
    for (int b = 0; b < D/32; ++b) {
      float16 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = 0;
      for (int c = 2*b; c < 2*b+2; ++c) { float16 kv = convert_float16(vload16(c, kr));
        for (int g = 0; g < G; ++g) acc[g] = fma(qv[g][c], kv, acc[g]); }
      float sc = vload_half(r * (D/32) + b, ks);
      for (int g = 0; g < G; ++g) tot[g] = fma(sc, hsum16(acc[g]), tot[g]);
    }
    for (int g = 0; g < G; ++g) s[(size_t)r * G + g] = tot[g];
  }
}
__kernel void ki8i(__global const char* k, __global const half* ks, __global const short* q, __global const float* qs, __global float* s, int rows) {
  int w = get_global_id(0); int r0 = w * rows;
  LOAD_Q(short);
  for (int r = r0; r < r0 + rows; ++r) {
    __global const char* kr = k + (size_t)r * D;
    float tot[G];
    for (int g = 0; g < G; ++g) tot[g] = 0;
    for (int b = 0; b < D/32; ++b) {
      int8 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = 0;
      for (int c = 2*b; c < 2*b+2; ++c) { short16 kv = convert_short16(vload16(c, kr));
        for (int g = 0; g < G; ++g) { int16 p = convert_int16(qv[g][c]) * convert_int16(kv);
          acc[g] += p.even + p.odd; } }
      float sc = vload_half(r * (D/32) + b, ks);
      for (int g = 0; g < G; ++g) { int8 a = acc[g]; int4 c4 = a.lo + a.hi; int2 d2 = c4.lo + c4.hi;
        tot[g] = fma(sc * qs[g * (D/32) + b], (float)(d2.x + d2.y), tot[g]); }
    }
    for (int g = 0; g < G; ++g) s[(size_t)r * G + g] = tot[g];
  }
}
%DOT%
"""
DOT = r"""
__kernel void ki8dot(__global const char* k, __global const half* ks, __global const char* q, __global const float* qs, __global float* s, int rows) {
  int w = get_global_id(0); int r0 = w * rows;
  for (int r = r0; r < r0 + rows; ++r) {
    __global const char4* kr = (__global const char4*)(k + (size_t)r * D);
    float tot[G];
    for (int g = 0; g < G; ++g) tot[g] = 0;
    for (int b = 0; b < D/32; ++b) {
      float sc = vload_half(r * (D/32) + b, ks);
      for (int g = 0; g < G; ++g) { int acc = 0;
        __global const char4* qq = (__global const char4*)(q + g * D);
        for (int c = 8*b; c < 8*b+8; ++c) acc = dot_acc_sat(qq[c], kr[c], acc);
        tot[g] = fma(sc * qs[g * (D/32) + b], (float)acc, tot[g]); }
    }
    for (int g = 0; g < G; ++g) s[(size_t)r * G + g] = tot[g];
  }
}
"""
dev_name = sys.argv[1].lower() if len(sys.argv) > 1 else ""
dev_name = {"pocl": "portable computing language"}.get(dev_name, dev_name)
dev = None
for p in cl.get_platforms():
    for d in p.get_devices():
        if dev is None and dev_name in (d.name + " " + p.name).lower():
            dev = d
if dev is None:
    sys.exit(f"no OpenCL device matches {dev_name!r}")
ctx = cl.Context([dev]); queue = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
has_dot = "cl_khr_integer_dot_product" in dev.extensions
prg = cl.Program(ctx, src.replace("%DOT%", DOT if has_dot else "")).build(options=["-cl-std=CL3.0"] if has_dot else [])
rng = np.random.default_rng(0)
kf = rng.standard_normal((N, D)).astype(np.float16)
ki = rng.integers(-127, 128, (N, D)).astype(np.int8); ks = (rng.random((N, D // 32)) * 0.01).astype(np.float16)
q = rng.standard_normal((G, D)).astype(np.float32)
qi16 = rng.integers(-32767, 32768, (G, D)).astype(np.int16); qi8 = rng.integers(-127, 128, (G, D)).astype(np.int8)
qs = np.ones((G, D // 32), np.float32)
mf = cl.mem_flags


def B(a):
    return cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=a)


s = cl.Buffer(ctx, mf.READ_WRITE, N * G * 4)
rows = np.int32(N // WI)
runs = {"f16": (prg.kf16, [B(kf), B(q), s, rows]),
        "i8->f32": (prg.ki8f, [B(ki), B(ks), B(q), s, rows]),
        "i8*i16 madd": (prg.ki8i, [B(ki), B(ks), B(qi16), B(qs), s, rows])}
if has_dot:
    runs["i8 dot_acc_sat"] = (prg.ki8dot, [B(ki), B(ks), B(qi8), B(qs), s, rows])
times = {k: [] for k in runs}
for it in range(30):
    for name, (kern, args) in runs.items():
        e = kern(queue, (WI,), (1,), *args); e.wait()
        times[name].append((e.profile.end - e.profile.start) * 1e-9)
base = np.median(times["f16"])
for name, t in times.items():
    m = np.median(t)
    print(f"{dev.name[:40]:40s} {name:16s} {m*1e3:7.3f} ms  {m / N * 1e9:6.2f} ns/row  {m / base:5.2f}x f16")
