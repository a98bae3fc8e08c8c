"""Self-contained HTML pages: `pyalloc view`'s memory report and `pyalloc tune --html`'s chart.

Every page is one file that opens from disk with no network: the figures' numbers travel as JSON
in a ``<script type="application/json">`` element and a small inline script (no library) draws
them as SVG; tables and text are plain HTML, readable without the script. Why that split:

* size: a timeline of 2,000 buckets and a segment map of thousands of blocks are a few numbers
  each as JSON, several times more as SVG markup (coordinates, attributes, one element each);
* the hover details (a bucket's range, a block's size, tag and allocation event) and the
  state / tag colouring switch need a script anyway;
* the peaks the page shows are computed in the browser from the very arrays it draws, and written
  into the DOM (``data-drawn-peak-*``), so a test in a real browser checks what is drawn;
* size again: stacks are a table of distinct strings in the JSON, written into their cells by the
  script (_StackTable), so that a stack shared by many rows, or a frame name of megabytes, is
  stored once; without the script a cell gives the stack's frame count.

User strings (tags, frames, settings) reach the page only through html.escape or the script's
textContent, never as markup. Only the standard library is used.

The style and the scripts are package data files beside this module, copied into every page:
report.css, report_common.js (JSON reading, SVG helpers, axes) and one script per page,
report_view.js and report_tune.js.
"""
from __future__ import annotations

import functools
import html
import json
import os
import re
from importlib import resources

from pyalloc.errors import format_bytes

# Tag colours (Tableau 10); untagged memory is slate, tags beyond the tenth share OTHER_TAG.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")
NO_TAG = "#94a3b8"
OTHER_TAG = "#475569"
SERIES_COLOURS = {"reserved": "#2563eb", "allocated": "#ea580c", "requested": "#16a34a"}
STATE_COLOURS = {"allocated": "#1d4ed8", "pending_free": "#f59e0b", "free": "#e2e8f0"}


# A lone surrogate (from a str that was never valid Unicode: a pickled '\ud800') has no UTF-8
# form; the page shows it as the escape Python would write.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _visible_surrogate(match):
    return f"\\u{ord(match.group()):04x}"


def _esc(text):
    return html.escape(_SURROGATE.sub(_visible_surrogate, str(text)), quote=True)


def _json(data):
    # Inside <script> only "</" could end the element early; \u003c keeps every "<" out of it.
    return json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")


def _bytes_cell(n):
    return f'<td class="num" data-bytes="{int(n)}" title="{int(n):,} bytes">{_esc(format_bytes(n))}</td>'


def _tag_label(tag):
    return tag if tag else "(no tag)"


# A tag is written into the markup several times (legend, tables, rows): longer ones are cut
# there, with the count of what was cut; the page's JSON holds each in full once.
MARKUP_TAG_CHARS = 200


def _short_tag(tag):
    """_tag_label(tag), cut to MARKUP_TAG_CHARS characters with a note of how many more it has."""
    label = _tag_label(tag)
    if len(label) <= MARKUP_TAG_CHARS:
        return label
    return f"{label[:MARKUP_TAG_CHARS]}... ({len(label) - MARKUP_TAG_CHARS:,} more characters)"


class _StackTable:
    """The stacks a page shows, for its JSON: each distinct string (frame name, file name) once in
    `strings`, each distinct stack once in `stacks` as [[name, filename, line], ...] (string
    indices; at most `limit` frames, then the count of the rest). The rows that show a stack
    carry only its index, and the page's script writes the stack out: a stack shared by many rows,
    or a name repeated in many stacks, is stored once however long it is."""

    def __init__(self, limit):
        self.limit = limit
        self.strings, self.stacks = [], []
        self._string_index, self._stack_index = {}, {}

    def _string(self, text):
        index = self._string_index.get(text)
        if index is None:
            index = self._string_index[text] = len(self.strings)
            self.strings.append(text)
        return index

    def index(self, frames):
        """The index of `frames` (PyTorch frame dicts, innermost first) in `stacks`."""
        key = id(frames)      # entries of one stack share its list
        index = self._stack_index.get(key)
        if index is None:
            shown = [[self._string(str(f.get("name", "?"))), self._string(str(f.get("filename", "?"))),
                      f.get("line", "?")] for f in frames[:self.limit]]
            index = self._stack_index[key] = len(self.stacks)
            self.stacks.append({"frames": shown, "more": max(0, len(frames) - self.limit)})
        return index

    def cell(self, frames):
        """The table cell of a stack: its index for the script, and words for a reader without it."""
        if not frames:
            return '<td class="frames"><span class="muted">no stack recorded</span></td>'
        return (f'<td class="frames" data-stack="{self.index(frames)}"><span class="muted">'
                f'{len(frames):,} frames (shown with JavaScript)</span></td>')


@functools.cache
def asset(name):
    """The text of the package data file pyalloc/`name` (report.css, report_*.js), read once per
    process through importlib.resources, so that it is found wherever pyalloc is installed."""
    return resources.files("pyalloc").joinpath(name).read_text(encoding="utf-8")


def _page(title, body, data, script):
    """A whole page: `body` (markup), `data` (the JSON its script reads) and `script`, the name
    of its own script file, run after report_common.js."""
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_esc(title)}</title><style>\n{asset('report.css')}</style></head>\n<body>\n{body}\n"
            f"<div id=\"tip\" role=\"tooltip\"></div>\n"
            f"<noscript><p class=\"note\">The charts and the stacks need JavaScript; the tables below do not.</p></noscript>\n"
            f"<script type=\"application/json\" id=\"data\">{_json(data)}</script>\n"
            f"<script>\n{asset('report_common.js')}\n{asset(script)}</script>\n</body></html>\n")


def write(path, text):
    """Write a page as UTF-8, atomically (a failure leaves an old file at `path` whole); returns
    the bytes written. OSError when the file cannot be written."""
    from pyalloc.snapshot import write_atomically
    return write_atomically(path, text.encode("utf-8"))


# ------------------------------------------------------------------------------- pyalloc view

def _tag_colours(tags):
    out, k = [], 0
    for tag in tags:
        if not tag:
            out.append(NO_TAG)
        elif k < len(PALETTE):
            out.append(PALETTE[k])
            k += 1
        else:
            out.append(OTHER_TAG)
    return out


def _moment_data(moment, tag_index):
    """A moment's segments and blocks as arrays: blocks are [segment, offset, size, requested,
    state (0 allocated, 1 pending free), tag, alloc event]."""
    segs = [[addr, size, 1 if expandable else 0] for addr, size, expandable in moment.segments]
    blocks = []
    j = 0
    outside = 0
    for a, state in moment.blocks:          # both sorted by address
        while j < len(segs) and segs[j][0] + segs[j][1] <= a.addr:
            j += 1
        if j == len(segs) or a.addr < segs[j][0]:
            outside += 1                     # a block in no reserved range: inconsistent trace
            continue
        size = min(a.size, segs[j][0] + segs[j][1] - a.addr)
        blocks.append([j, a.addr - segs[j][0], size, a.requested, 0 if state == "allocated" else 1,
                       tag_index[a.tag], a.start])
    return {"name": moment.name, "title": moment.title, "event": moment.event, "segs": segs,
            "blocks": blocks, "outside": outside}


def _view_when(view, event):
    """'event 1,234, 2.46 ms': an event index and, when the trace has times, its time."""
    from pyalloc.view import format_ms, view_time_ms

    t = view_time_ms(view, event)
    return f"event {event:,}" + (f", {format_ms(t)}" if t is not None else "")


def _view_tags(view):
    """The page's tags: the view's tag rows, then any tag only a moment's blocks have."""
    tags = [t for t, *_ in view.tags]
    for m in view.moments:                  # blocks whose tag has no row (never counted) still get a colour
        for a, _ in m.blocks:
            if a.tag not in tags:
                tags.append(a.tag)
    return tags


def _figure_cards(view):
    """The cards of the page's head: each series' peak (bytes) and the out-of-memory count."""
    from pyalloc.view import SERIES

    cards = []
    for s in SERIES:
        if s in view.peaks:
            value, event = view.peaks[s]
            cards.append(f'<div class="card" id="card-{s}"><div class="label"><span class="sw" '
                         f'style="background:{SERIES_COLOURS[s]}"></span>peak {s}</div>'
                         f'<div class="value" data-bytes="{value}" title="{value:,} bytes">'
                         f'{_esc(format_bytes(value))}</div><div class="muted">{_esc(_view_when(view, event))}</div></div>')
        else:
            cards.append(f'<div class="card" id="card-{s}"><div class="label">peak {s}</div>'
                         f'<div class="value">-</div><div class="muted">not available</div></div>')
    oom_text = (f"{len(view.ooms):,}" if view.ooms else "none")
    cards.append(f'<div class="card{" bad" if view.ooms else ""}" id="card-oom"><div class="label">'
                 f'out of memory</div><div class="value" data-ooms="{len(view.ooms)}">{oom_text}</div>'
                 f'<div class="muted">{_esc(_view_when(view, view.ooms[0].event)) if view.ooms else "no oom entries"}</div></div>')
    return "".join(cards)


def _notes_html(view):
    """The view's notes as paragraphs, and what allocated bytes are (or why they are missing)."""
    notes = list(view.notes)
    if view.allocated_note:
        notes.append("Allocated bytes are not shown: " + view.allocated_note + ".")
    else:
        notes.append("Allocated bytes are block sizes, which PyTorch's trace does not record: they come "
                     "from replaying the trace through pyalloc under its own setting; requested bytes "
                     "are the trace's own sizes, reserved bytes its segment events.")
    attrs = [' class="note warn" id="wrapped-note"' if view.wrapped and i == 0 else ' class="note"'
             for i in range(len(notes))]
    return "".join(f"<p{a}>{_esc(n)}</p>" for a, n in zip(attrs, notes))


def _timeline_legend(view):
    from pyalloc.view import SERIES

    legend = "".join(f'<span><span class="sw" style="background:{SERIES_COLOURS[s]}"></span>{s}</span>'
                     for s in SERIES if s in view.hi)
    legend += '<span><span class="sw oom"></span>out of memory</span>' if view.ooms else ""
    return legend


def _segment_maps(view):
    """A heading and an empty host (drawn by the page's script) per moment of the view."""
    maps = []
    for m in view.moments:
        maps.append(
            f'<div class="map" id="map-{m.name}"><h3>Segments at the {_esc(m.title)} '
            f'<span class="muted">({_esc(_view_when(view, m.event))}: {len(m.segments):,} segments, '
            f'{_esc(format_bytes(m.reserved))} reserved, {_esc(format_bytes(m.allocated))} in '
            f'{sum(1 for _, s in m.blocks if s == "allocated"):,} live blocks)</span></h3>'
            f'<div class="maphost" data-moment="{m.name}"></div></div>')
    return "".join(maps)


def _colour_legends(tags, colours):
    """(the legend of block states, the legend of tags) of the segment maps."""
    state_legend = "".join(f'<span><span class="sw" style="background:{c}"></span>{_esc(k.replace("_", " "))}'
                           f'</span>' for k, c in STATE_COLOURS.items())
    tag_legend = "".join(f'<span><span class="sw" style="background:{c}"></span>{_esc(_short_tag(t))}</span>'
                         for t, c in zip(tags, colours))
    return state_legend, tag_legend


def _top_table(view, colours, tag_index, top_stacks):
    """The table of the largest blocks live at the peak (`top_stacks`: their stack cells)."""
    rows = []
    for rank, a in enumerate(view.top, 1):
        rows.append(f'<tr><td class="num">{rank}</td>{_bytes_cell(a.size)}{_bytes_cell(a.requested)}'
                    f'<td><span class="sw" style="background:{colours[tag_index[a.tag]]}"></span>'
                    f'{_esc(_short_tag(a.tag))}</td>'
                    f'<td class="num">{_esc(_view_when(view, a.start) if a.start >= 0 else "before the trace")}</td>'
                    f'<td class="mono">0x{a.addr:x}</td><td>{a.stream}</td>'
                    f'{top_stacks[rank - 1]}</tr>')
    top_html = (f'<table id="top-table"><thead><tr><th>#</th><th>block</th><th>requested</th><th>tag</th>'
                f'<th>allocated at</th><th>address</th><th>stream</th><th>stack (innermost first)</th></tr>'
                f'</thead><tbody>{"".join(rows)}</tbody></table>' if rows
                else '<p class="muted">no allocation was live at the peak</p>')
    if not any(a.frames for a in view.top):
        top_html += ('<p class="muted">This trace has no stack frames: record with '
                     '<code>_record_memory_history(context="alloc")</code> or <code>"all"</code> to see them.</p>')
    return top_html


def _tags_table(view, colours, tag_index):
    """The table of bytes per tag: at the peak, its share of the peak, the tag's own peak."""
    peak_total = sum(b for _, b, _, _ in view.tags) or 1
    tag_rows = "".join(
        f'<tr data-tag="{_esc(_short_tag(t) if t else "")}"><td><span class="sw" style="background:{colours[tag_index[t]]}"></span>'
        f'{_esc(_short_tag(t))}</td>{_bytes_cell(b)}<td class="num">{100 * b / peak_total:.1f}%</td>'
        f'{_bytes_cell(p)}<td class="num">{c:,}</td></tr>' for t, b, p, c in view.tags)
    return (f'<table id="tag-table"><thead><tr><th>tag (user_metadata)</th><th>at the peak</th>'
            f'<th>share</th><th>the tag\'s own peak</th><th>allocations</th></tr></thead>'
            f'<tbody>{tag_rows}</tbody></table>')


def _oom_section(view, oom_stacks):
    """The section listing the first 200 oom entries ('' when there is none)."""
    if not view.ooms:
        return ""
    oom_rows = "".join(
        f'<tr><td class="num">{_esc(_view_when(view, o.event))}</td>{_bytes_cell(o.requested)}{_bytes_cell(o.device_free)}'
        f'<td>{o.stream}</td><td>{_esc(_short_tag(o.tag))}</td>{cell}</tr>'
        for o, cell in zip(view.ooms[:200], oom_stacks))
    more = (f'<p class="muted">{len(view.ooms) - 200:,} more not listed</p>' if len(view.ooms) > 200 else "")
    return (f'<section id="ooms"><h2>Out of memory</h2><table id="oom-table"><thead><tr><th>when</th>'
            f'<th>requested</th><th>free on the device</th><th>stream</th><th>tag</th><th>stack</th></tr>'
            f'</thead><tbody>{oom_rows}</tbody></table>{more}</section>')


def view_page(view, title=None):
    """The `pyalloc view` page of a pyalloc.view.MemoryView, as one HTML string."""
    from pyalloc.view import MAX_FRAMES, SERIES

    name = os.path.basename(view.path) or "snapshot"
    tags = _view_tags(view)
    tag_index = {t: i for i, t in enumerate(tags)}
    colours = _tag_colours(tags)
    stacks = _StackTable(MAX_FRAMES)
    top_stacks = [stacks.cell(a.frames) for a in view.top]
    oom_stacks = [stacks.cell(o.frames) for o in view.ooms[:200]]
    data = {
        "n": view.events, "bucket": view.bucket, "x": view.starts, "t": view.times_ms,
        "series": [{"name": s, "lo": view.lo[s], "hi": view.hi[s], "colour": SERIES_COLOURS[s]}
                   for s in SERIES if s in view.hi],
        "peaks": {s: list(v) for s, v in view.peaks.items()},
        "peakSeries": view.peak_series,
        "ooms": [[o.event, o.requested, o.device_free] for o in view.ooms],
        "tags": [_tag_label(t) for t in tags], "tagColours": colours,
        "stateColours": STATE_COLOURS,
        "moments": [_moment_data(m, tag_index) for m in view.moments],
        "strings": stacks.strings, "stacks": stacks.stacks,
    }
    state_legend, tag_legend = _colour_legends(tags, colours)
    peak_label = f"{view.peak_moment.title} ({_view_when(view, view.peak_moment.event)})"
    body = f"""<header><h1>Where the memory went: {_esc(name)}</h1>
<p class="muted">{view.events:,} trace events on device {view.device}; allocator setting
<code>{_esc(view.config or "(defaults)")}</code>; timeline buckets of {view.bucket:,} event{"s" if view.bucket > 1 else ""}
(each keeps its minimum and maximum)</p></header>
<section id="figures" class="cards">{_figure_cards(view)}</section>
<section id="notes">{_notes_html(view)}</section>
<section id="timeline-section"><h2>Memory over the trace</h2>
<div class="legend">{_timeline_legend(view)}</div><div id="timeline"></div></section>
<section id="segments"><h2>Segment maps</h2>
<p class="muted">Each strip is the reserved memory in address order, wrapped into rows; a dark tick starts a
segment. Hover for details.</p>
<div class="controls">colour by <label><input type="radio" name="colour-by" value="state" autocomplete="off" checked> state</label>
<label><input type="radio" name="colour-by" value="tag" autocomplete="off"> tag</label></div>
<div class="legend" id="state-legend">{state_legend}</div>
<div class="legend" id="tag-legend" hidden>{tag_legend}<span><span class="sw" style="background:{STATE_COLOURS["free"]}"></span>free</span></div>
{_segment_maps(view)}</section>
<section id="top"><h2>Largest live allocations at the {_esc(peak_label)}</h2>{_top_table(view, colours, tag_index, top_stacks)}</section>
<section id="tags"><h2>Bytes per tag</h2>{_tags_table(view, colours, tag_index)}</section>
{_oom_section(view, oom_stacks)}
<footer class="muted">pyalloc view of {_esc(view.path or name)}</footer>"""
    return _page(title or f"pyalloc view: {name}", body, data, "report_view.js")


# ------------------------------------------------------------------------------- pyalloc tune --html

BEST_COLOUR = "#16a34a"
OWN_COLOUR = "#111827"


def _curve_colour(i, count):
    # Hues from blue round to orange, skipping the greens kept for the recommended setting.
    return f"hsl({round(190 + 230 * i / max(1, count - 1)) % 360}, 70%, 47%)"


def tune_page(result, curves, title=None):
    """The `pyalloc tune --html` page: each setting's reserved bytes over its replay on one chart,
    the ranking beside it, the recommended PYTORCH_CUDA_ALLOC_CONF line on top.

    `result` is a pyalloc.tune.TuneResult; `curves` maps id(row) -> (event indices, maxima) from
    pyalloc.view.reserved_curve for the rows drawn (the ranked rows and the baseline)."""
    name = os.path.basename(result.trace) or "trace"
    drawn = [r for r in result.rows if id(r) in curves]
    rows_data = []
    for i, row in enumerate(drawn):
        xs, ys = curves[id(row)]
        rows_data.append({"id": f"row-{i}", "label": row.config or "(defaults)", "own": row.own,
                          "best": row is result.best, "peak": row.result.peak_reserved, "x": xs, "y": ys,
                          "colour": (BEST_COLOUR if row is result.best else OWN_COLOUR if row.own
                                     else _curve_colour(i, len(drawn))), "dash": False})
    base = result.baseline
    if base.result is not None and id(base) in curves:
        xs, ys = curves[id(base)]
        rows_data.append({"id": "row-baseline", "label": (base.config or "(defaults)") + " at the trace's addresses",
                          "own": True, "best": False, "peak": base.result.peak_reserved, "x": xs, "y": ys,
                          "colour": "#6b7280", "dash": True})
    data = {"n": result.events, "rows": rows_data}

    best = result.best
    if best is None:
        top = '<section id="best" class="recommend"><p>No setting could be replayed.</p></section>'
    else:
        if not result.best_avoids_oom:
            verdict = (f"Every setting ran out of memory on a {format_bytes(result.device_memory)} device; "
                       + ("this one needs the smallest device (--fit)." if result.fit
                          else "this one had the fewest out-of-memory events."))
        elif best.own:
            verdict = "The trace's own setting is already the best of this grid."
        else:
            saving = ""
            if best.saving is not None:
                frac = best.saving_fraction
                saving = f", {format_bytes(abs(best.saving))} {'less' if best.saving >= 0 else 'more'} than the trace's own setting" + (
                    f" ({abs(frac):.1%})" if frac is not None else "")
            verdict = f"Peak reserved {format_bytes(best.result.peak_reserved)}{saving}."
        top = (f'<section id="best" class="recommend"><div class="label">recommended</div>'
               f'<pre id="best-line">{_esc(result.best_line())}</pre><p>{_esc(verdict)}</p></section>')

    body_rows = []
    for i, row in enumerate(drawn):
        r = row.result
        ratio = f"{r.reserved_over_requested:.3f}" if r.peak_requested else "-"
        saving = _esc(row.saving_words())      # the terminal's words
        cls = " ".join(c for c in ("own" if row.own else "", "best" if row is result.best else "") if c)
        cls_attr = f' class="{cls}"' if cls else ""
        body_rows.append(
            f'<tr id="row-{i}" data-config="{_esc(row.config)}" data-peak="{r.peak_reserved}"'
            f'{cls_attr}><td><span class="sw" style="background:{rows_data[i]["colour"]}"></span></td>'
            f'<td>{_esc(row.config or "(defaults)").replace(",", ",<wbr>")}{" *" if row.own else ""}</td>{_bytes_cell(r.peak_reserved)}'
            f'<td class="num">{ratio}</td><td class="num">{saving}</td><td class="num">{r.num_device_alloc:,}</td>'
            f'<td class="num">{r.num_ooms:,}</td></tr>')
    if base.result is not None:
        b = base.result
        body_rows.append(
            f'<tr id="row-baseline" class="baseline" data-config="{_esc(base.config)}" data-peak="{b.peak_reserved}">'
            f'<td><span class="sw dash"></span></td><td>{_esc(base.config or "(defaults)")} at the trace\'s addresses</td>'
            f'{_bytes_cell(b.peak_reserved)}<td class="num">'
            f'{f"{b.reserved_over_requested:.3f}" if b.peak_requested else "-"}</td><td class="num">as recorded</td>'
            f'<td class="num">{b.num_device_alloc:,}</td><td class="num">{b.num_ooms:,}</td></tr>')
    extra = "".join(f'<p class="muted">skipped {_esc(r.config or "(defaults)")}: {_esc(r.error)}</p>'
                    for r in result.skipped)
    extra += "".join(f'<p class="note warn">failed {_esc(r.config or "(defaults)")}: {_esc(r.error)}</p>'
                     for r in result.failed)
    wrapped = ('<p class="note warn">The trace starts in the middle of the run (wrapped ring buffer or late '
               'start): the figures cover only the recorded window.</p>' if result.wrapped else "")
    body = f"""<header><h1>Allocator settings for {_esc(name)}</h1>
<p class="muted">{result.events:,} events, {result.allocations:,} allocations, device {result.device}; simulated
device of {_esc(format_bytes(result.device_memory))}. Every setting is replayed with fresh placement (segments where
the simulated device puts them); the dashed line is the trace's own setting at its recorded addresses.</p></header>
{top}{wrapped}
<section id="tune" class="split"><div><h2>Reserved memory over the trace</h2><div id="tune-chart"></div>
<p class="muted">Each point is the largest reserved figure since the previous one, so every peak is drawn.
Hover a row to pick out its curve.</p></div>
<div><h2>Ranking</h2><table id="tune-table"><thead><tr><th></th><th>setting</th><th>peak reserved</th><th>/requested</th>
<th>vs the trace's own setting</th><th>device allocs</th><th>OOMs</th></tr></thead><tbody>{"".join(body_rows)}</tbody></table>
<p class="muted">* the trace's own setting; savings are against its row.</p>{extra}</div></section>
<footer class="muted">pyalloc tune of {_esc(result.trace)}</footer>"""
    return _page(title or f"pyalloc tune: {name}", body, data, "report_tune.js")
