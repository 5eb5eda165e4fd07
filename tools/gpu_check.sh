#!/usr/bin/env bash
# One command for a machine with a GPU OpenCL driver: register the driver with the ICD
# loader if nobody has, then run clattn's test suite on that device, the decode, merge,
# split and cache-step benchmarks and `clattn profile`, writing everything to one folder.
#
#   tools/gpu_check.sh [OUTDIR]          (default: $OUT, else ./gpu-results)
#
# Without network (the lent GPU machine), carry .whl/ made by tools/gpu_wheels.sh.
# About 9 minutes at most: it fits one device call (10 minutes).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-results}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=python3

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/clattn-site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/clattn-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

# NVIDIA's OpenCL library may be installed with no .icd naming it: write one in a
# private vendors folder (nothing system-wide is edited).
lib="$(ls /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so* /usr/local/nvidia/lib64/libnvidia-opencl.so* \
        /usr/lib64/libnvidia-opencl.so* 2>/dev/null | head -n1)"
if [ -n "$lib" ]; then
    vend="$(mktemp -d)"
    cp /etc/OpenCL/vendors/*.icd "$vend"/ 2>/dev/null || true
    grep -lq nvidia "$vend"/*.icd 2>/dev/null || echo "$lib" > "$vend/nvidia-clattn.icd"
    export OCL_ICD_VENDORS="$vend"
    echo "NVIDIA OpenCL: $lib (vendors: $vend)" | tee "$out/driver.txt"
else
    echo "no libnvidia-opencl found; using whatever the ICD loader lists" | tee "$out/driver.txt"
fi
nvidia-smi >> "$out/driver.txt" 2>&1 || true

$py -m clattn.cli devices > "$out/devices.txt" 2>&1; cat "$out/devices.txt"
dev="${CLATTN_GPU:-nvidia}"
export PYOPENCL_CTX="$dev" CLATTN_TEST_DEVICES="$dev"

rc=0
timeout 200 $py -m pytest -q -x -p no:cacheprovider tests/test_signatures.py tests/test_fit.py \
    tests/test_kernels.py tests/test_merge.py tests/test_decode_step.py tests/test_nonfinite.py \
    > "$out/tests.txt" 2>&1 || rc=1
tail -n 5 "$out/tests.txt"
for suite in decode split; do
    timeout 90 $py tools/bench.py --suite "$suite" --quick --device "$dev" \
        --json "$out/bench-$suite.json" > "$out/bench-$suite.txt" 2>&1 || rc=1
    tail -n 20 "$out/bench-$suite.txt"
done
# the cache step's host time next to a GPU's kernels (on a CPU device they share the cores)
timeout 45 $py tools/bench.py --suite cache --device "$dev" --batches 1 --contexts 4096 \
    --repeat 5 --json "$out/bench-cache.json" > "$out/bench-cache.txt" 2>&1 || rc=1
tail -n 6 "$out/bench-cache.txt"
timeout 90 $py -m clattn.cli tune --quick --device "$dev" --out "$out/profile.json" \
    > "$out/profile.txt" 2>&1 || rc=1
tail -n 30 "$out/profile.txt"
exit $rc
