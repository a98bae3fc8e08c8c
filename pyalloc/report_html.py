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
"""
from __future__ import annotations

import html
import json
import os
import re

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


def _page(title, body, data, script):
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head>\n<body>\n{body}\n"
            f"<div id=\"tip\" role=\"tooltip\"></div>\n"
            f"<noscript><p class=\"note\">The charts and the stacks need JavaScript; the tables below do not.</p></noscript>\n"
            f"<script type=\"application/json\" id=\"data\">{_json(data)}</script>\n"
            f"<script>{_JS_COMMON}{script}</script>\n</body></html>\n")


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


def view_page(view, title=None):
    """The `pyalloc view` page of a pyalloc.view.MemoryView, as one HTML string."""
    from pyalloc.view import MAX_FRAMES, SERIES, format_ms, view_time_ms

    name = os.path.basename(view.path) or "snapshot"
    tags = [t for t, *_ in view.tags]
    for m in view.moments:                  # blocks whose tag has no row (never counted) still get a colour
        for a, _ in m.blocks:
            if a.tag not in tags:
                tags.append(a.tag)
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

    def when(event):
        t = view_time_ms(view, event)
        return f"event {event:,}" + (f", {format_ms(t)}" if t is not None else "")

    cards = []
    for s in SERIES:
        if s in view.peaks:
            value, event = view.peaks[s]
            cards.append(f'<div class="card" id="card-{s}"><div class="label"><span class="sw" '
                         f'style="background:{SERIES_COLOURS[s]}"></span>peak {s}</div>'
                         f'<div class="value" data-bytes="{value}" title="{value:,} bytes">'
                         f'{_esc(format_bytes(value))}</div><div class="muted">{_esc(when(event))}</div></div>')
        else:
            cards.append(f'<div class="card" id="card-{s}"><div class="label">peak {s}</div>'
                         f'<div class="value">-</div><div class="muted">not available</div></div>')
    oom_text = (f"{len(view.ooms):,}" if view.ooms else "none")
    cards.append(f'<div class="card{" bad" if view.ooms else ""}" id="card-oom"><div class="label">'
                 f'out of memory</div><div class="value" data-ooms="{len(view.ooms)}">{oom_text}</div>'
                 f'<div class="muted">{_esc(when(view.ooms[0].event)) if view.ooms else "no oom entries"}</div></div>')

    notes = list(view.notes)
    if view.allocated_note:
        notes.append("Allocated bytes are not shown: " + view.allocated_note + ".")
    else:
        notes.append("Allocated bytes are block sizes, which PyTorch's trace does not record: they come "
                     "from replaying the trace through pyalloc under its own setting; requested bytes "
                     "are the trace's own sizes, reserved bytes its segment events.")
    attrs = [' class="note warn" id="wrapped-note"' if view.wrapped and i == 0 else ' class="note"'
             for i in range(len(notes))]
    notes_html = "".join(f"<p{a}>{_esc(n)}</p>" for a, n in zip(attrs, notes))

    legend = "".join(f'<span><span class="sw" style="background:{SERIES_COLOURS[s]}"></span>{s}</span>'
                     for s in SERIES if s in view.hi)
    legend += '<span><span class="sw oom"></span>out of memory</span>' if view.ooms else ""

    maps = []
    for m in view.moments:
        maps.append(
            f'<div class="map" id="map-{m.name}"><h3>Segments at the {_esc(m.title)} '
            f'<span class="muted">({_esc(when(m.event))}: {len(m.segments):,} segments, '
            f'{_esc(format_bytes(m.reserved))} reserved, {_esc(format_bytes(m.allocated))} in '
            f'{sum(1 for _, s in m.blocks if s == "allocated"):,} live blocks)</span></h3>'
            f'<div class="maphost" data-moment="{m.name}"></div></div>')
    state_legend = "".join(f'<span><span class="sw" style="background:{c}"></span>{_esc(k.replace("_", " "))}'
                           f'</span>' for k, c in STATE_COLOURS.items())
    tag_legend = "".join(f'<span><span class="sw" style="background:{c}"></span>{_esc(_short_tag(t))}</span>'
                         for t, c in zip(tags, colours))

    peak_label = f"{view.peak_moment.title} ({when(view.peak_moment.event)})"
    rows = []
    for rank, a in enumerate(view.top, 1):
        rows.append(f'<tr><td class="num">{rank}</td>{_bytes_cell(a.size)}{_bytes_cell(a.requested)}'
                    f'<td><span class="sw" style="background:{colours[tag_index[a.tag]]}"></span>'
                    f'{_esc(_short_tag(a.tag))}</td>'
                    f'<td class="num">{_esc(when(a.start) if a.start >= 0 else "before the trace")}</td>'
                    f'<td class="mono">0x{a.addr:x}</td><td>{a.stream}</td>'
                    f'{top_stacks[rank - 1]}</tr>')
    top_html = (f'<table id="top-table"><thead><tr><th>#</th><th>block</th><th>requested</th><th>tag</th>'
                f'<th>allocated at</th><th>address</th><th>stream</th><th>stack (innermost first)</th></tr>'
                f'</thead><tbody>{"".join(rows)}</tbody></table>' if rows
                else '<p class="muted">no allocation was live at the peak</p>')
    if not any(a.frames for a in view.top):
        top_html += ('<p class="muted">This trace has no stack frames: record with '
                     '<code>_record_memory_history(context="alloc")</code> or <code>"all"</code> to see them.</p>')

    peak_total = sum(b for _, b, _, _ in view.tags) or 1
    tag_rows = "".join(
        f'<tr data-tag="{_esc(_short_tag(t) if t else "")}"><td><span class="sw" style="background:{colours[tag_index[t]]}"></span>'
        f'{_esc(_short_tag(t))}</td>{_bytes_cell(b)}<td class="num">{100 * b / peak_total:.1f}%</td>'
        f'{_bytes_cell(p)}<td class="num">{c:,}</td></tr>' for t, b, p, c in view.tags)
    tags_html = (f'<table id="tag-table"><thead><tr><th>tag (user_metadata)</th><th>at the peak</th>'
                 f'<th>share</th><th>the tag\'s own peak</th><th>allocations</th></tr></thead>'
                 f'<tbody>{tag_rows}</tbody></table>')

    oom_html = ""
    if view.ooms:
        oom_rows = "".join(
            f'<tr><td class="num">{_esc(when(o.event))}</td>{_bytes_cell(o.requested)}{_bytes_cell(o.device_free)}'
            f'<td>{o.stream}</td><td>{_esc(_short_tag(o.tag))}</td>{cell}</tr>'
            for o, cell in zip(view.ooms[:200], oom_stacks))
        more = (f'<p class="muted">{len(view.ooms) - 200:,} more not listed</p>' if len(view.ooms) > 200 else "")
        oom_html = (f'<section id="ooms"><h2>Out of memory</h2><table id="oom-table"><thead><tr><th>when</th>'
                    f'<th>requested</th><th>free on the device</th><th>stream</th><th>tag</th><th>stack</th></tr>'
                    f'</thead><tbody>{oom_rows}</tbody></table>{more}</section>')

    body = f"""<header><h1>Where the memory went: {_esc(name)}</h1>
<p class="muted">{view.events:,} trace events on device {view.device}; allocator setting
<code>{_esc(view.config or "(defaults)")}</code>; timeline buckets of {view.bucket:,} event{"s" if view.bucket > 1 else ""}
(each keeps its minimum and maximum)</p></header>
<section id="figures" class="cards">{"".join(cards)}</section>
<section id="notes">{notes_html}</section>
<section id="timeline-section"><h2>Memory over the trace</h2>
<div class="legend">{legend}</div><div id="timeline"></div></section>
<section id="segments"><h2>Segment maps</h2>
<p class="muted">Each strip is the reserved memory in address order, wrapped into rows; a dark tick starts a
segment. Hover for details.</p>
<div class="controls">colour by <label><input type="radio" name="colour-by" value="state" autocomplete="off" checked> state</label>
<label><input type="radio" name="colour-by" value="tag" autocomplete="off"> tag</label></div>
<div class="legend" id="state-legend">{state_legend}</div>
<div class="legend" id="tag-legend" hidden>{tag_legend}<span><span class="sw" style="background:{STATE_COLOURS["free"]}"></span>free</span></div>
{"".join(maps)}</section>
<section id="top"><h2>Largest live allocations at the {_esc(peak_label)}</h2>{top_html}</section>
<section id="tags"><h2>Bytes per tag</h2>{tags_html}</section>
{oom_html}
<footer class="muted">pyalloc view of {_esc(view.path or name)}</footer>"""
    return _page(title or f"pyalloc view: {name}", body, data, _JS_VIEW)


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
    from pyalloc.tune import change_words

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
        # The terminal's words ("2.29 GiB more (16.6%)"), not a signed number that reads as a
        # saving of minus 2.29 GiB.
        if row.own:
            saving = "(reference)"
        elif row.saving is None:
            saving = "-"
        else:
            saving = _esc(change_words(row.saving, row.saving_fraction))
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
    return _page(title or f"pyalloc tune: {name}", body, data, _JS_TUNE)


# ------------------------------------------------------------------------------- styles and scripts

_CSS = """
[hidden]{display:none!important}
:root{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#0f172a;background:#fff}
body{margin:0 auto;padding:16px 24px;max-width:1500px}
h1{font-size:1.4rem;margin:.2em 0}h2{font-size:1.1rem;margin:1.4em 0 .4em}h3{font-size:.95rem;margin:1em 0 .3em}
.muted{color:#64748b;font-size:.85rem}code,pre,.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85rem}
.cards{display:flex;flex-wrap:wrap;gap:12px}.card{border:1px solid #e2e8f0;border-radius:8px;padding:8px 14px;min-width:170px}
.card .label{font-size:.8rem;color:#475569}.card .value{font-size:1.35rem;font-weight:600}.card.bad{border-color:#dc2626;background:#fef2f2}
.note{background:#f1f5f9;border-left:4px solid #94a3b8;padding:6px 10px;margin:8px 0;font-size:.88rem}
.note.warn{background:#fffbeb;border-left-color:#f59e0b}
.legend{display:flex;flex-wrap:wrap;gap:14px;font-size:.85rem;margin:4px 0}
.sw{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:-1px}
.sw.oom{background:repeating-linear-gradient(90deg,#dc2626 0 3px,transparent 3px 5px)}
.sw.dash{background:repeating-linear-gradient(90deg,#6b7280 0 4px,transparent 4px 7px)}
svg{width:100%;height:auto;display:block;font-size:12px}svg text{fill:#334155}
.grid line{stroke:#e2e8f0}.axis text{font-size:11px}.band{opacity:.22}.line{fill:none;stroke-width:1.4}
.peak circle{stroke:#fff;stroke-width:1.5}.peak text{font-weight:600;font-size:12px}
.oom-mark line{stroke:#dc2626;stroke-dasharray:4 3;stroke-width:1.2}.oom-mark text{fill:#dc2626;font-weight:700;font-size:11px}
.guide{stroke:#0f172a;stroke-width:.6;pointer-events:none}
.controls{font-size:.88rem;margin:6px 0}
table{border-collapse:collapse;font-size:.85rem;margin:4px 0}th,td{padding:3px 8px;border-bottom:1px solid #e2e8f0;text-align:left;vertical-align:top}
th{background:#f8fafc;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.frames{max-width:520px}details pre{white-space:pre-wrap;margin:4px 0;max-height:320px;overflow:auto}
#tip{position:absolute;display:none;pointer-events:none;background:#0f172aee;color:#f8fafc;padding:6px 9px;
border-radius:6px;font-size:12px;line-height:1.4;max-width:460px;z-index:10;white-space:pre-wrap}
.recommend{border:2px solid #16a34a;background:#f0fdf4;border-radius:8px;padding:8px 14px;margin:10px 0}
.recommend .label{font-size:.8rem;color:#166534;text-transform:uppercase;letter-spacing:.05em}
.recommend pre{font-size:1.05rem;margin:4px 0;white-space:pre-wrap;word-break:break-all}
.blk{stroke:#fff;stroke-width:.4}
#tune-table td:first-child{padding-right:0}#tune-svg .axis text{font-size:14px}
.split{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:24px;align-items:start}
.split>div{min-width:0;overflow-x:auto}#tune-table{font-size:.8rem}#tune-table th{white-space:normal}#tune-table th,#tune-table td{padding:3px 5px}
@media (max-width:1100px){.split{grid-template-columns:1fr}}
#tune-table tr{cursor:default}#tune-table tr.hl td{background:#eef2ff}#tune-table tr.best td{font-weight:600}
.curve{fill:none;stroke-width:1.4;opacity:.8}.curve.best{stroke-width:3;opacity:1}.curve.dim{opacity:.12}.curve.hl{stroke-width:3.2;opacity:1}
footer{margin-top:2em}
"""

_JS_COMMON = r"""
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const NS = "http://www.w3.org/2000/svg";
function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function fmtBytes(b) {
  for (const [u, s] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 1024]])
    if (Math.abs(b) >= s) return (b / s).toFixed(2) + " " + u;
  return b + " B";
}
function fmtTime(ms) {          // pyalloc.view.format_ms
  if (ms < 1) return (ms * 1000).toFixed(0) + " us";
  if (ms < 1000) return ms.toFixed(2) + " ms";
  return (ms / 1000).toFixed(3) + " s";
}
function fmtInt(n) { return Math.round(n).toLocaleString("en-US"); }
function niceStep(raw) {
  const p = 10 ** Math.floor(Math.log10(raw));
  for (const m of [1, 2, 5, 10]) if (m * p >= raw) return m * p;
  return 10 * p;
}
function byteTicks(max) {
  let unit = 1, name = "B";
  for (const [u, s] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 1024]]) if (max >= s) { unit = s; name = u; break; }
  const step = niceStep(max / unit / 5) * unit;
  const ticks = [];
  for (let v = 0; v <= max + step * 1e-9; v += step) ticks.push(v);
  if (ticks[ticks.length - 1] < max) ticks.push(ticks[ticks.length - 1] + step);
  return {ticks, top: ticks[ticks.length - 1],
          label: v => (v / unit).toFixed(step / unit < 1 ? 1 : 0) + " " + name};
}
const tip = document.getElementById("tip");
function showTip(ev, lines) {
  tip.textContent = lines.join("\n");
  tip.style.display = "block";
  const w = tip.offsetWidth, h = tip.offsetHeight;
  let x = ev.pageX + 14, y = ev.pageY + 14;
  if (x + w > window.scrollX + document.documentElement.clientWidth - 4) x = ev.pageX - w - 14;
  if (y + h > window.scrollY + window.innerHeight - 4) y = ev.pageY - h - 14;
  tip.style.left = x + "px"; tip.style.top = y + "px";
}
function hideTip() { tip.style.display = "none"; }
function svgX(svg, ev, W) { const r = svg.getBoundingClientRect(); return (ev.clientX - r.left) / r.width * W; }
function axes(svg, W, H, M, n, yinfo, X, Y) {
  const g = el("g", {class: "grid axis"}, svg);
  for (const v of yinfo.ticks) {
    el("line", {x1: M.l, x2: W - M.r, y1: Y(v), y2: Y(v)}, g);
    el("text", {x: M.l - 6, y: Y(v) + 4, "text-anchor": "end"}, g).textContent = yinfo.label(v);
  }
  const step = niceStep(Math.max(1, n) / 8);
  for (let v = 0; v <= n; v += step) {
    el("line", {x1: X(v), x2: X(v), y1: H - M.b, y2: H - M.b + 4, stroke: "#94a3b8"}, g);
    el("text", {x: X(v), y: H - M.b + 16, "text-anchor": "middle"}, g).textContent = fmtInt(v);
  }
  el("text", {x: W - M.r, y: H - 4, "text-anchor": "end"}, g).textContent = "trace event";
}
"""

_JS_VIEW = r"""
function bucketAt(x) {            // the bucket holding event index x (binary search on starts)
  let lo = 0, hi = D.x.length - 1;
  while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (D.x[mid] <= x) lo = mid; else hi = mid - 1; }
  return lo;
}
function drawTimeline() {
  const host = document.getElementById("timeline");
  const W = 1000, H = 360, M = {l: 74, r: 18, t: 30, b: 36};
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, id: "timeline-svg", role: "img",
                          "aria-label": "memory over the trace"}, host);
  const n = Math.max(1, D.n);
  let ymax = 1;
  for (const s of D.series) for (const v of s.hi) if (v > ymax) ymax = v;
  const yinfo = byteTicks(ymax * 1.06);
  const X = i => M.l + (W - M.l - M.r) * i / n;
  const Y = v => H - M.b - (H - M.t - M.b) * v / yinfo.top;
  axes(svg, W, H, M, n, yinfo, X, Y);
  const drawn = {};
  for (const s of D.series) {
    const g = el("g", {class: "series", "data-name": s.name}, svg);
    const up = [], down = [];
    let peak = -1, at = 0;
    for (let j = 0; j < D.x.length; j++) {
      const x0 = X(D.x[j]).toFixed(2), x1 = X(Math.min(D.n, D.x[j] + D.bucket)).toFixed(2);
      const yh = Y(s.hi[j]).toFixed(2), yl = Y(s.lo[j]).toFixed(2);
      up.push(x0 + "," + yh, x1 + "," + yh);
      down.push(x0 + "," + yl, x1 + "," + yl);     // reversed below: right to left
      if (s.hi[j] > peak) { peak = s.hi[j]; at = j; }
    }
    el("polygon", {class: "band", fill: s.colour, points: up.concat(down.reverse()).join(" ")}, g);
    el("polyline", {class: "line", stroke: s.colour, points: up.join(" ")}, g);
    drawn[s.name] = {peak, at, colour: s.colour};
    svg.setAttribute("data-drawn-peak-" + s.name, String(peak));
  }
  // Peak markers: reserved above its point, the other one below.
  const marks = ["reserved", D.peakSeries];
  marks.forEach((name, k) => {
    const d = drawn[name];
    if (!d) return;
    const ev = D.peaks[name][1];
    const x = X(ev), y = Y(d.peak);
    const g = el("g", {class: "peak", id: "peak-" + name, "data-bytes": String(d.peak), "data-event": String(ev)}, svg);
    el("circle", {cx: x, cy: y, r: 4.5, fill: d.colour}, g);
    const right = x < W * 0.62;
    const t = el("text", {x: x + (right ? 8 : -8), y: k === 0 ? y - 8 : y + 16, "text-anchor": right ? "start" : "end",
                           fill: d.colour}, g);
    t.textContent = `peak ${name} ${fmtBytes(d.peak)}`;
    t.style.fill = d.colour;
  });
  const og = el("g", {class: "ooms"}, svg);
  D.ooms.forEach((o, k) => {
    const g = el("g", {class: "oom-mark", "data-event": String(o[0])}, og);
    el("line", {x1: X(o[0]), x2: X(o[0]), y1: M.t - 6, y2: H - M.b}, g);
    // The label goes left of a marker near the right edge, which would clip it ("OO").
    const left = X(o[0]) > W - M.r - 30;
    if (k < 12) el("text", {x: X(o[0]) + (left ? -3 : 3), y: M.t - 10, "text-anchor": left ? "end" : "start"},
                   g).textContent = "OOM";
  });
  svg.setAttribute("data-oom-marks", String(D.ooms.length));
  const guide = el("line", {class: "guide", y1: M.t, y2: H - M.b, x1: -10, x2: -10}, svg);
  const hit = el("rect", {x: M.l, y: M.t - 12, width: W - M.l - M.r, height: H - M.t - M.b + 12, fill: "transparent"}, svg);
  hit.addEventListener("mousemove", ev => {
    const x = svgX(svg, ev, W);
    const e = Math.max(0, Math.min(D.n - 1, Math.floor((x - M.l) / (W - M.l - M.r) * n)));
    const j = bucketAt(e);
    guide.setAttribute("x1", X(D.x[j])); guide.setAttribute("x2", X(D.x[j]));
    const last = Math.min(D.n, D.x[j] + D.bucket) - 1;
    const lines = [D.bucket > 1 ? `events ${fmtInt(D.x[j])}-${fmtInt(last)}` : `event ${fmtInt(D.x[j])}`];
    if (D.t[j] !== null) lines.push(`${fmtTime(D.t[j])} into the trace`);
    for (const s of D.series) lines.push(s.lo[j] === s.hi[j] ? `${s.name}: ${fmtBytes(s.hi[j])}`
                                         : `${s.name}: ${fmtBytes(s.lo[j])} .. ${fmtBytes(s.hi[j])}`);
    for (const o of D.ooms) if (o[0] >= D.x[j] && o[0] <= last)
      lines.push(`OOM at event ${fmtInt(o[0])}: ${fmtBytes(o[1])} requested, ${fmtBytes(o[2])} free`);
    showTip(ev, lines);
  });
  hit.addEventListener("mouseleave", () => { hideTip(); guide.setAttribute("x1", -10); guide.setAttribute("x2", -10); });
}

const blockRects = [];
function blockFill(b, mode) {
  if (b[4] === 1 && mode === "state") return D.stateColours.pending_free;
  return mode === "tag" ? D.tagColours[b[5]] : D.stateColours.allocated;
}
function drawMoment(m, host) {
  const W = 1000, ROWS = 28, RH = 13, GAP = 4;
  const H = ROWS * (RH + GAP);
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, class: "segmap", "data-moment": m.name,
                          "data-event": String(m.event), role: "img", "aria-label": "segment map"}, host);
  const starts = [];
  let total = 0;
  for (const s of m.segs) { starts.push(total); total += s[1]; }
  // Whole bytes per row, so that row boundaries are exact integers (no float drift).
  const rowBytes = Math.max(1, Math.ceil(total / ROWS));
  function rowOf(start) {
    let row = Math.floor(start / rowBytes);
    while (row > 0 && row * rowBytes > start) row--;
    while ((row + 1) * rowBytes <= start) row++;
    return row;
  }
  function pieces(start, len, attrs, minW) {
    const out = [];
    while (len > 0) {
      const row = rowOf(start);
      const off = start - row * rowBytes;
      const take = Math.min(len, rowBytes - off);     // > 0: off < rowBytes
      const w = Math.max(minW, take / rowBytes * W);
      out.push(el("rect", Object.assign({x: (off / rowBytes * W).toFixed(2), y: row * (RH + GAP),
                                          width: w.toFixed(2), height: RH}, attrs), svg));
      start += take; len -= take;
    }
    return out;
  }
  m.segs.forEach((s, i) => pieces(starts[i], s[1], {fill: D.stateColours.free, "data-seg": i}, 0));
  let allocated = 0, count = 0;
  const mode = document.querySelector('input[name="colour-by"]:checked').value;
  m.blocks.forEach((b, k) => {
    if (b[4] === 0) { allocated += b[2]; count++; }
    for (const r of pieces(starts[b[0]] + b[1], b[2], {"data-b": k, class: "blk"}, 0.5)) {
      r.setAttribute("fill", blockFill(b, mode));
      blockRects.push([r, b]);
    }
  });
  m.segs.forEach((s, i) => {
    const row = rowOf(starts[i]), x = (starts[i] - row * rowBytes) / rowBytes * W;
    el("rect", {x: Math.max(0, x - 0.6).toFixed(2), y: row * (RH + GAP) - 1, width: 1.2, height: RH + 2,
                fill: "#0f172a", "pointer-events": "none"}, svg);
  });
  svg.setAttribute("data-drawn-allocated", String(allocated));
  svg.setAttribute("data-drawn-blocks", String(count));
  svg.setAttribute("data-drawn-reserved", String(total));
  svg.addEventListener("mousemove", ev => {
    const t = ev.target;
    if (t.hasAttribute("data-b")) {
      const b = m.blocks[+t.getAttribute("data-b")], s = m.segs[b[0]];
      showTip(ev, [`block ${fmtBytes(b[2])} (${fmtInt(b[2])} bytes), requested ${fmtBytes(b[3])}`,
                   b[4] === 0 ? "allocated" : "freed, waiting for its streams (pending free)",
                   `tag: ${D.tags[b[5]]}`, b[6] >= 0 ? `allocated at event ${fmtInt(b[6])}` : "allocated before the trace",
                   `address 0x${(s[0] + b[1]).toString(16)}`,
                   `in segment 0x${s[0].toString(16)} (${fmtBytes(s[1])}${s[2] ? ", expandable" : ""})`]);
    } else if (t.hasAttribute("data-seg")) {
      const i = +t.getAttribute("data-seg"), s = m.segs[i];
      let used = 0;
      for (const b of m.blocks) if (b[0] === i) used += b[2];
      showTip(ev, [`segment 0x${s[0].toString(16)}: ${fmtBytes(s[1])}${s[2] ? " (expandable, mapped part)" : ""}`,
                   `in blocks: ${fmtBytes(used)}; free (cached): ${fmtBytes(s[1] - used)}`]);
    } else hideTip();
  });
  svg.addEventListener("mouseleave", hideTip);
}
function stackLine(f) { return `${D.strings[f[0]]}  ${D.strings[f[1]]}:${f[2]}`; }
function drawStacks() {          // each td.frames[data-stack] gets its stack from D.stacks
  for (const td of document.querySelectorAll("td.frames[data-stack]")) {
    const st = D.stacks[+td.dataset.stack], first = st.frames[0];
    const details = document.createElement("details"), summary = document.createElement("summary");
    const where = document.createElement("span"), pre = document.createElement("pre");
    summary.textContent = D.strings[first[0]] + " ";
    where.className = "muted";
    where.textContent = `${D.strings[first[1]].split("/").pop()}:${first[2]}`;
    summary.appendChild(where);
    pre.textContent = st.frames.map(stackLine).join("\n") + (st.more ? `\n... ${st.more} more frames` : "");
    details.append(summary, pre);
    td.replaceChildren(details);
  }
}
function recolour() {
  const mode = document.querySelector('input[name="colour-by"]:checked').value;
  for (const [r, b] of blockRects) r.setAttribute("fill", blockFill(b, mode));
  document.getElementById("state-legend").hidden = mode !== "state";
  document.getElementById("tag-legend").hidden = mode !== "tag";
  document.body.setAttribute("data-colour-by", mode);
}
drawTimeline();
drawStacks();
for (const host of document.querySelectorAll(".maphost")) {
  const m = D.moments.find(m => m.name === host.getAttribute("data-moment"));
  if (m) drawMoment(m, host);
}
for (const input of document.querySelectorAll('input[name="colour-by"]')) input.addEventListener("change", recolour);
recolour();
document.body.setAttribute("data-render-ms", performance.now().toFixed(1));
document.body.setAttribute("data-rendered", "1");
"""

_JS_TUNE = r"""
function drawTune() {
  const host = document.getElementById("tune-chart");
  const W = 760, H = 480, M = {l: 70, r: 14, t: 16, b: 36};
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, id: "tune-svg", role: "img",
                          "aria-label": "reserved memory per setting"}, host);
  const n = Math.max(1, D.n);
  let ymax = 1;
  for (const r of D.rows) for (const v of r.y) if (v > ymax) ymax = v;
  const yinfo = byteTicks(ymax * 1.04);
  const X = i => M.l + (W - M.l - M.r) * i / n;
  const Y = v => H - M.b - (H - M.t - M.b) * v / yinfo.top;
  axes(svg, W, H, M, n, yinfo, X, Y);
  const paths = {};
  // The best setting is drawn last, on top of the others.
  const order = D.rows.slice().sort((a, b) => (a.best - b.best));
  for (const r of order) {
    let d = `M${X(r.x[0]).toFixed(2)},${Y(r.y[0]).toFixed(2)}`, peak = r.y[0];
    for (let j = 1; j < r.x.length; j++) {
      d += `V${Y(r.y[j]).toFixed(2)}H${X(r.x[j]).toFixed(2)}`;
      if (r.y[j] > peak) peak = r.y[j];
    }
    const p = el("path", {d, class: "curve" + (r.best ? " best" : ""), stroke: r.colour,
                          "data-config": r.label, "data-row": r.id, "data-drawn-peak": String(peak)}, svg);
    if (r.dash) p.setAttribute("stroke-dasharray", "6 4");
    p.addEventListener("mousemove", ev => showTip(ev, [r.label + (r.best ? "  (recommended)" : ""),
                                                       `peak reserved ${fmtBytes(peak)}`]));
    p.addEventListener("mouseleave", hideTip);
    paths[r.id] = p;
  }
  function highlight(id) {
    for (const k in paths) {
      paths[k].classList.toggle("hl", k === id);
      paths[k].classList.toggle("dim", id !== null && k !== id);
      const row = document.getElementById(k);
      if (row) row.classList.toggle("hl", k === id);
    }
    if (id !== null && paths[id]) svg.appendChild(paths[id]);   // bring to the front
    else { const b = D.rows.find(r => r.best); if (b) svg.appendChild(paths[b.id]); }
  }
  for (const tr of document.querySelectorAll("#tune-table tbody tr")) {
    tr.addEventListener("mouseenter", () => highlight(tr.id));
    tr.addEventListener("mouseleave", () => highlight(null));
  }
  svg.setAttribute("data-curves", String(D.rows.length));
}
drawTune();
document.body.setAttribute("data-render-ms", performance.now().toFixed(1));
document.body.setAttribute("data-rendered", "1");
"""
