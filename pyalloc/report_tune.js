function drawTune() {
  let ymax = 1;
  for (const r of D.rows) for (const v of r.y) if (v > ymax) ymax = v;
  const {svg, X, Y} = chart("tune-chart", "tune-svg", "reserved memory per setting",
                            760, 480, {l: 70, r: 14, t: 16, b: 36}, ymax * 1.04);
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
rendered();
