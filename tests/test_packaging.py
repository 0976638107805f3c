"""The distribution builds (wheel and sdist, ``python -m build``) and its wheel installs and imports.

The distribution is ``pipe-parallel`` (the name ``pipe`` on the package index is another project);
the import name stays ``pipe``. The wheel goes into a fresh virtual environment that sees the
packages of the interpreter running the tests (torch and the rest: no download, fast), wherever
they are installed (the base interpreter or the virtual environment the README creates), and must
import ``pipe`` from itself.
"""
from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_and_sdist_build_and_the_wheel_installs(tmp_path: Path) -> None:
    out = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--sdist",
                            "--outdir", str(out), str(ROOT)], capture_output=True, text=True, timeout=300, env=env)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels, sdists = list(out.glob("pipe_parallel-*.whl")), list(out.glob("pipe_parallel-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())

    home = tmp_path / "venv"
    # Not system_site_packages=True: that inherits the *base* interpreter's packages, which lack torch when the
    # tests run in a virtual environment (as the README's commands do). The running interpreter's own
    # site-packages go on the new environment's path instead, after its own (a .pth file of plain paths).
    venv.create(home, system_site_packages=False, with_pip=False, symlinks=True)
    python = home / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60, env=env, check=True).stdout.strip()
    ours = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    assert ours, f"no site-packages folder on the running interpreter's path: {sys.path}"
    (Path(own) / "outer_site_packages.pth").write_text("\n".join(ours) + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", "--quiet", str(wheels[0])], capture_output=True, text=True,
                               timeout=300, env=env)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    check = ("import importlib.metadata as m, pipe, pipe.distributed; "
             "print(pipe.__file__); print(m.version('pipe-parallel')); print(pipe.Pipe.__name__)")
    ran = subprocess.run([str(python), "-c", check], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    where, version, name = ran.stdout.split()
    assert Path(where).resolve().is_relative_to(home.resolve()), f"imported pipe from {where}, not the wheel"
    assert version == __import__("pipe").__version__ and name == "Pipe"
