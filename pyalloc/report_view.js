function bucketAt(x) {            // the bucket holding event index x (binary search on starts)
  let lo = 0, hi = D.x.length - 1;
  while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (D.x[mid] <= x) lo = mid; else hi = mid - 1; }
  return lo;
}
function drawTimeline() {
  const W = 1000, H = 360, M = {l: 74, r: 18, t: 30, b: 36};
  let ymax = 1;
  for (const s of D.series) for (const v of s.hi) if (v > ymax) ymax = v;
  const {svg, n, X, Y} = chart("timeline", "timeline-svg", "memory over the trace", W, H, M, ymax * 1.06);
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
rendered();
