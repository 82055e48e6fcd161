// A small SVG line chart: samples in, a polyline with its scale and latest value out.

const NS = "http://www.w3.org/2000/svg";
const W = 300;
const H = 120;
const PAD = 18;

function el(name, attrs, text) {
  const node = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

// points: [{at_s, value|null}], window_s: seconds shown, format: value -> label
export function lineChart(svg, points, { window_s = 300, format = (v) => v.toFixed(1) } = {}) {
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  svg.replaceChildren();
  const known = points.filter((p) => p.value !== null && p.value !== undefined);
  const now = points.length ? points[points.length - 1].at_s : 0;
  const top = Math.max(...known.map((p) => p.value), 0) * 1.15 || 1;
  const x = (t) => PAD + ((t - (now - window_s)) / window_s) * (W - 2 * PAD);
  const y = (v) => H - PAD - (v / top) * (H - 2 * PAD);
  svg.append(el("line", { x1: PAD, x2: W - PAD, y1: H - PAD, y2: H - PAD, stroke: "#d8dce3" }));
  svg.append(el("text", { x: 2, y: 12 }, format(top)));
  svg.append(el("text", { x: 2, y: H - 4 }, `-${Math.round(window_s / 60)} min`));
  if (!known.length) {
    svg.append(el("text", { x: W / 2 - 30, y: H / 2 }, "no data yet"));
    svg.setAttribute("aria-label", `${svg.dataset.label || "chart"}: no data yet`);
    return;
  }
  // A gap (no requests in a tick) breaks the line instead of drawing a zero.
  let run = [];
  const flush = () => {
    if (run.length > 1) svg.append(el("polyline", { points: run.join(" ") }));
    else if (run.length === 1) {
      // a lone sample (one request in a quiet minute) is a dot, not an invisible line
      const [cx, cy] = run[0].split(",");
      svg.append(el("circle", { cx, cy, r: 3 }));
    }
    run = [];
  };
  for (const p of points) {
    if (p.value === null || p.value === undefined || p.at_s < now - window_s) flush();
    else run.push(`${x(p.at_s).toFixed(1)},${y(p.value).toFixed(1)}`);
  }
  flush();
  const last = known[known.length - 1];
  const label = `latest ${format(last.value)}`;
  svg.append(el("text", { x: W - PAD - 90, y: 12 }, label));
  svg.setAttribute("aria-label", `${svg.dataset.label || "chart"}: ${label}`);
}
