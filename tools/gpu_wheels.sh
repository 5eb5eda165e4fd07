#!/usr/bin/env bash
# Fetch (here, with PyPI) the wheels that the GPU machine lacks into .whl/ for
# tools/gpu_check.sh: its Python 3.12 image has numpy, pytest, hypothesis and
# matplotlib, not pyopencl or mako. .whl/ is ignored by git (add it to the device
# call's carry list).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pkg in pyopencl pytools platformdirs siphash24 mako; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat[@]}" -d .whl "$pkg" ||
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl "$pkg"
done
ls -la .whl
