"""Specification of `pyalloc view` and `pyalloc tune --html` (pyalloc/view.py, pyalloc/report_html.py).

The pages are checked the way a person sees them: loaded from disk in a headless Chromium
(tests/chromium.py, over the DevTools protocol), with what the browser drew read back from the DOM
and compared with figures computed another way (pyalloc.replay, PyTorch's own figures in
examples/*.json, the allocator's statistics while the trace was recorded). Browser tests skip,
with the reason, where Chromium or websocket-client is missing.

Traces: examples/small_train.pickle.gz (PyTorch, no stacks, no tags) and traces recorded here with
pyalloc's simulated allocator (tags, stacks, an out-of-memory event, a wrapped ring buffer, a
million events).
"""
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pyalloc
from pyalloc import __main__ as cli
from pyalloc.allocator import CachingAllocator
from pyalloc.replay import replay
from pyalloc.snapshot import load
from pyalloc.tune import tune
from pyalloc.view import analyze, format_summary, reserved_curve
from pyalloc.report_html import view_page, STATE_COLOURS
from pyalloc._sim import SimDevice

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chromium import Chromium, find_chromium  # noqa: E402

from units import MiB, GiB
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "small_train.pickle.gz"
EXAMPLE_FIGURES = json.loads((REPO / "examples" / "small_train.json").read_text())
CHROMIUM = find_chromium()
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium executable (Debian: apt-get install chromium; or set PYALLOC_CHROMIUM)")
MARKUP_TAG = "scratch <b>&"


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, out, err):
    assert rc == 2
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("pyalloc: error: ")
    assert "Traceback" not in err


# -- the pages' style and scripts ---------------------------------------------------------------------

ASSETS = ("report.css", "report_common.js", "report_view.js", "report_tune.js")


@pytest.mark.parametrize("name", ASSETS)
def test_the_page_assets_are_found_as_package_data(name):
    from importlib import resources

    from pyalloc.report_html import asset
    text = asset(name)
    assert text.strip()
    assert text == resources.files("pyalloc").joinpath(name).read_text(encoding="utf-8")


def test_the_view_page_carries_its_style_and_scripts_whole():
    from pyalloc.report_html import asset
    page = view_page(analyze(load(EXAMPLE), path=str(EXAMPLE)))
    assert f"<style>\n{asset('report.css')}</style>" in page
    assert f"<script>\n{asset('report_common.js')}\n{asset('report_view.js')}</script>" in page


@pytest.mark.skipif(not (REPO / "meson.build").exists(), reason="needs the source tree's meson.build")
@pytest.mark.parametrize("name", ASSETS)
def test_the_build_installs_every_page_asset(name):
    # An installed wheel holds what meson.build's install_sources lists: a file missing there
    # would load in an editable install and be absent from every wheel.
    assert f"'pyalloc/{name}'" in (REPO / "meson.build").read_text()


# -- traces recorded here ---------------------------------------------------------------------------

def allocate_kv_cache(allocator):
    # A named function, so that the stack recorded for this allocation names it.
    return allocator.malloc(40 * MiB)


def record_tagged_trace(path):
    """A pyalloc snapshot with tags, stacks (context="all") and one out-of-memory event.
    Returns what the allocator itself reported along the way."""
    allocator = CachingAllocator(0, backend=SimDevice(256 * MiB), config="")
    allocator.record_memory_history(context="all")
    try:
        pyalloc.set_memory_metadata("weights")
        weights = [allocator.malloc(16 * MiB) for _ in range(4)]
        pyalloc.set_memory_metadata("activations")
        acts = [allocator.malloc(8 * MiB) for _ in range(6)]
        for p in acts[:3]:
            allocator.free(p)
        pyalloc.set_memory_metadata(MARKUP_TAG)
        allocator.free(allocator.malloc(1 * MiB))
        pyalloc.set_memory_metadata("kv-cache")
        kv = allocate_kv_cache(allocator)
        at_peak = allocator.memory_by_metadata()
        peak_allocated = allocator.memory_allocated()
        with pytest.raises(pyalloc.OutOfMemoryError):
            allocator.malloc(1 * GiB)
        reserved_at_oom = allocator.memory_reserved()
        pyalloc.set_memory_metadata("")
        for p in acts[3:] + [kv]:
            allocator.free(p)
        allocator.dump_snapshot(str(path))
    finally:
        pyalloc.set_memory_metadata("")
    del weights
    trace = load(path)["device_traces"][0]
    oom_event = next(i for i, e in enumerate(trace) if e["action"] == "oom")
    return {"at_peak": at_peak, "peak_allocated": peak_allocated, "reserved_at_oom": reserved_at_oom,
            "oom_event": oom_event}


def record_wrapped_trace(path):
    """A pyalloc snapshot whose ring buffer kept only the newest 300 of ~2,000 events."""
    allocator = CachingAllocator(0, backend=SimDevice(4 * GiB), config="")
    allocator.record_memory_history(context=None, max_entries=300)
    keep = [allocator.malloc(size) for size in (3 * MiB, 50 * MiB, 700, 120 * MiB)]
    for i in range(700):
        allocator.free(allocator.malloc((i % 13 + 1) * 300 * 1024))
    allocator.dump_snapshot(str(path))
    return keep


def million_event_snapshot():
    """~1,000,000 events with one two-event spike of 3 GiB in the middle (a downsampled timeline
    that kept only averages or samples would lose it)."""
    allocator = CachingAllocator(0, backend=SimDevice(16 * GiB), config="")
    allocator.record_memory_history(context=None, max_entries=sys.maxsize)
    for i in range(333_000):
        p = allocator.malloc(4096 + (i % 97) * 512)
        if i == 200_001:
            allocator.free(allocator.malloc(3 * GiB))
        allocator.free(p)
    return allocator.snapshot()


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    path = tmp_path_factory.mktemp("tagged") / "tagged.pickle"
    facts = record_tagged_trace(path)
    page = path.with_suffix(".html")
    assert cli.main(["view", str(path), "-o", str(page)]) == 0
    return dict(facts, path=path, page=page)


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    path = tmp_path_factory.mktemp("wrapped") / "wrapped.pickle.gz"
    record_wrapped_trace(path)
    page = path.parent / "wrapped.html"
    assert cli.main(["view", str(path), "-o", str(page)]) == 0
    return {"path": path, "page": page}


@pytest.fixture(scope="module")
def example_page(tmp_path_factory):
    page = tmp_path_factory.mktemp("example") / "small_train.html"
    assert cli.main(["view", str(EXAMPLE), "-o", str(page)]) == 0
    return page


@pytest.fixture(scope="module")
def unreplayable_page(tmp_path_factory):
    """The example under a setting pyalloc cannot replay: no block sizes, so no allocated bytes."""
    folder = tmp_path_factory.mktemp("unreplayable")
    snapshot = load(EXAMPLE)
    snapshot["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    pyalloc.snapshot.dump(snapshot, folder / "async.pickle")
    assert cli.main(["view", str(folder / "async.pickle"), "-o", str(folder / "async.html")]) == 0
    return folder / "async.html"


@pytest.fixture(scope="module")
def example_replay():
    return replay(str(EXAMPLE))


@pytest.fixture(scope="module")
def million(tmp_path_factory):
    snapshot = million_event_snapshot()
    view = analyze(snapshot, path="million")
    page = tmp_path_factory.mktemp("million") / "million.html"
    page.write_text(view_page(view), encoding="utf-8")
    return {"snapshot": snapshot, "view": view, "page": page, "replay": replay(snapshot)}


@pytest.fixture(scope="module")
def tune_page(tmp_path_factory):
    page = tmp_path_factory.mktemp("tune") / "tune.html"
    assert cli.main(["tune", str(EXAMPLE), "--jobs", "1", "--html", str(page)]) == 0
    return {"page": page, "result": tune(str(EXAMPLE), jobs=1)}


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no Chromium executable (Debian: apt-get install chromium)")
    pytest.importorskip("websocket", reason="websocket-client drives Chromium: pip install '.[test]'")
    with Chromium(CHROMIUM) as b:
        yield b


@pytest.fixture
def tab(browser):
    # A fresh tab per test: a page that hung or failed cannot spoil the next test.
    page = browser.new_page()
    yield page
    browser.close_page(page)


def url(path):
    return Path(path).resolve().as_uri()


# -- the command line -------------------------------------------------------------------------------

def test_view_missing_file_is_one_line_error_without_traceback(tmp_path):
    # From a folder outside the checkout, as a user runs it (the source tree would shadow the
    # installed package there).
    proc = subprocess.run([sys.executable, "-m", "pyalloc", "view", str(tmp_path / "missing.pickle")],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("pyalloc: error: cannot read snapshot")


def test_view_reads_a_gzip_snapshot(capsys):
    rc, out, err = run(capsys, "view", EXAMPLE)
    assert rc == 0, err
    assert f"{EXAMPLE_FIGURES['peak_reserved']:,} bytes" in out


def test_view_reads_a_plain_pickle(capsys, tmp_path):
    plain = tmp_path / "small_train.pickle"
    plain.write_bytes(gzip.decompress(EXAMPLE.read_bytes()))
    rc, out, err = run(capsys, "view", plain)
    assert rc == 0, err
    assert f"{EXAMPLE_FIGURES['peak_reserved']:,} bytes" in out


def test_view_writes_one_html_file(capsys, tmp_path):
    page = tmp_path / "report.html"
    rc, out, err = run(capsys, "view", EXAMPLE, "-o", page)
    assert rc == 0, err
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_view_into_a_missing_folder_is_one_line_error(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "view", EXAMPLE, "-o", tmp_path / "nowhere" / "report.html"))


def test_view_of_a_snapshot_without_trace_is_one_line_error(capsys, tmp_path):
    path = tmp_path / "state.pickle"
    pyalloc.snapshot.dump({"segments": [], "device_traces": []}, path)
    assert_one_line_error(*run(capsys, "view", path))


def test_view_of_a_non_snapshot_is_one_line_error(capsys, tmp_path):
    path = tmp_path / "notes.pickle"
    path.write_text("not a pickle")
    assert_one_line_error(*run(capsys, "view", path))


def test_view_of_a_malformed_trace_entry_is_one_line_error(capsys, tmp_path):
    path = tmp_path / "bad.pickle"
    pyalloc.snapshot.dump({"segments": [], "device_traces": [[{"action": "alloc", "size": 512}]]}, path)
    assert_one_line_error(*run(capsys, "view", path))


def test_tune_html_into_a_missing_folder_is_one_line_error(capsys, tmp_path):
    assert_one_line_error(*run(capsys, "tune", EXAMPLE, "--jobs", "1", "--html", tmp_path / "no" / "t.html"))


def test_tune_html_with_json_keeps_stdout_one_json_object(capsys, tmp_path):
    rc, out, err = run(capsys, "tune", EXAMPLE, "--jobs", "1", "--config", "max_split_size_mb:64",
                       "--json", "--html", tmp_path / "t.html")
    assert rc == 0, err
    assert json.loads(out)["best"] is not None


def test_tune_html_writes_the_page(tune_page):
    assert tune_page["page"].read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


# -- the reconstruction and the summary -------------------------------------------------------------

def test_summary_gives_pytorchs_peaks(capsys):
    rc, out, err = run(capsys, "view", EXAMPLE)
    for name in ("reserved", "allocated", "requested"):
        line = next(line for line in out.splitlines() if line.startswith(f"peak {name}:"))
        assert f"({EXAMPLE_FIGURES['peak_' + name]:,} bytes)" in line


def test_summary_counts_ooms_and_names_tags(tagged):
    out = format_summary(analyze(load(tagged["path"])))
    assert "out of memory: 1 " in out
    assert "kv-cache 40.00 MiB" in out


def test_reconstructed_peaks_equal_the_replay(example_replay):
    view = analyze(load(EXAMPLE))
    assert {k: v[0] for k, v in view.peaks.items()} == {
        "reserved": example_replay.peak_reserved, "allocated": example_replay.peak_allocated,
        "requested": example_replay.peak_requested}


def test_reconstructed_tags_at_the_peak_equal_the_allocators(tagged):
    view = analyze(load(tagged["path"]))
    assert {t: b for t, b, _, _ in view.tags if b} == tagged["at_peak"]


def test_wrapped_trace_starts_from_what_the_segments_imply(wrapped):
    snapshot = load(wrapped["path"])
    view = analyze(snapshot)
    assert view.wrapped and view.initial["reserved"] > 0
    assert view.final_reserved_trace == view.final_reserved_snapshot


def test_cut_trace_reconstructs_the_full_traces_window():
    snapshot = load(EXAMPLE)
    entries = snapshot["device_traces"][0]
    full = analyze(snapshot, buckets=len(entries), block_sizes=False)
    cut = 5000
    window = analyze(dict(snapshot, device_traces=[entries[cut:]]), buckets=len(entries) - cut,
                     block_sizes=False)
    assert window.hi["reserved"] == full.hi["reserved"][cut:]
    assert window.hi["requested"] == full.hi["requested"][cut:]


def test_downsampled_timeline_keeps_a_two_event_spike(million):
    view = million["view"]
    assert view.bucket > 100
    assert max(view.hi["allocated"]) == million["replay"].peak_allocated


def test_million_event_page_is_under_three_megabytes(million):
    assert million["page"].stat().st_size < 3_000_000


def test_reserved_curve_peak_equals_the_replays(example_replay):
    snapshot = load(EXAMPLE)
    xs, ys = reserved_curve(snapshot, "", placement="recorded")
    assert max(ys) == example_replay.peak_reserved
    assert 500 <= len(xs) <= 1500


def test_tune_curves_replay_rows_under_the_runs_memory_fraction():
    # The GC of garbage_collection_threshold acts only under a memory fraction: a curve replayed
    # without the fraction that tune used peaks higher than tune's own figure for the row.
    from pyalloc.view import tune_curves
    stem = REPO / "tests" / "data" / "oom" / "gc-fraction"
    figures = json.loads(stem.with_suffix(".json").read_text())
    snapshot = load(stem.with_suffix(".pickle.gz"))
    result = tune(snapshot, grid=None, configs=["garbage_collection_threshold:0.5"], jobs=1,
                  device_memory=figures["total_memory"], memory_fraction=figures["fraction"])
    curves = tune_curves(result, snapshot, points=200)
    assert result.rows
    for row in result.rows:
        assert max(curves[id(row)][1]) == row.result.peak_reserved


def test_page_references_nothing_outside_itself(example_page):
    text = example_page.read_text(encoding="utf-8")
    assert not re.search(r"""\b(src|href|action)\s*=""", text)
    assert set(re.findall(r"https?://[^\s\"'<>)]+", text)) <= {"http://www.w3.org/2000/svg"}


def test_page_escapes_tag_markup(tagged):
    text = tagged["page"].read_text(encoding="utf-8")
    assert MARKUP_TAG not in text
    assert "scratch &lt;b&gt;&amp;" in text


# -- the harness itself can see what the page tests look for ----------------------------------------

# How long the tests that look for the absence of errors and requests go on watching a page after
# it rendered (seconds), so that a late message or request is seen.
WATCH = 0.2

@needs_browser
def test_harness_sees_console_errors(tab):
    tab.load("data:text/html,<p>x</p><script>console.error('boom')</script>", wait_rendered=False,
             settle=WATCH)
    assert ("error", "boom") in tab.console


@needs_browser
def test_harness_sees_network_requests(tab):
    tab.load("data:text/html,<img src='http://example.com/x.png'>", wait_rendered=False,
             settle=WATCH)
    assert "http://example.com/x.png" in tab.requests


# -- pages in the browser ---------------------------------------------------------------------------

PAGES = ("example", "tagged", "wrapped", "unreplayable", "tune")


@pytest.fixture
def any_page(request, example_page, tagged, wrapped, unreplayable_page, tune_page):
    return {"example": example_page, "tagged": tagged["page"], "wrapped": wrapped["page"],
            "unreplayable": unreplayable_page, "tune": tune_page["page"]}[request.param]


@needs_browser
@pytest.mark.parametrize("any_page", PAGES, indirect=True)
def test_page_loads_without_console_errors(tab, any_page):
    tab.load(url(any_page), settle=WATCH)
    assert tab.evaluate("document.body.getAttribute('data-rendered')") == "1"
    assert tab.exceptions == []
    assert [c for c in tab.console if c[0] in ("error", "warning", "assert")] == []
    assert [entry for entry in tab.log if entry[0] in ("error", "warning")] == []


@needs_browser
@pytest.mark.parametrize("any_page", PAGES, indirect=True)
def test_page_makes_no_network_request(tab, any_page):
    tab.load(url(any_page), settle=WATCH)
    assert tab.requests == [url(any_page)]


@needs_browser
def test_timeline_draws_pytorchs_peaks(tab, example_page):
    tab.load(url(example_page))
    drawn = tab.evaluate("Object.assign({}, document.getElementById('timeline-svg').dataset)")
    assert {k: int(v) for k, v in drawn.items() if k.startswith("drawnPeak")} == {
        "drawnPeakReserved": EXAMPLE_FIGURES["peak_reserved"],
        "drawnPeakAllocated": EXAMPLE_FIGURES["peak_allocated"],
        "drawnPeakRequested": EXAMPLE_FIGURES["peak_requested"]}


@needs_browser
def test_timeline_draws_the_replays_peaks(tab, example_page, example_replay):
    tab.load(url(example_page))
    drawn = tab.evaluate("Object.assign({}, document.getElementById('timeline-svg').dataset)")
    assert (int(drawn["drawnPeakReserved"]), int(drawn["drawnPeakAllocated"])) == (
        example_replay.peak_reserved, example_replay.peak_allocated)


@needs_browser
def test_unreplayable_setting_still_draws_requested_and_reserved(tab, unreplayable_page):
    tab.load(url(unreplayable_page))
    drawn = tab.evaluate("Object.assign({}, document.getElementById('timeline-svg').dataset)")
    assert {k: int(v) for k, v in drawn.items() if k.startswith("drawnPeak")} == {
        "drawnPeakReserved": EXAMPLE_FIGURES["peak_reserved"],
        "drawnPeakRequested": EXAMPLE_FIGURES["peak_requested"]}


@needs_browser
def test_unreplayable_setting_says_why_allocated_is_missing(tab, unreplayable_page):
    tab.load(url(unreplayable_page))
    notes = tab.evaluate("document.getElementById('notes').innerText")
    assert "Allocated bytes are not shown" in notes and "cudaMallocAsync" in notes


@needs_browser
def test_peak_marker_label_shows_the_peak(tab, example_page):
    tab.load(url(example_page))
    assert tab.evaluate("document.querySelector('#peak-reserved text').textContent") == "peak reserved 1.06 GiB"


@needs_browser
def test_oom_is_marked_on_the_timeline_at_its_event(tab, tagged):
    tab.load(url(tagged["page"]))
    marks = tab.evaluate("[...document.querySelectorAll('#timeline-svg .oom-mark')].map(m => +m.dataset.event)")
    assert marks == [tagged["oom_event"]]


@needs_browser
def test_oom_card_counts_the_oom(tab, tagged):
    tab.load(url(tagged["page"]))
    assert tab.evaluate("document.querySelector('#card-oom .value').textContent") == "1"


@needs_browser
def test_segment_map_at_the_oom_holds_what_was_reserved(tab, tagged):
    tab.load(url(tagged["page"]))
    drawn = tab.evaluate("Object.assign({}, document.querySelector('svg.segmap[data-moment=oom]').dataset)")
    assert int(drawn["event"]) == tagged["oom_event"]
    assert int(drawn["drawnReserved"]) == tagged["reserved_at_oom"]


@needs_browser
def test_segment_map_at_the_peak_holds_the_peak_allocated(tab, example_page):
    tab.load(url(example_page))
    drawn = tab.evaluate("document.querySelector('svg.segmap[data-moment=peak]').dataset.drawnAllocated")
    assert int(drawn) == EXAMPLE_FIGURES["peak_allocated"]


@needs_browser
def test_tag_table_shows_bytes_per_tag_at_the_peak(tab, tagged):
    tab.load(url(tagged["page"]))
    rows = tab.evaluate("[...document.querySelectorAll('#tag-table tbody tr')].map("
                        "r => [r.dataset.tag, +r.cells[1].dataset.bytes])")
    assert {t: b for t, b in rows if b} == tagged["at_peak"]


@needs_browser
def test_colour_by_tag_paints_blocks_in_their_tags_colours(tab, tagged):
    tab.load(url(tagged["page"]))
    fills = tab.evaluate("""(() => {
        document.querySelector('input[name="colour-by"][value="tag"]').click();
        const legend = {};
        for (const s of document.querySelectorAll('#tag-legend > span'))
            legend[s.textContent] = getComputedStyle(s.querySelector('.sw')).backgroundColor;
        const probe = document.createElement('span'); document.body.appendChild(probe);
        const rgb = c => { probe.style.color = c; return getComputedStyle(probe).color; };
        const out = {};
        for (const r of document.querySelectorAll('svg.segmap[data-moment=peak] rect.blk'))
            out[rgb(r.getAttribute('fill'))] = true;
        return {legend, fills: Object.keys(out).sort()};
    })()""")
    expected = sorted(fills["legend"][t] for t in tagged["at_peak"])
    assert fills["fills"] == expected


@needs_browser
def test_colour_by_state_paints_live_blocks_allocated(tab, tagged):
    tab.load(url(tagged["page"]))
    fills = tab.evaluate("[...new Set([...document.querySelectorAll("
                         "'svg.segmap[data-moment=peak] rect.blk')].map(r => r.getAttribute('fill')))]")
    assert fills == [STATE_COLOURS["allocated"]]


@needs_browser
def test_hovering_the_timeline_shows_the_buckets_figures(tab, tagged):
    tab.load(url(tagged["page"]))
    tab.hover("#timeline-svg", fx=0.975, fy=0.5)    # over the last event, inside the plot
    tip = tab.evaluate("document.getElementById('tip').textContent")
    assert tip.splitlines()[0] == "event 39"
    assert tab.exceptions == []


@needs_browser
def test_hovering_a_block_shows_its_tag(tab, tagged):
    tab.load(url(tagged["page"]))
    tab.hover("svg.segmap[data-moment=peak] rect.blk[data-b='0']", fx=0.5, fy=0.5)
    tip = tab.evaluate("document.getElementById('tip').textContent")
    assert "tag: weights" in tip.splitlines()
    assert tab.exceptions == []


@needs_browser
def test_largest_allocation_shows_its_stack(tab, tagged):
    tab.load(url(tagged["page"]))
    first = tab.evaluate("document.querySelector('#top-table tbody tr td.frames pre').textContent")
    assert first.splitlines()[0].startswith("allocate_kv_cache ")


@needs_browser
def test_wrapped_page_says_where_it_starts(tab, wrapped):
    tab.load(url(wrapped["page"]))
    note = tab.evaluate("document.getElementById('wrapped-note').innerText")
    assert "ring buffer wrapped" in note and "final segments" in note


@needs_browser
def test_million_event_page_draws_the_spike(tab, million):
    tab.load(url(million["page"]))
    drawn = tab.evaluate("document.getElementById('timeline-svg').dataset.drawnPeakAllocated")
    assert int(drawn) == million["replay"].peak_allocated


@needs_browser
def test_million_event_page_renders_within_two_seconds(tab, million):
    tab.load(url(million["page"]))
    assert float(tab.evaluate("document.body.dataset.renderMs")) < 2000


@needs_browser
def test_tune_page_curves_peak_at_the_tables_figures(tab, tune_page):
    tab.load(url(tune_page["page"]))
    drawn = tab.evaluate("Object.fromEntries([...document.querySelectorAll('#tune-svg path.curve')].map("
                         "p => [p.dataset.row, +p.dataset.drawnPeak]))")
    result = tune_page["result"]
    expected = {f"row-{i}": row.result.peak_reserved for i, row in enumerate(result.rows)}
    expected["row-baseline"] = result.baseline.result.peak_reserved
    assert drawn == expected


@needs_browser
def test_tune_page_table_rows_follow_the_ranking(tab, tune_page):
    tab.load(url(tune_page["page"]))
    configs = tab.evaluate("[...document.querySelectorAll('#tune-table tbody tr')].map(r => r.dataset.config)")
    result = tune_page["result"]
    assert configs == [r.config for r in result.rows] + [result.baseline.config]


@needs_browser
def test_tune_page_shows_the_recommended_line_above_the_chart(tab, tune_page):
    tab.load(url(tune_page["page"]))
    found = tab.evaluate("""(() => ({line: document.getElementById('best-line').textContent,
        above: document.getElementById('best').getBoundingClientRect().bottom
               <= document.getElementById('tune-chart').getBoundingClientRect().top}))()""")
    assert found == {"line": tune_page["result"].best_line(), "above": True}


@needs_browser
def test_tune_page_puts_the_table_beside_the_chart(tab, tune_page):
    tab.send("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1, mobile=False)
    tab.load(url(tune_page["page"]))
    boxes = tab.evaluate("""(() => { const c = document.getElementById('tune-chart').getBoundingClientRect(),
        t = document.getElementById('tune-table').getBoundingClientRect();
        return {beside: t.left >= c.right, overlap: t.top < c.bottom && c.top < t.bottom}; })()""")
    assert boxes == {"beside": True, "overlap": True}


@needs_browser
def test_tune_page_hovering_a_row_picks_out_its_curve(tab, tune_page):
    tab.load(url(tune_page["page"]))
    tab.hover("#row-1")
    picked = tab.evaluate("[...document.querySelectorAll('#tune-svg path.curve.hl')].map(p => p.dataset.row)")
    assert picked == ["row-1"]


def test_view_o_counts_one_oom_in_the_singular(capsys, tagged, tmp_path):
    rc, out, err = run(capsys, "view", tagged["path"], "-o", tmp_path / "p.html")
    assert rc == 0, err
    assert out.rstrip().endswith("; 1 out-of-memory event")


def tune_table_cells(page_text):
    """{data-config: the text of its 'vs the trace's own setting' cell} of a tune page's table."""
    rows = re.findall(r'<tr id="row-\d+" data-config="([^"]*)".*?</tr>', page_text, re.S)
    cells = re.findall(r'<tr id="row-\d+" data-config="[^"]*".*?(?:<td[^>]*>.*?</td>){4}<td class="num">(.*?)</td>',
                       page_text, re.S)
    return dict(zip(rows, cells))


def test_tune_page_says_more_or_less_as_the_terminal_does(tune_page):
    from pyalloc.tune import change_words
    cells = tune_table_cells(tune_page["page"].read_text())
    result = tune_page["result"]
    costs = [r for r in result.rows if not r.own and r.saving is not None and r.saving < 0]
    assert costs, "the example's grid has a setting that reserves more than the own one"
    for row in costs:
        assert cells[row.config] == change_words(row.saving, row.saving_fraction)
        assert " more (" in cells[row.config]


@needs_browser
def test_oom_label_stays_inside_the_page_at_1400_px(tab, tmp_path):
    # An OOM at the trace's last event puts its marker at the right edge of the timeline.
    allocator = CachingAllocator(0, backend=SimDevice(64 * MiB), config="")
    allocator.record_memory_history(context=None)
    allocator.malloc(32 * MiB)
    with pytest.raises(MemoryError):
        allocator.malloc(48 * MiB)
    path = tmp_path / "oom-last.pickle"
    allocator.dump_snapshot(str(path))
    page = tmp_path / "oom-last.html"
    assert cli.main(["view", str(path), "-o", str(page)]) == 0
    tab.send("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1, mobile=False)
    tab.load(url(page))
    box = tab.evaluate("""(() => { const t = document.querySelector('#timeline-svg .oom-mark text').getBoundingClientRect(),
        s = document.getElementById('timeline-svg').getBoundingClientRect();
        return {inside: t.left >= s.left && t.right <= s.right, width: t.width}; })()""")
    assert box["inside"] and box["width"] > 0
