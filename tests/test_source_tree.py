"""The source tree: importing pyalloc from a folder where its compiled modules are not built fails
with one clear line, and no function or Cython module of pyalloc/ is over its length limit.

After a plain `pip install .`, Python started inside the checkout finds the source folder pyalloc/
before the installed package (the current directory comes first on sys.path), and the source
folder has no _core extension: the user must be told why and what to do, not shown
"No module named 'pyalloc._core'". Each test copies pyalloc's Python files, without any built
extension, into a temporary folder and runs Python there with -S, so that neither site-packages
nor an editable install's import hook can supply the real package.

Length limits: no function in pyalloc/ (its .py files read by Python's ast; its .pyx and .pxd files
by function_lengths below) is over MAX_FUNCTION_LINES lines, and no .pyx over MAX_PYX_LINES, so that
each reads as one job.
"""
import ast
import re
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


# -- length limits -----------------------------------------------------------------------------

MAX_FUNCTION_LINES = 120
MAX_PYX_LINES = 900

_STRING_START = re.compile("(?i)[rbufc]{0,2}('''|\"\"\"|'|\")")   # a prefix, then its quotes
# Statements that start like a Cython function but open no function body.
_NOT_FUNCTIONS = {"class", "struct", "union", "enum", "extern", "cppclass", "fused", "packed",
                  "ctypedef"}
# Words of a Cython signature before the function's name, and after it before its body.
_SIGNATURE_WORDS = {"def", "cdef", "cpdef", "async", "inline", "public", "api", "readonly", "const",
                    "noexcept", "nogil", "except", "with", "gil", "unsigned", "signed", "long",
                    "short"}
_CALL_NAME = re.compile(r"([A-Za-z_]\w*)\s*\(")


def logical_lines(text):
    """[(first line, last line, indent, code)] of each logical line of Python or Cython source that
    holds code: a statement with its continuation lines (open brackets, a trailing backslash,
    triple-quoted strings). In `code` every string literal is '' and comments are dropped, so that
    a colon, bracket or '#' inside a literal or a docstring's dedented text changes nothing."""
    out = []
    depth = 0                 # open brackets
    string_end = None         # the quotes that close the string being read
    code, first, indent = [], None, 0
    for number, raw in enumerate(text.splitlines(), 1):
        i = 0
        if first is None:
            stripped = raw.lstrip(" \t")
            if not stripped or stripped.startswith("#"):
                continue      # a blank or comment line between statements
            first, indent = number, len(raw) - len(stripped)
            i = indent
        continued = False
        while i < len(raw):
            ch = raw[i]
            if string_end is not None:
                if ch == "\\":
                    i += 2    # an escaped character (a raw string's quote too) ends no string
                elif raw.startswith(string_end, i):
                    i += len(string_end)
                    string_end = None
                    code.append("''")
                else:
                    i += 1
                continue
            if ch == "#":
                break
            if ch == "\\" and i == len(raw) - 1:
                continued = True
                break
            match = _STRING_START.match(raw, i)
            # A prefix letter starts a string only at the start of a word (`ab"` is no b"...").
            if match and (match.group(0)[0] in "'\"" or i == 0 or not (raw[i - 1].isalnum()
                                                                       or raw[i - 1] == "_")):
                string_end = match.group(1)
                i = match.end()
                continue
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                depth = max(depth - 1, 0)
            code.append(ch)
            i += 1
        if string_end is not None and len(string_end) == 1:
            string_end = None     # a one-quote string cannot go on past its line
        if string_end is None and depth == 0 and not continued:
            out.append((first, number, indent, "".join(code).strip()))
            code, first = [], None
        else:
            code.append(" ")
    return out


def function_name(code):
    """The name of the function whose body the logical line `code` opens (def, async def, cdef,
    cpdef, with any modifiers and return type), else None: a cdef class, struct, enum or extern
    block opens no function, and a signature without a body (a .pxd or extern declaration, a
    one-line function) is no function to measure."""
    words = code.split()
    if not words or words[0] not in ("def", "cdef", "cpdef", "async"):
        return None
    if words[0] == "async" and words[1:2] != ["def"]:
        return None
    if not code.endswith(":") or "(" not in code:
        return None
    if words[0] == "cdef":
        kind = words[2] if len(words) > 2 and words[1] in ("public", "api", "readonly") else words[1]
        if kind.rstrip(":") in _NOT_FUNCTIONS:
            return None
    for match in _CALL_NAME.finditer(code):
        if match.group(1) not in _SIGNATURE_WORDS:
            return match.group(1)
    return None


def function_lengths(text):
    """[(name, def line, lines)] of every function with a body in Python or Cython source, nested
    ones and methods of (cdef) class bodies included, each counted as Python's ast counts a
    function: from its def line (decorators above it not counted) to its body's last line of
    code, comments and blank lines after it not counted."""
    lines = logical_lines(text)
    found = []
    for k, (first, last, indent, code) in enumerate(lines):
        name = function_name(code)
        if name is None:
            continue
        end = last
        for _, body_last, body_indent, _ in lines[k + 1:]:
            if body_indent <= indent:
                break
            end = body_last
        found.append((name, first, end - first + 1))
    return found


def ast_function_lengths(text):
    """[(name, def line, lines)] of every function in Python source, from Python's ast."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def over_limit(files, lengths, root=PACKAGE.parent):
    """'file: name (def line N) is L lines' for each function of `files` over the limit, as
    `lengths` (ast_function_lengths or function_lengths) counts; files named from `root`."""
    return [f"{f.relative_to(root)}: {name} (def line {line}) is {size} lines"
            for f in files for name, line, size in lengths(f.read_text(encoding="utf-8"))
            if size > MAX_FUNCTION_LINES]


def test_no_python_function_in_pyalloc_is_over_the_limit():
    files = sorted(PACKAGE.glob("*.py"))
    assert files
    long_functions = over_limit(files, ast_function_lengths)
    assert not long_functions, f"over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)


def test_no_cython_function_in_pyalloc_is_over_the_limit():
    files = sorted([*PACKAGE.glob("*.pyx"), *PACKAGE.glob("*.pxd")])
    assert files
    long_functions = over_limit(files, function_lengths)
    assert not long_functions, f"over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)


def test_no_pyx_module_in_pyalloc_is_over_the_limit():
    long_files = [f"{f.name} is {n} lines" for f in sorted(PACKAGE.glob("*.pyx"))
                  if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_PYX_LINES]
    assert not long_files, f"over {MAX_PYX_LINES} lines: " + ", ".join(long_files)


def test_the_cython_counter_agrees_with_ast_on_every_python_file():
    # Python is Cython's subset: on pyalloc's own .py files the counter must find every function
    # of more than one line that ast finds, at the same line, with the same length.
    files = sorted([*PACKAGE.glob("*.py"), *PACKAGE.parent.glob("tests/*.py"),
                    *PACKAGE.parent.glob("bench/*.py")])
    for f in files:
        text = f.read_text(encoding="utf-8")
        expected = sorted(x for x in ast_function_lengths(text) if x[2] > 1)
        assert sorted(function_lengths(text)) == expected, f.name


CYTHON_SAMPLE = '''\
cdef extern from "x.h" nogil:
    int declared(int a)
    ctypedef struct Thing:
        int field

cdef struct Pair:
    int a
cdef int declared_in_a_pxd(int a) noexcept nogil

cdef inline int inline_one(int a,
                           int b) noexcept nogil:
    """A docstring whose text goes
left of the body: def fake(x):
    and (brackets"""
    cdef int c = a + b  # a comment ( with a bracket
    return c
# a comment at the margin does not end the function
    return 0

@cython.boundscheck(False)
cpdef (int, int) cpdef_two(self, str sep=":"):
    return 1, 2


cdef class Holder(Base):
    cdef int counted

    def __init__(self):
        self.counted = {1: 2,
    3: 4}

    cdef object method(self) except? -1:
        def nested():
            return 1
        return nested

cdef public api int exported(int a) except -1:
    return a
'''


def test_the_cython_counter_reads_cdef_cpdef_inline_class_bodies_decorators_and_docstrings():
    assert function_lengths(CYTHON_SAMPLE) == [
        ("inline_one", 10, 9), ("cpdef_two", 21, 2), ("__init__", 28, 3), ("method", 32, 4),
        ("nested", 33, 2), ("exported", 37, 2)]


def test_a_long_function_is_named_with_its_file_and_length(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = tmp_path / "pyalloc" / "_long.pyx"
    source.parent.mkdir()
    source.write_text(f"cdef int long_one(int a) nogil:\n{body}")
    assert over_limit([source], function_lengths, root=tmp_path) == [
        f"pyalloc/_long.pyx: long_one (def line 1) is {MAX_FUNCTION_LINES + 1} lines"]


def unit_definitions(text):
    """The byte units (KiB, MiB, GiB, TiB) a module assigns at its top level."""
    found = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                found += [n.id for n in names if isinstance(n, ast.Name)
                          and n.id in ("KiB", "MiB", "GiB", "TiB")]
    return found


def test_the_tests_take_their_byte_units_from_one_module():
    tests = Path(__file__).resolve().parent
    defined = {f.name: unit_definitions(f.read_text()) for f in sorted(tests.glob("*.py"))
               if f.name != "units.py"}
    assert {name: units for name, units in defined.items() if units} == {}


def test_a_module_that_defines_its_own_units_is_found():
    assert unit_definitions("MiB = 1 << 20\nKiB, GiB = 1 << 10, 1 << 30\nx = MiB\n") == ["MiB", "KiB", "GiB"]
