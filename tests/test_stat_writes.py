"""Statistics change only in the commit steps (pyalloc/_state.pxd).

README and _state.pxd say so, and a statistic written anywhere else drifts: the split and merge
once updated inactive_split in _policy.pxd and the expandable segments a private pool's
device_allocations in _expandable.pyx, each beside its own copy of the surgery. These tests read
the core's sources and fail when a statistic helper is called, or a counter written, outside
_state.pxd (the helpers' own definitions in _types.h / _types.pxd apart); and check that the inline
layers cimport one another without a circle.
"""
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pyalloc"

# tools/gpu-check.sh runs the suite from a copy of tests/ beside no sources: nothing to read there.
pytestmark = pytest.mark.skipif(not (PACKAGE / "_state.pxd").exists(),
                                reason=f"needs pyalloc's source folder at {PACKAGE}")

# The statistic helpers of _types.h (a row's or a single statistic's update and resets).
HELPER_CALL = re.compile(r"\b(stat_(?:up|down|add|pool|move|reset_peak|reset_accumulated)"
                         r"|single_reset_accumulated)\s*\(")
# Writes through a member to a counter of CoreState, PrivatePool or a statistic row / entry.
COUNTERS = ("device_allocations", "reserved_bytes", "total_allocated_memory", "page_remaps",
            "num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
            "num_device_free")
COUNTER_WRITE = re.compile(
    r"(?:\.(?:" + "|".join(COUNTERS) + r")"
    r"|\.oversize_(?:allocations|segments)(?:\.\w+)?"
    r"|\.stats\[[^\]]*\](?:\.\w+)*)\s*(?:\+=|-=|=(?!=))")
# A helper's definition in _types.h: its signature up to the brace that closes its body.
HELPER_DEFINITION = re.compile(r"^(?:PYALLOC_INLINE|inline) (?:void|int64_t) (?:stat|single)_\w+"
                               r"\([^)]*\)\s*\{(?:[^\n]*\}[ \t]*$|.*?^\})", re.M | re.S)
# A helper's declaration in _types.pxd.
HELPER_DECLARATION = re.compile(r"^\s+(?:void|int64_t) (?:stat|single)_\w+\(.*$", re.M)


def without_comments(text, suffix):
    """`text` with its comments blanked (their mentions of a helper are not calls)."""
    if suffix in (".h", ".cpp"):
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        return re.sub(r"//[^\n]*", "", text)
    return re.sub(r"#[^\n]*", "", text)


def stat_writes(name, text):
    """(file name, line number, line) of each statistic write in source `text` of file `name`
    that is outside the commit steps."""
    if name == "_state.pxd":
        return []
    suffix = Path(name).suffix
    text = without_comments(text, suffix)
    if name == "_types.h":
        text = HELPER_DEFINITION.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    if name == "_types.pxd":
        text = HELPER_DECLARATION.sub("", text)
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if HELPER_CALL.search(line) or COUNTER_WRITE.search(line):
            found.append((name, number, line.strip()))
    return found


def core_sources():
    for pattern in ("*.pyx", "*.pxd", "*.h", "*.cpp"):
        yield from sorted(PACKAGE.glob(pattern))


def test_statistics_are_written_only_by_the_commit_steps():
    found = [hit for path in core_sources() for hit in stat_writes(path.name, path.read_text())]
    assert found == [], "statistics written outside _state.pxd:\n" + "\n".join(
        f"  {name}:{number}: {line}" for name, number, line in found)


def test_the_checker_finds_a_helper_call_and_a_counter_write():
    text = ("cdef inline void f(CoreState* st, BlockPool* pool) noexcept nogil:\n"
            "    stat_pool(&st.stats[ST_INACTIVE_SPLIT], pool.is_small, 1)\n"
            "    pool.owner.device_allocations -= 1\n"
            "    st.stats[ST_SEGMENT].all_current = 0\n"
            "    st.oversize_segments.peak = 0\n"
            "    # stat_up(...) in a comment, and a read: x = pool.owner.device_allocations\n"
            "    if pool.owner.device_allocations == 0:\n"
            "        return\n")
    assert [number for _, number, _ in stat_writes("_policy.pxd", text)] == [2, 3, 4, 5]
    assert stat_writes("_state.pxd", text) == []


def test_the_checker_allows_the_helpers_own_definitions_only():
    header = ("PYALLOC_INLINE void stat_pool(StatRow* row, bool small_pool, int64_t delta) {\n"
              "    if (delta >= 0) stat_up(row, small_pool ? 1 : 2, delta);\n"
              "}\n"
              "inline void single_reset_accumulated(Stat* s) { s->allocated = 0; }\n"
              "inline void other(StatRow* row) { stat_up(row, 1, 1); }\n")
    assert [number for _, number, _ in stat_writes("_types.h", header)] == [5]


# ------------------------------------------------------------------------------- cimport layers

CIMPORT = re.compile(r"^from pyalloc\.(\w+) cimport", re.M)


def cimport_graph():
    """Module -> the pyalloc modules its .pxd and .pyx cimport (a .pyx and its .pxd are one)."""
    graph = {}
    for path in sorted(PACKAGE.glob("*.pxd")) + sorted(PACKAGE.glob("*.pyx")):
        graph.setdefault(path.stem, set()).update(
            set(CIMPORT.findall(path.read_text())) - {path.stem})
    return graph


def test_the_inline_layers_cimport_only_the_ones_below():
    # _types (data) <- _policy (decisions) <- _state (statistics) <- _blocks (surgery): the policy
    # decides without changing anything, the commit steps ask the policy whether a block is
    # oversize, the surgery calls the commit steps; a cimport upwards would close a circle.
    layers = ["_types", "_policy", "_state", "_blocks"]
    graph = cimport_graph()
    assert set(layers) <= graph.keys()
    for i, name in enumerate(layers):
        above = set(layers[i + 1:])
        assert not graph[name] & above, f"{name} cimports {sorted(graph[name] & above)}"


# A comparison with max_split_size, on either side.
SPLIT_RULE = re.compile(r"(?:[<>]=?|[!=]=)\s*[\w.\[\]&]*\bmax_split_size\b"
                        r"|\bmax_split_size\b\s*(?:[<>]=?|[!=]=)")


def test_only_the_policy_interprets_max_split_size():
    # (Assignments apart: the allocator sets it from its configuration, and keeps the value it
    # started with for PyTorch's max_split_size statistic.)
    readers = sorted(p.name for p in core_sources()
                     if SPLIT_RULE.search(without_comments(p.read_text(), p.suffix)))
    assert readers == ["_policy.pxd"], readers


def test_the_split_rule_finder_sees_a_comparison_either_way():
    assert SPLIT_RULE.search("if b.size >= s.max_split_size:")
    assert SPLIT_RULE.search("return s.max_split_size == kSizeMax")
    assert not SPLIT_RULE.search("s.max_split_size = settings.max_split_size")
