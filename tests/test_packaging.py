"""The wheel carries the kernel templates: build it, install it in a fresh venv, render there."""
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_kernels(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "-q", "-w", str(wheels), str(ROOT)], check=True)
    whl = next(wheels.glob("clattn-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(whl)], check=True)
    # run-time dependencies come from this interpreter's site-packages (PYTHONPATH), while
    # clattn itself must come from the fresh venv (no source tree on the path)
    deps = sysconfig.get_paths()["purelib"]
    code = ("import clattn, clattn.codegen as c, clattn.fit as f; "
            "from clattn.spec import AttentionSpec; from clattn.profiles import get_profile; "
            "d = c.KERNELS_DIR; print(clattn.__file__); print(d); "
            "g = f.decode_geometry(AttentionSpec(8, 2, 64), get_profile('generic'), f.Limits()); "
            "print(len(c.render_decode(AttentionSpec(8, 2, 64), g)))")
    res = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": deps})
    assert res.returncode == 0, res.stderr
    mod, kdir, nchars = res.stdout.split()
    assert str(env_dir) in mod, "clattn was not imported from the fresh venv"
    assert kdir.startswith(str(env_dir))
    # every template of the source tree is in the wheel (whatever the templates are called)
    want = sorted(p.name for p in (ROOT / "clattn" / "kernels").glob("*.mako"))
    assert want and sorted(p.name for p in Path(kdir).glob("*.mako")) == want
    assert int(nchars) > 1000
