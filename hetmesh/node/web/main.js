// The dashboard's entry point: log in if the node wants a key, follow the live feed,
// reconnect by itself, and redraw from each snapshot.

import { readEvents, request, setApiKey, Unauthorized } from "./api.js";
import { lineChart } from "./charts.js";
import { setupChat } from "./chat.js";
import { addEvent, ms, renderLinks, renderModels, renderPeers, renderPlan } from "./render.js";

const $ = (id) => document.getElementById(id);
const SERIES_MAX = 300;
const STALL_MS = 6000; // no message for this long: the stream is dead, reconnect

const state = { series: [], model: "", interval_s: 1, controller: null, started: false, locked: false };

function setConnection(word) {
  const c = $("connection");
  c.dataset.state = word;
  c.textContent = word;
}

function showLogin(message = "") {
  state.locked = true;
  if (state.controller) state.controller.abort();
  $("dash").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message;
  $("summary").textContent = "locked";
  setConnection("locked");
  $("api-key").focus();
}

function drawCharts() {
  const pick = (k) => state.series.map((s) => ({ at_s: s.at_s, value: s[k] }));
  const windowS = Math.max(60, Math.min(300, state.series.length * state.interval_s));
  lineChart($("chart-tps"), pick("tokens_per_s"), { window_s: windowS, format: (v) => `${v.toFixed(1)}/s` });
  lineChart($("chart-ttft"), pick("ttft_s"), { window_s: windowS, format: ms });
  lineChart($("chart-tpot"), pick("tpot_s"), { window_s: windowS, format: ms });
}

function drawSnapshot(snap) {
  if (!snap) return;
  const { view, plan } = snap;
  const plans = snap.plans || {};
  renderPeers(view, plan);
  renderPlan(plan, view);
  renderModels(plans, view);
  renderLinks(view);
  const peers = view.peers || [];
  const alive = peers.filter((p) => p.health === "alive" || p.health === "self").length;
  const names = Object.keys(plans);
  const model = names.length > 1 ? names.join(", ") : plan ? plan.model_name : state.model || "no model";
  const epoch = plan ? `plan epoch ${plan.epoch} (${plan.strategy})` : "no plan yet";
  $("summary").textContent =
    `${model} · ${epoch} · ${alive}/${peers.length} peers alive`;
}

async function follow() {
  const controller = new AbortController();
  state.controller = controller;
  let watchdog = null;
  const kick = () => {
    clearTimeout(watchdog);
    watchdog = setTimeout(() => controller.abort(), STALL_MS);
  };
  try {
    const reply = await request("/v1/hetmesh/events", { signal: controller.signal });
    if (!reply.ok) throw new Error(`HTTP ${reply.status}`);
    setConnection("live");
    kick();
    await readEvents(reply, (event, data) => {
      kick();
      const body = JSON.parse(data);
      if (event === "hello") {
        // a restarted node numbers its events from 1 again: forget the old ones
        if (state.feedId && state.feedId !== body.feed_id) $("events").replaceChildren();
        state.feedId = body.feed_id;
        state.interval_s = body.interval_s || 1;
        state.series = body.series || [];
        (body.events || []).forEach(addEvent);
        drawSnapshot(body.snapshot);
        drawCharts();
      } else if (event === "snapshot") {
        state.series.push(body.sample);
        if (state.series.length > SERIES_MAX) state.series.splice(0, state.series.length - SERIES_MAX);
        drawSnapshot(body);
        drawCharts();
      } else if (event === "mesh-event") {
        addEvent(body);
      }
    });
  } finally {
    clearTimeout(watchdog);
  }
}

async function live() {
  let delay = 1000;
  while (!state.locked) {
    try {
      await follow();
      delay = 1000;
    } catch (err) {
      if (err instanceof Unauthorized) {
        setApiKey("");
        showLogin("The API key was refused; enter it again.");
        return;
      }
    }
    if (state.locked) return;
    setConnection("reconnecting");
    await new Promise((done) => setTimeout(done, delay));
    delay = Math.min(delay * 2, 10000);
  }
}

async function open() {
  // Probe a data route: 401 means this node wants a key we do not have (yet).
  try {
    const reply = await request("/v1/models");
    const body = await reply.json();
    state.model = ((body.data || [])[0] || {}).id || "";
  } catch (err) {
    if (err instanceof Unauthorized) {
      const tried = sessionStorage.length > 0;
      setApiKey(""); // a refused key is not kept
      showLogin(tried ? "The API key was refused." : "");
      return;
    }
    setConnection("reconnecting");
    setTimeout(open, 2000);
    return;
  }
  state.locked = false;
  $("login").hidden = true;
  $("dash").hidden = false;
  if (!state.started) {
    state.started = true;
    setupChat({ model: () => state.model, onUnauthorized: () => showLogin("The API key was refused.") });
  }
  live();
}

$("login-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setApiKey($("api-key").value.trim());
  $("api-key").value = "";
  open();
});

open();
