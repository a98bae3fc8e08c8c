"""The README's Python examples run as written.

Every ```python block of README.md is executed verbatim, each in a fresh namespace and in a fresh
temporary working directory (the blocks write files such as mem.pickle). The blocks use the
simulated device (backend="sim"), so they run on any machine; a block that needs a GPU does not
belong in the README.
"""
import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks():
    """[(line number of the opening fence, code)] for every ```python block of the README."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in FENCE.finditer(text)]


BLOCKS = python_blocks()


def test_readme_has_python_examples():
    # Guards the extraction itself: the README has (at least) its Library API and history blocks.
    assert len(BLOCKS) >= 2
    assert len(BLOCKS) == README.read_text(encoding="utf-8").count("```python")


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs(line, code, tmp_path, monkeypatch):
    import pyalloc
    monkeypatch.chdir(tmp_path)
    # Blank lines in front keep the line numbers of a traceback those of README.md.
    program = compile("\n" * line + code, str(README), "exec")
    try:
        exec(program, {"__name__": "__readme__"})
    finally:
        pyalloc.set_memory_metadata("")    # a block may leave this thread's metadata set
    assert os.getcwd() == str(tmp_path)
