"""The build configures where the developer setup puts its venv, and the test tools install alone.

README's developer setup makes the venv inside the checkout (./venv), so cuda.h, which comes from
the nvidia-cuda-runtime wheel, lies under the source tree; meson refuses an absolute path into the
source tree given to include_directories() ("Tried to form an absolute path to a dir in the source
tree"). The test configures (meson setup, nothing compiled: a few seconds) a copy of the build
files whose cuda.h lies in such a venv.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _missing_build_tools():
    """Why meson cannot configure here, or None."""
    if not (ROOT / "meson.build").exists():
        return f"needs the source checkout's meson.build at {ROOT}"
    try:
        import mesonbuild  # noqa: F401
    except ImportError:
        return "needs meson (pip install -r tests/requirements.txt)"
    for tool in ("cython", "ninja"):
        if shutil.which(tool) is None:
            return f"needs {tool} on PATH (pip install -r tests/requirements.txt)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "needs a C++ compiler (meson checks it while configuring)"
    return None


def _copy_build_files(dest):
    shutil.copy(ROOT / "meson.build", dest / "meson.build")
    (dest / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "find_cuda_include.py", dest / "tools")
    shutil.copytree(ROOT / "pyalloc", dest / "pyalloc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))


@pytest.mark.skipif(_missing_build_tools() is not None, reason=str(_missing_build_tools()))
def test_meson_configures_with_the_cuda_header_in_a_venv_inside_the_checkout(tmp_path):
    src = tmp_path / "checkout"
    src.mkdir()
    _copy_build_files(src)
    site = src / "venv" / "lib" / "python3" / "site-packages"
    include = site / "nvidia" / "cu13" / "include"
    include.mkdir(parents=True)
    (include / "cuda.h").write_text("/* stands in for the wheel's header: configure reads no header */\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site)] + sys.path))
    r = subprocess.run([sys.executable, "-m", "mesonbuild.mesonmain", "setup", str(tmp_path / "build"),
                        str(src)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The header really was taken from inside the checkout (the case meson used to refuse).
    assert f"cuda.h include dir: {include}" in r.stdout


def _requirement_names(lines):
    return sorted(re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower() for line in lines)


def test_test_requirements_file_lists_the_test_extra_and_the_build_tools():
    # README's test command installs tests/requirements.txt (which builds nothing); pyproject's
    # `test` extra is the same list for `pip install '.[test]'`: the two must not drift apart.
    lines = [line for line in (ROOT / "tests" / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert sorted(lines) == sorted(extra)
    assert {"meson", "ninja", "cython"} <= set(_requirement_names(lines))


def test_test_requirements_do_not_name_pyalloc_or_a_local_path():
    # A line such as `.` or `-e .` would build pyalloc again: the test command must compile nothing.
    for line in (ROOT / "tests" / "requirements.txt").read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if text:
            assert not text.startswith(("-e", ".", "/", "file:")) and "pyalloc" not in text.lower(), line
