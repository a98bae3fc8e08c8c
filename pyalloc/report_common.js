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
// A chart of bytes over trace events in host element `hostId`: its svg (viewBox W x H, margins M),
// the y axis up to `ymax` bytes, n (events, at least 1), the scales X (event index) and Y (bytes),
// the axes drawn.
function chart(hostId, svgId, label, W, H, M, ymax) {
  const svg = el("svg", {viewBox: `0 0 ${W} ${H}`, id: svgId, role: "img", "aria-label": label},
                 document.getElementById(hostId));
  const n = Math.max(1, D.n);
  const yinfo = byteTicks(ymax);
  const X = i => M.l + (W - M.l - M.r) * i / n;
  const Y = v => H - M.b - (H - M.t - M.b) * v / yinfo.top;
  axes(svg, W, H, M, n, yinfo, X, Y);
  return {svg, n, X, Y};
}
// Called by each page's script once it has drawn: the browser tests wait for data-rendered.
function rendered() {
  document.body.setAttribute("data-render-ms", performance.now().toFixed(1));
  document.body.setAttribute("data-rendered", "1");
}
