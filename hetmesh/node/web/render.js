// Drawing the node's view: peer cards, the plan, load per stage, the link heat map, events.
// Every colour has a word next to it (health, bottleneck, standby), so none is colour-only.

export const short = (id) => (id && id.length > 12 ? `…${id.slice(-8)}` : id || "?");
const mib = (b) => `${(b / 2 ** 20).toFixed(0)} MiB`;
const bytes = (b) => (b >= 2 ** 30 ? `${(b / 2 ** 30).toFixed(2)} GiB` : mib(b));
const rate = (bps) =>
  bps >= 1e9 ? `${(bps / 1e9).toFixed(1)} GB/s` : `${(bps / 1e6).toFixed(1)} MB/s`;
export const ms = (s) => (s === null || s === undefined ? "–" : `${(s * 1e3).toFixed(1)} ms`);
const median = (xs) => {
  if (!xs || !xs.length) return null;
  const s = [...xs].sort((a, b) => a - b);
  const m = Math.floor(s.length / 2);
  return s.length % 2 ? s[m] : (s[m - 1] + s[m]) / 2;
};

function h(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (k === "dataset") Object.assign(node.dataset, v);
    else if (k === "className") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function host(record) {
  const addr = (record.addrs || [])[0] || "";
  const m = addr.match(/^\/(ip4|ip6|dns4|dns6|dns)\/([^/]+)/);
  return m ? m[2] : "unknown host";
}

export function healthWord(health) {
  return health === "self" ? "alive (this node)" : health;
}

function bar(pct, label) {
  const node = h("div", { className: "bar", role: "img", "aria-label": label }, h("span"));
  node.firstChild.style.width = `${Math.min(100, Math.max(0, pct))}%`;
  return node;
}

function peerCard(peer, reserved) {
  const r = peer.record || {};
  const load = r.load || {};
  // what the node really uses (RSS, or its own cgroup's usage) beside the plan's charge
  const mem = (r.extra || {}).memory || null;
  const inUse = mem
    ? h(
        "p",
        { className: "memory-in-use" },
        `in use ${mib(mem.in_use || 0)} (${mem.source || "rss"}) · the plan charged ${mib(mem.charged || 0)} + runtime ${mib(mem.runtime || 0)}`,
      )
    : null;
  const devices = (r.devices || []).map((d) => {
    const total = d.memory_total_bytes || 0;
    const used = Math.max(0, total - (d.memory_free_bytes || 0));
    const pct = total ? Math.round((100 * used) / total) : 0;
    const planned = reserved[`${peer.peer_id} ${d.device}`] || 0;
    const plannedPct = total ? Math.round((100 * planned) / total) : 0;
    return h(
      "div",
      { className: "device" },
      h("p", {}, `${d.device} · ${d.name || d.backend}`),
      h("p", { className: "muted" }, `${(d.matmul_flops / 1e9).toFixed(1)} GFLOP/s · memory ${rate(d.memory_bandwidth_bps)}`),
      h("p", {}, `memory ${mib(used)} used · ${mib(d.memory_free_bytes || 0)} free`),
      bar(pct, `memory ${pct}% used`),
      planned ? h("p", { className: "muted" }, `the plan reserves ${mib(planned)} here (${plannedPct}%)`) : null,
      planned ? bar(plannedPct, `the plan reserves ${plannedPct}%`) : null,
    );
  });
  const stages = (r.stages || []).map((s) => `units [${s.start}, ${s.end}) ${s.ready ? "ready" : "loading"}`);
  const heard = peer.health === "self" ? "" : ` · heard ${peer.last_heard_s.toFixed(1)} s ago`;
  return h(
    "article",
    { className: "card", dataset: { peerId: peer.peer_id, health: peer.health }, tabindex: "0", "aria-label": `peer ${short(peer.peer_id)}, ${healthWord(peer.health)}` },
    h("h3", { title: peer.peer_id }, short(peer.peer_id)),
    h("p", {}, h("span", { className: "health", dataset: { health: peer.health } }, healthWord(peer.health)), ` ${host(r)}${heard}`),
    devices,
    inUse,
    h("p", {}, stages.length ? stages.join("; ") : "no stage"),
    h("p", { className: "muted" }, `sessions ${load.active_sessions || 0} · queue ${load.queue_depth || 0} · KV ${mib(load.kv_bytes_used || 0)}`),
    speculation((r.extra || {}).gateway || {}),
  );
}

// speculative decoding at this node's gateway: drafts kept of those sent, tokens a verify step
function speculation(g) {
  if (!g.verify_steps || !g.drafted) return null;
  const perStep = (g.verified_tokens || 0) / g.verify_steps;
  return h(
    "p",
    { className: "muted speculation" },
    `drafts kept ${g.accepted || 0}/${g.drafted} · ${perStep.toFixed(2)} tokens a verify step`,
  );
}

// memory the plan's stages reserve per "peer device" (weights, KV budget, workspace)
function reservations(plan) {
  const out = {};
  const seen = new Set();
  for (const pipe of (plan && plan.pipelines) || []) {
    for (const s of pipe.stages) {
      const key = `${s.peer_id} ${s.device}`;
      if (seen.has(`${key} ${s.start}`)) continue; // a stage shared by two pipelines
      seen.add(`${key} ${s.start}`);
      out[key] = (out[key] || 0) + (s.memory_bytes || 0);
    }
  }
  return out;
}

export function renderPeers(view, plan) {
  const peers = view.peers || [];
  const reserved = reservations(plan);
  const alive = peers.filter((p) => p.health === "alive" || p.health === "self").length;
  document.getElementById("peer-count").textContent = `(${peers.length}, ${alive} alive)`;
  document.getElementById("peers").replaceChildren(...peers.map((p) => peerCard(p, reserved)));
}

function records(view) {
  return Object.fromEntries((view.peers || []).map((p) => [p.peer_id, p]));
}

function stageFacts(stage, peers) {
  const peer = peers[stage.peer_id] || { health: "unknown", record: {} };
  const r = peer.record || {};
  const ready = (r.stages || []).some((s) => s.ready && s.start === stage.start && s.end === stage.end);
  const measured = median((r.load || {}).recent_step_s);
  return { ...stage, peer, ready, measured };
}

function stageBox(st, index, { bottleneck = false, standbyFor = null } = {}) {
  const units = st.end - st.start;
  const box = h(
    "div",
    { className: "stage", tabindex: "0", dataset: { peerId: st.peer_id, bottleneck: String(bottleneck), standby: String(standbyFor !== null) } },
    h("strong", {}, standbyFor !== null ? `standby for stage ${standbyFor}` : `stage ${index}`),
    h("span", {}, `units [${st.start}, ${st.end}) · ${units} unit${units === 1 ? "" : "s"}`),
    h("br"),
    h("span", {}, `${short(st.peer_id)} ${st.device} · ${healthWord(st.peer.health)} · ${st.ready ? "ready" : "loading"}`),
    h("br"),
    h("span", {}, `step ${ms(st.decode_step_s)} predicted, ${ms(st.measured)} measured`),
    bottleneck ? h("span", { className: "tag" }, " bottleneck ") : null,
  );
  box.style.flexGrow = String(Math.max(1, units));
  return box;
}

export function renderPlan(plan, view) {
  const out = document.getElementById("plan");
  const summary = document.getElementById("plan-summary");
  const table = document.querySelector("#load tbody");
  if (!plan || !(plan.pipelines || []).length) {
    summary.textContent = "no plan published yet";
    out.replaceChildren();
    table.replaceChildren();
    return;
  }
  const peers = records(view);
  const [primary, ...replicas] = plan.pipelines;
  const stages = primary.stages.map((s) => stageFacts(s, peers));
  const cost = (s) => (s.measured !== null ? s.measured : s.decode_step_s);
  const slowest = stages.reduce((a, b) => (cost(b) > cost(a) ? b : a), stages[0]);
  summary.textContent =
    `epoch ${plan.epoch} · ${plan.strategy}, ${plan.objective} · ${plan.model_name} · ` +
    `predicted ${ms(plan.decode_latency_s)}/token, ${(plan.throughput_tps || 0).toFixed(1)} tokens/s`;
  const row = [];
  stages.forEach((st, i) => {
    if (i) row.push(h("span", { className: "arrow", "aria-hidden": "true" }, "→"));
    row.push(stageBox(st, i, { bottleneck: st === slowest }));
  });
  const blocks = [h("p", { className: "pipeline-label" }, "primary pipeline"), h("div", { className: "pipeline" }, row)];
  const standby = [];
  for (const pipe of replicas) {
    pipe.stages.forEach((s, j) => {
      const base = primary.stages[j];
      if (!base || base.peer_id !== s.peer_id || base.device !== s.device) standby.push([stageFacts(s, peers), j]);
    });
  }
  if (standby.length) {
    blocks.push(h("p", { className: "pipeline-label" }, "standby replicas"));
    blocks.push(h("div", { className: "pipeline" }, standby.map(([st, j]) => stageBox(st, j, { standbyFor: j }))));
  }
  out.replaceChildren(...blocks);
  const rows = [...stages.map((st, i) => [`${i}`, st]), ...standby.map(([st, j]) => [`${j} (standby)`, st])];
  table.replaceChildren(
    ...rows.map(([label, st]) => {
      const r = st.peer.record || {};
      const load = r.load || {};
      const server = ((r.extra || {}).stage_servers || []).find((x) => x.start === st.start && x.end === st.end) || {};
      const kvTotal = (load.kv_bytes_used || 0) + (load.kv_bytes_free || 0);
      const kvPct = kvTotal ? ` (${Math.round((100 * (load.kv_bytes_used || 0)) / kvTotal)}%)` : "";
      return h(
        "tr",
        {},
        h("td", {}, label),
        h("td", {}, short(st.peer_id)),
        h("td", {}, String(load.active_sessions || 0)),
        h("td", {}, String(server.queue_depth ?? load.queue_depth ?? 0)),
        h("td", {}, `${bytes(load.kv_bytes_used || 0)}${kvPct}`),
        h("td", {}, String(server.tokens || 0)),
      );
    }),
  );
}

// a mesh serving several models: one line per model, its plan and its peers' load
export function renderModels(plans, view) {
  const out = document.getElementById("models");
  const names = Object.keys(plans || {});
  if (names.length < 2) {
    out.replaceChildren();
    return;
  }
  const peers = (view.peers || []).filter((p) => p.health === "alive" || p.health === "self");
  out.replaceChildren(
    ...names.map((name) => {
      const plan = plans[name];
      const serving = peers.filter((p) => ((p.record || {}).extra || {}).model === name);
      const load = (k) => serving.reduce((sum, p) => sum + (((p.record || {}).load || {})[k] || 0), 0);
      const stages = (plan.pipelines || []).map((pipe) =>
        pipe.stages.map((s) => `${short(s.peer_id)} [${s.start}, ${s.end})`).join(" → "),
      );
      return h(
        "li",
        {},
        `${name} · epoch ${plan.epoch} (${plan.strategy}) · ${stages.join(" | ")} · ` +
          `${serving.length} peer(s), ${load("active_sessions")} session(s), queue ${load("queue_depth")}`,
      );
    }),
  );
}

export function renderLinks(view) {
  const peers = (view.peers || []).filter((p) => p.health !== "dead" && p.health !== "left").map((p) => p.peer_id);
  const links = {};
  for (const l of view.links || []) links[`${l.src} ${l.dst}`] = l;
  const head = h("tr", {}, h("th", { scope: "col" }, "from \\ to"), peers.map((p) => h("th", { scope: "col", title: p }, short(p))));
  const body = peers.map((src) =>
    h(
      "tr",
      {},
      h("th", { scope: "row", title: src }, short(src)),
      peers.map((dst) => {
        const l = links[`${src} ${dst}`];
        if (src === dst) return h("td", { className: "none" }, "·");
        if (!l) return h("td", { className: "none", tabindex: "0", title: "not measured yet" }, "–");
        const tip = `${short(src)} → ${short(dst)}: ${rate(l.bandwidth_bps)}, RTT ${ms(l.rtt_s)}`;
        const cell = h("td", { tabindex: "0", title: tip, "aria-label": tip }, rate(l.bandwidth_bps));
        // log scale: 1 MB/s pale, 10 GB/s dark
        const t = Math.min(1, Math.max(0, (Math.log10(Math.max(l.bandwidth_bps, 1)) - 6) / 4));
        cell.style.background = `hsl(220, 60%, ${92 - 55 * t}%)`;
        cell.style.color = t > 0.55 ? "#fff" : "#1d2330";
        return cell;
      }),
    ),
  );
  document.getElementById("links").replaceChildren(h("thead", {}, head), h("tbody", {}, body));
}

const MAX_EVENTS = 200;

export function addEvent(event) {
  const list = document.getElementById("events");
  if (list.querySelector(`[data-event-id="${event.id}"]`)) return;
  const at = new Date(event.at_s * 1000).toLocaleTimeString();
  const item = h(
    "li",
    { dataset: { eventId: String(event.id), kind: event.kind, level: event.level, peerId: event.peer_id || "" } },
    h("time", {}, at),
    h("span", { className: "kind" }, event.kind),
    event.message,
  );
  list.prepend(item);
  while (list.children.length > MAX_EVENTS) list.lastChild.remove();
}
