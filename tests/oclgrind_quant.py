"""Quantized-page decode under Oclgrind (run by test_quant.py in a subprocess whose
environment switches the simulator's checkers on): values against the float64 oracle
on the dequantized pages, then garbage device tables (clamped, never out of bounds)."""
import sys
import warnings

import numpy as np
from cases import compare, decode_args, make_case
from naive import naive_decode

import clattn
from clattn import quant, runtime

PROFILES = {"rows": "generic-cpu",
            "tiled": {"strategy": "tiled", "thread_limit": 32}}


def main(strategy: str, kf: str, vf: str) -> None:
    cl = runtime.cl()
    dev = runtime.select_device("oclgrind")
    # the rows kernel's two ways with quantized keys: a group of 8 scales each key chunk
    # once per row (q8_0 here), a group of 2 each head's block sums (q4_0)
    H = 16 if (strategy, kf) == ("rows", "q8_0") else 4
    spec = clattn.AttentionSpec(H, 2, 32, page_size=4, dtype="float16", k_format=kf,
                                v_format=vf, sliding_window=True)
    fspec = clattn.AttentionSpec(H, 2, 32, page_size=4, dtype="float32", sliding_window=True)
    case = make_case(fspec, [9, 0, 14], seed=2, window=[3, 0, 6], sinks=[1, 0, 2], rope=True)
    pool = quant.pack_pool(case["pages"][:, 0], case["pages"][:, 1], spec.layout)
    dk, dv = quant.unpack_pool(pool, spec.layout)
    case["q"] = case["q"].astype(np.float16)
    args, kw = decode_args(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dec = clattn.BatchDecode(spec, dev, profile=PROFILES[strategy])
    print(f"fold_merge: {dec.profile.fold_merge}", flush=True)  # test_oclgrind.FOLD_MARK
    # rotary_mode 0: the rows kernel scores the codes (one scale per block); 1: dequantized
    for kw["rotary_mode"], split in ((1, False), (1, 4), (0, False)):
        res = dec.run(args[0], pool, *args[2:], split=split, **kw)
        ref = naive_decode(args[0], np.stack([dk, dv], 1).astype(np.float64), *args[2:], **kw)
        compare(res.out, res.lse, *ref, "float16",
                what=f"rotary_mode={kw['rotary_mode']} split={split}: ")
    queue = dec.setup.runtime.queue
    d = lambda a: cl.array.to_device(queue, np.asarray(a, np.int32))  # noqa: E731
    P = pool.shape[0]
    bad = dec.run(cl.array.to_device(queue, args[0]), cl.array.to_device(queue, pool),
                  d([0, 5, 5, 9]), d([P + 7, -3, 2**30, 1, 0, P, -1, 2, 3]),
                  d([9, 0, -4]), window_offset=d([100, -5, 3]), sink_size=d([-1, 2**31 - 1, 9]),
                  q_pos=d([0, 2**31 - 1, -2**31]), k_pos_offset=d([2**31 - 64, 0, -7]),
                  rotary_mode=1)
    assert bad.out.get().shape == (3, H, 32)
    print(f"CLATTN-OCLGRIND-OK quant {strategy} {kf} {vf}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
