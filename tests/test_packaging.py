"""The kernel templates (the repository's top-level ``kernels/``) reach both kinds of
install: a wheel carries them inside the package (``clattn/kernels``), an editable install
reads them where they are; each is installed in a fresh venv and renders every kernel."""
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
    want = sorted(p.name for p in (ROOT / "kernels").glob("*.mako"))
    assert want and sorted(p.name for p in Path(kdir).glob("*.mako")) == want
    assert int(nchars) > 1000
    out = _installed_run(py, tmp_path, deps, RENDER_EVERY_KIND)
    assert out[1] == kdir and int(out[-2]) >= 6


#: renders one kernel of every template family in the installed clattn, prints its
#: module, the templates' folder and the number of kinds rendered
RENDER_EVERY_KIND = """
import clattn, clattn.cli as cli, clattn.codegen as c
print(clattn.__file__); print(c.KERNELS_DIR)
kinds = sorted(cli.RENDER_KINDS)
for kind in kinds:
    assert cli.main(["render", kind, "--heads", "8", "--kv-heads", "2", "--head-dim", "64"]) == 0
print(len(kinds))
"""


def _installed_run(py, tmp_path, deps, code):
    res = subprocess.run([str(py), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": deps})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.split("\n")


def test_editable_install_renders_every_kernel(tmp_path):
    """``pip install -e``: clattn imported from this tree, templates read from its
    top-level ``kernels/``, every render kind of ``clattn render`` works."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)],
                   check=True)
    out = _installed_run(py, tmp_path, sysconfig.get_paths()["purelib"], RENDER_EVERY_KIND)
    assert Path(out[0]).resolve().is_relative_to(ROOT / "clattn")
    assert Path(out[1]).resolve() == (ROOT / "kernels").resolve()
    assert int(out[-2]) >= 6
