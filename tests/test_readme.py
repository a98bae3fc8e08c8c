"""Every snippet and command of README.md and docs/*.md runs as written.

A fenced block's info string is its language and, after it, at most one tag:

* ```python: executed verbatim, each block in a fresh namespace and a fresh temporary working
  directory (the blocks write files such as mem.pickle); they use the simulated device.
* ```bash: each command (a line, with backslash continuations joined) runs in bash in a scratch
  folder whose examples/, tests/, bench/ and tools/ are links to the repository's, with the
  `pyalloc` command of this interpreter first on PATH, and must exit 0.
* ```console: each `$ command` runs the same way, and the lines under it (up to the next `$`)
  must appear in its output in that order; a line `...` stands for any number of lines.
* tag `gpu` (needs the GPU machine) or `slow` (minutes of benchmarks): not run here; every
  repository path the block names must exist, every Python script it runs must compile and, where
  it parses arguments with argparse, answer --help; a python block must compile, and the pyalloc
  and torch attributes it names (torch where installed) must exist.
* tag `suite`: pytest commands over test files that `pytest tests` runs anyway: the files must exist.
* tag `setup`: installs or builds, which .ci/run does: each command must appear in .ci/run, or the
  block's section must be one .ci/run extracts and runs (it names the file and the heading).

The figures table of README.md gives the command of every figure: the figures of a `pyalloc`
command must appear in what that command prints.
"""
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README] + sorted((ROOT / "docs").glob("*.md"))
CI_RUN = ROOT / ".ci" / "run"
FENCE = re.compile(r"^```(\w+)[ \t]*(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
LANGUAGES = {"python", "bash", "console"}
TAGS = {"", "gpu", "slow", "suite", "setup"}
LINKED = ("examples", "tests", "bench", "tools")


def blocks():
    """[(path, line of the opening fence, language, tag, code, heading)] of every fenced block."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            before = text[:m.start()]
            headings = re.findall(r"^(#{1,3} .*)$", before, re.M)
            out.append((path, before.count("\n") + 1, m.group(1), m.group(2), m.group(3),
                        headings[-1] if headings else ""))
    return out


BLOCKS = blocks()


def ident(path, line):
    return f"{path.relative_to(ROOT)}:{line}"


def strip_comment(line):
    """`line` without its shell comment (a # that starts a word outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(code):
    """The commands of a bash block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [c for c in (strip_comment(line).strip() for line in joined.splitlines()) if c]


def of_kind(language, tag):
    return [b for b in BLOCKS if b[2] == language and b[3] == tag]


@pytest.fixture
def scratch(tmp_path):
    """A folder that sees the repository's data and tools, and the environment to run commands in."""
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), COLUMNS="100")
    return tmp_path, env


def run(command, scratch):
    folder, env = scratch
    return subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=300)


# ------------------------------------------------------------------------------ the pages

def test_readme_fits_on_a_page():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200


def test_every_block_has_a_known_language_and_tag():
    assert {(ident(p, n), lang, tag) for p, n, lang, tag, _, _ in BLOCKS
            if lang not in LANGUAGES or tag not in TAGS} == set()
    # Guards the extraction itself: as many fences open as the regular expression found.
    assert len(BLOCKS) == sum(len(re.findall(r"^```\w", p.read_text(encoding="utf-8"), re.M))
                              for p in DOCS)


def test_every_page_the_readme_links_exists():
    names = set(re.findall(r"\bdocs/[\w-]+\.md\b", README.read_text(encoding="utf-8")))
    assert names and {n for n in names if not (ROOT / n).exists()} == set()
    assert {p.name for p in DOCS[1:]} <= {Path(n).name for n in names}     # and every page is linked


def test_differences_has_the_section_others_append_to():
    text = (ROOT / "docs" / "differences.md").read_text(encoding="utf-8")
    assert text.rstrip().splitlines()[-3].startswith("## More differences")


# ------------------------------------------------------------------------------ python

PY_RUN = of_kind("python", "")


@pytest.mark.parametrize("path, line, code", [(p, n, c) for p, n, _, _, c, _ in PY_RUN],
                         ids=[ident(p, n) for p, n, *_ in PY_RUN])
def test_python_block_runs(path, line, code, tmp_path, monkeypatch):
    import pyalloc
    monkeypatch.chdir(tmp_path)
    # Blank lines in front keep the line numbers of a traceback those of the page.
    program = compile("\n" * line + code, str(path), "exec")
    try:
        exec(program, {"__name__": "__readme__"})
    finally:
        pyalloc.set_memory_metadata("")    # a block may leave this thread's metadata set
        pyalloc.record_memory_history(None)
    assert os.getcwd() == str(tmp_path)


def _resolve(dotted):
    """Import the longest module prefix of `dotted`, then get the remaining attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


PY_GPU = [b for b in BLOCKS if b[2] == "python" and b[3] == "gpu"]


@pytest.mark.parametrize("path, line, code", [(p, n, c) for p, n, _, _, c, _ in PY_GPU],
                         ids=[ident(p, n) for p, n, *_ in PY_GPU])
def test_gpu_python_block_compiles_and_names_what_exists(path, line, code):
    compile(code, str(path), "exec")
    names = set(re.findall(r"\b((?:pyalloc|torch)(?:\.\w+)+)", code))
    assert names
    for name in sorted(names):
        if name.startswith("torch"):
            try:
                import torch  # noqa: F401
            except ImportError:
                continue
        _resolve(name)


# ------------------------------------------------------------------------------ bash and console

BASH_RUN = [(p, n, cmd) for p, n, lang, tag, code, _ in BLOCKS if lang == "bash" and tag == ""
            for cmd in commands(code)]


@pytest.mark.parametrize("path, line, command", BASH_RUN,
                         ids=[f"{ident(p, n)}:{c[:60]}" for p, n, c in BASH_RUN])
def test_bash_command_runs(path, line, command, scratch):
    r = run(command, scratch)
    assert r.returncode == 0, f"{command}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


def console_sessions(code):
    """[(command, [expected lines])] of a console block."""
    out = []
    for line in code.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line.rstrip())
    return out


CONSOLE = [(p, n, cmd, want) for p, n, lang, _, code, _ in BLOCKS if lang == "console"
           for cmd, want in console_sessions(code)]


def appears_in_order(want, got):
    """The first line of `want` not found in order in `got` (`...` skips any lines), or None."""
    got = [g.rstrip() for g in got]
    i = 0
    skipping = False
    for w in want:
        if w == "...":
            skipping = True
            continue
        while i < len(got) and got[i] != w and skipping:
            i += 1
        if i >= len(got) or got[i] != w:
            return w
        i += 1
        skipping = False
    return None


@pytest.mark.parametrize("path, line, command, want", CONSOLE,
                         ids=[f"{ident(p, n)}:{c[:60]}" for p, n, c, _ in CONSOLE])
def test_console_command_prints_what_the_page_shows(path, line, command, want, scratch):
    r = run(command, scratch)
    assert r.returncode == 0, r.stderr
    missing = appears_in_order(want, r.stdout.splitlines())
    assert missing is None, (f"{ident(path, line)}: `{command}` no longer prints {missing!r} "
                             f"where the page shows it; paste its new output:\n{r.stdout}")


def test_console_matching_needs_the_lines_in_order():
    assert appears_in_order(["a", "...", "c"], ["a", "b", "c"]) is None
    assert appears_in_order(["a", "c"], ["a", "b", "c"]) == "c"
    assert appears_in_order(["a", "...", "a"], ["a", "b", "c"]) == "a"      # no second "a"
    assert appears_in_order(["b"], ["a", "b"]) == "b"      # without "...", from the first line


# ------------------------------------------------------------------------------ not run here

PATH_WORD = re.compile(r"\b((?:bench|tools|tests|examples)/[\w./*-]+)")
OFFLINE = [(p, n, tag, code) for p, n, lang, tag, code, _ in BLOCKS
           if lang == "bash" and tag in ("gpu", "slow", "suite")]


@pytest.mark.parametrize("path, line, tag, code", OFFLINE, ids=[ident(p, n) for p, n, *_ in OFFLINE])
def test_gpu_and_slow_commands_name_files_that_exist(path, line, tag, code):
    named = set(PATH_WORD.findall(code))
    assert named
    assert {n for n in named if not list(ROOT.glob(n.rstrip("."))) } == set()


SCRIPTS = sorted({(m.group(1)) for p, n, tag, code in OFFLINE if tag in ("gpu", "slow")
                  for m in re.finditer(r"python3? ((?:bench|tools)/[\w/-]+\.py)", code)})


@pytest.mark.parametrize("script", SCRIPTS)
def test_gpu_and_slow_python_scripts_compile_and_answer_help(script):
    source = (ROOT / script).read_text(encoding="utf-8")
    compile(source, script, "exec")
    if "argparse" in source:
        r = subprocess.run([sys.executable, str(ROOT / script), "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr[-2000:]


SETUP = [(p, n, code, heading) for p, n, lang, tag, code, heading in BLOCKS
         if lang == "bash" and tag == "setup"]


@pytest.mark.parametrize("path, line, code, heading", SETUP, ids=[ident(p, n) for p, n, *_ in SETUP])
def test_setup_commands_are_what_ci_runs(path, line, code, heading):
    ci = CI_RUN.read_text(encoding="utf-8")
    extracted = f"/^{heading}/" in ci and str(path.relative_to(ROOT)) in ci
    if not extracted:
        missing = [c for c in commands(code) if c not in ci]
        assert missing == [], f".ci/run does not run {missing} ({ident(path, line)})"


def test_ci_runs_the_readmes_exact_two_commands():
    ci = CI_RUN.read_text(encoding="utf-8")
    lines = README.read_text(encoding="utf-8").splitlines()
    for name in ("README_INSTALL_COMMAND", "README_TEST_COMMAND"):
        command = re.search(rf'^{name}="(.*)"$', ci, re.M).group(1)
        assert command in lines                         # a whole line of README.md, as CI greps it
        assert f'"${name}"' in ci


def test_the_test_command_builds_nothing():
    # It installs the test tools only: pyalloc is built once, by the first command.
    ci = CI_RUN.read_text(encoding="utf-8")
    command = re.search(r'^README_TEST_COMMAND="(.*)"$', ci, re.M).group(1)
    assert command.startswith("pip install -r tests/requirements.txt && ")
    assert " . " not in f" {command} " and ".[" not in command


# ------------------------------------------------------------------------------ figures

def figure_rows():
    """[(value, command)] of README's figures table rows whose command is a pyalloc command."""
    out = []
    for line in README.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[2].startswith("`pyalloc "):
            out.append((cells[1], cells[2].strip("`")))
    return out


FIGURES = figure_rows()


def test_readme_figures_table_has_pyalloc_rows():
    assert len(FIGURES) >= 2


@pytest.mark.parametrize("value, command", FIGURES, ids=[c[:60] for _, c in FIGURES])
def test_readme_figure_is_what_its_command_prints(value, command, scratch):
    r = run(command, scratch)
    assert r.returncode == 0, r.stderr
    quantities = re.findall(r"\d[\d.,]*\s(?:MiB|GiB|KiB|bytes)", value)
    assert quantities
    assert [q for q in quantities if q not in r.stdout] == []
    for word in re.findall(r"\b\w+:\w+\b", value):       # a setting named in the value
        assert word in r.stdout


def test_readme_figures_table_commands_name_files_that_exist():
    rows = [line for line in README.read_text(encoding="utf-8").splitlines()
            if line.startswith("| ") and line.rstrip().endswith("` |")]
    named = {n for row in rows for n in PATH_WORD.findall(row.rsplit("|", 2)[-2])}
    assert named and {n for n in named if not (ROOT / n).exists()} == set()


def test_every_repository_path_the_pages_name_exists():
    # Prose names scripts and data too (e.g. "`python bench/compare_builds.py OLD NEW`").
    named = {(p.relative_to(ROOT), n.rstrip(".,;:)")) for p in DOCS
             for n in PATH_WORD.findall(p.read_text(encoding="utf-8"))}
    assert {(str(p), n) for p, n in named if not list(ROOT.glob(n))} == set()
