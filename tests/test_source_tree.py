"""Importing pyalloc from a folder where its compiled modules are not built fails with one clear line.

After a plain `pip install .`, Python started inside the checkout finds the source folder pyalloc/
before the installed package (the current directory comes first on sys.path), and the source
folder has no _core extension: the user must be told why and what to do, not shown
"No module named 'pyalloc._core'". Each test copies pyalloc's Python files, without any built
extension, into a temporary folder and runs Python there with -S, so that neither site-packages
nor an editable install's import hook can supply the real package.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pyalloc"

# tools/gpu-check.sh runs the suite from a copy of tests/ beside no sources: nothing to copy there.
pytestmark = pytest.mark.skipif(not (PACKAGE / "_core.pyx").exists(),
                                reason=f"needs pyalloc's source folder at {PACKAGE}")


@pytest.fixture
def checkout(tmp_path):
    """A folder laid out like a source checkout: pyalloc/ with its .py and .pyx files, unbuilt."""
    (tmp_path / "pyalloc").mkdir()
    for pattern in ("*.py", "*.pyx", "*.pxd", "*.h"):
        for f in PACKAGE.glob(pattern):
            shutil.copy(f, tmp_path / "pyalloc" / f.name)
    assert not list((tmp_path / "pyalloc").glob("*.so"))
    return tmp_path


def python(cwd, *args):
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


def assert_says_why_and_what_to_do(line, folder):
    assert "source tree" in line and str(folder / "pyalloc") in line
    assert "pip install --no-build-isolation -e ." in line and "another folder" in line


def test_python_m_pyalloc_in_the_source_tree_prints_one_line_and_fails(checkout):
    for args in (["-m", "pyalloc"], ["-m", "pyalloc", "tune", "examples/small_train.pickle.gz"]):
        r = python(checkout, *args)
        assert r.returncode != 0
        assert r.stdout == ""
        lines = r.stderr.splitlines()
        assert len(lines) == 1, r.stderr
        assert "Traceback" not in r.stderr and lines[0].startswith("pyalloc: ")
        assert_says_why_and_what_to_do(lines[0], checkout)


def test_import_pyalloc_in_the_source_tree_raises_an_import_error_that_says_what_to_do(checkout):
    code = ("try:\n    import pyalloc\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc.name, '|', exc)\n")
    r = python(checkout, "-c", code)
    assert r.returncode == 0, r.stderr
    kind, name, _, message = r.stdout.strip().split(" ", 3)
    assert (kind, name) == ("ImportError", "pyalloc")
    assert_says_why_and_what_to_do(message, checkout)
    assert "\n" not in message


def test_an_installed_package_missing_its_extension_is_told_to_reinstall(checkout):
    # An installed package has no .pyx sources: the advice is to reinstall, not to change folder.
    for f in (checkout / "pyalloc").glob("*.pyx"):
        f.unlink()
    r = python(checkout, "-m", "pyalloc")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    (line,) = r.stderr.splitlines()
    assert "lacks its compiled module pyalloc._core" in line and "reinstall" in line


def test_other_missing_modules_are_not_disguised(checkout):
    # Only pyalloc's own compiled modules get the explanation: a module that the core itself
    # fails to find keeps Python's own error.
    (checkout / "pyalloc" / "_core.py").write_text("import no_such_module_for_pyalloc_test\n")
    r = python(checkout, "-c", "import pyalloc")
    assert r.returncode != 0
    assert "No module named 'no_such_module_for_pyalloc_test'" in r.stderr
    assert "source tree" not in r.stderr
