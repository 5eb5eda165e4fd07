## Shared pieces of the clattn kernels: typed loads/stores and the RoPE angle.
## Parameters: DTYPE ("half"|"float"), NATIVE_HALF (bool)
<%def name="prelude()">
% if NATIVE_HALF:
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
% endif
#define CLATTN_LOG2E 1.4426950408889634f
#define CLATTN_TWO_PI 6.283185307179586f

typedef ${"half" if DTYPE == "half" else "float"} st_t;  /* storage type of q, pages, out */

/* angle (radians, reduced to about [-pi, pi]) of position pos for a frequency given
   in turns per position as an (hi, lo) pair: exact product, then drop whole turns */
inline float clattn_rope_angle(int pos, float2 t)
{
#pragma OPENCL FP_CONTRACT OFF
    const float p = (float)pos;
    const float hi = p * t.x;
    const float err = fma(p, t.x, -hi);
    const float frac = (hi - rint(hi)) + (err + p * t.y);
    return frac * CLATTN_TWO_PI;
}
</%def>

## load VEC elements of storage at p (element pointer) as float<VEC>
<%def name="loadv(vec, ptr)">\
% if DTYPE == "float":
% if vec == 1:
(${ptr})[0]\
% else:
vload${vec}(0, ${ptr})\
% endif
% elif NATIVE_HALF:
% if vec == 1:
convert_float((${ptr})[0])\
% else:
convert_float${vec}(vload${vec}(0, ${ptr}))\
% endif
% else:
% if vec == 1:
vload_half(0, ${ptr})\
% else:
vload_half${vec}(0, ${ptr})\
% endif
% endif
</%def>

## store float<VEC> val at storage element pointer ptr
<%def name="storev(vec, val, ptr)">\
% if DTYPE == "float":
% if vec == 1:
(${ptr})[0] = (${val});\
% else:
vstore${vec}(${val}, 0, ${ptr});\
% endif
% else:
% if vec == 1:
vstore_half_rte(${val}, 0, ${ptr});\
% else:
vstore_half${vec}_rte(${val}, 0, ${ptr});\
% endif
% endif
</%def>

## float<VEC> type name
<%def name="fv(vec)">float${"" if vec == 1 else vec}</%def>
