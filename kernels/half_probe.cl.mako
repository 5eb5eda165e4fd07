<%doc>
The check clattn.compiler_probe runs before CPU-style kernels convert f16 through clang's
__fp16 storage type (common.clh.mako, raw_loads with STORAGE_HALF): the same helpers,
over every half and a set of floats that exercise each rounding case.
Parameters: V (lanes per conversion), DTYPE, DENORMS, STORAGE_HALF.
</%doc>
<%namespace name="c" file="common.clh.mako"/>
<%
UV = "ushort" if V == 1 else "ushort%d" % V
FV = "float" if V == 1 else "float%d" % V
%>\
${c.raw_loads(V)}
__kernel void clattn_half_probe(__global const ushort* h, __global const float* x,
                                __global float* f, __global ushort* y)
{
    const int i = get_global_id(0);
    *(__global ${FV}*)(f + i * ${V}) = clattn_h2f(*(const __global ${UV}*)(h + i * ${V}));
    *(__global ${UV}*)(y + i * ${V}) = clattn_f2h(*(const __global ${FV}*)(x + i * ${V}));
}
