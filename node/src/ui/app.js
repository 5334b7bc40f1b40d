// millrace web UI (issue 18 item 2). Reads the JSON API with the session cookie; every
// write carries X-Millrace-UI: 1 (the node refuses cookie writes without it). All data goes
// into the page through textContent, never as markup.
"use strict";

const PAGE_SIZE = 50; // jobs per page (the API allows at most 1000)
const STATES = ["", "active", "queued", "reserved", "running", "done", "success", "failed",
  "timeout", "cancelled"];

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

function showError(msg) {
  const p = document.getElementById("error");
  p.textContent = msg;
  p.hidden = !msg;
}

async function api(path, init) {
  const r = await fetch(path, Object.assign({ credentials: "same-origin" }, init || {}));
  if (r.status === 401) {
    location.assign("/ui/login");
    throw new Error("logged out");
  }
  let body = null;
  try { body = await r.json(); } catch (_) { body = null; }
  if (!r.ok) {
    const what = body && body.error ? body.error : r.statusText;
    throw new Error(`${path}: ${r.status} ${what}`);
  }
  return body;
}

function post(path) {
  return api(path, { method: "POST", headers: { "X-Millrace-UI": "1" } });
}

function when(ms) {
  if (ms === null || ms === undefined) return "";
  return new Date(ms).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function state(name) {
  return el("span", { class: `state state-${name}`, text: name });
}

// ---- jobs list ----
async function jobsPage(app) {
  const q = new URLSearchParams(location.search);
  const filter = q.get("state") || "";
  const after = q.get("after") || "";
  const select = el("select", { id: "state-filter", "aria-label": "state" });
  for (const s of STATES) {
    const o = el("option", { value: s, text: s || "all states" });
    if (s === filter) o.selected = true;
    select.append(o);
  }
  select.addEventListener("change", () => {
    const p = new URLSearchParams();
    if (select.value) p.set("state", select.value);
    location.search = p.toString();
  });
  const params = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if (filter) params.set("state", filter);
  if (after) params.set("after", after);
  const data = await api(`/v1/jobs?${params}`);
  const rows = data.jobs.map((j) => el("tr", {},
    el("td", {}, el("a", { href: `/ui/jobs/${j.id}`, text: `j${j.id}` })),
    el("td", {}, state(j.state)),
    el("td", { text: `${j.owner}/${j.repo}` }),
    el("td", { class: "cmd", title: j.command, text: j.command }),
    el("td", { text: j.node || "" }),
    el("td", { text: when(j.submitted_at_ms) }),
    el("td", { text: when(j.updated_at_ms) }),
    el("td", { text: j.exit_code !== null && j.exit_code !== undefined ? `exit ${j.exit_code}` : (j.cause || "") })));
  const table = el("table", { id: "jobs" },
    el("thead", {}, el("tr", {}, ...["Job", "State", "Owner/repo", "Command", "Node",
      "Submitted", "Updated", "End"].map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows));
  const pager = el("div", { class: "pager" });
  const base = new URLSearchParams();
  if (filter) base.set("state", filter);
  if (after) pager.append(el("a", { href: `/ui/jobs?${base}`, text: "« newest" }));
  if (data.next !== undefined) {
    const p = new URLSearchParams(base);
    p.set("after", String(data.next));
    pager.append(el("a", { href: `/ui/jobs?${p}`, id: "older", text: "older »" }));
  }
  pager.append(el("span", { class: "muted",
    text: `${data.jobs.length} job${data.jobs.length === 1 ? "" : "s"} shown, newest first` +
      (after ? `, before j${after}` : "") }));
  app.replaceChildren(
    el("h1", { text: "Jobs" }),
    el("div", { class: "toolbar" }, el("label", { for: "state-filter", text: "State" }), select),
    data.jobs.length ? table : el("p", { class: "muted", text: "No jobs." }),
    pager);
}

// ---- one job ----
function specList(j) {
  const items = [
    ["Command", el("code", { text: j.command })],
    ["Engine", j.engine],
    ["Labels", j.labels.join(", ") || "—"],
    ["Owner / repo", `${j.owner} / ${j.repo}`],
    ["Priority", String(j.priority)],
    ["Retries", `${j.retries} (on ${j.retry_on.join(", ") || "nothing"})`],
  ];
  if (j.pinned) items.push(["Pinned to", j.pinned]);
  const res = Object.entries(j.resources || {});
  if (res.length) items.push(["Resources", res.map(([k, v]) => `${k}=${v}`).join(", ")]);
  if (j.env && j.env.length) items.push(["Environment", j.env.join(", ")]);
  items.push(["Submitted", when(j.submitted_at_ms)], ["Updated", when(j.updated_at_ms)]);
  items.push(["State", state(j.state)]);
  if (j.node) items.push(["Node", j.node]);
  if (j.lease !== null && j.lease !== undefined) items.push(["Lease", String(j.lease)]);
  if (j.exit_code !== null && j.exit_code !== undefined) items.push(["Exit code", String(j.exit_code)]);
  if (j.cause) items.push(["Cause", j.cause]);
  if (j.error) items.push(["Error", j.error]);
  if (j.waiting) items.push(["Waiting", j.waiting]);
  const dl = el("dl", { class: "spec", id: "spec" });
  for (const [k, v] of items) dl.append(el("dt", { text: k }), el("dd", {}, v));
  return dl;
}

function attemptsTable(j) {
  if (!j.attempts || !j.attempts.length) return el("p", { class: "muted", text: "No attempt yet." });
  return el("table", { id: "attempts" },
    el("thead", {}, el("tr", {}, ...["#", "Node", "Epoch", "Lease", "Started", "Ended",
      "Status", "Cause", "Exit", "Outcome"].map((h) => el("th", { text: h })))),
    el("tbody", {}, ...j.attempts.map((a) => el("tr", {},
      el("td", { text: String(a.attempt) }),
      el("td", { text: a.node }),
      el("td", { text: String(a.epoch) }),
      el("td", { text: String(a.lease) }),
      el("td", { text: when(a.started_at_ms) }),
      el("td", { text: when(a.ended_at_ms) }),
      el("td", {}, a.status ? state(a.status) : ""),
      el("td", { text: a.cause || "" }),
      el("td", { text: a.exit_code === null || a.exit_code === undefined ? "" : String(a.exit_code) }),
      el("td", { text: a.outcome || "" })))));
}

function decodeBase64(s) {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

// E15: follow the log by cursor; a gap shows how many bytes were lost; stops at the end.
async function followLog(id, pre, status, onDone) {
  const decoder = new TextDecoder("utf-8");
  let cursor = 0;
  for (;;) {
    let piece;
    try {
      piece = await api(`/v1/jobs/${id}/log?cursor=${cursor}&wait=10`);
    } catch (e) {
      status.textContent = `log: ${e.message}; retrying`;
      await new Promise((r) => setTimeout(r, 2000));
      continue;
    }
    if (piece.gap) {
      pre.append(el("span", { class: "gap",
        text: `[${piece.gap.lost} bytes lost (${piece.gap.reason})]` }));
    }
    if (piece.len > 0) {
      pre.append(decoder.decode(decodeBase64(piece.data), { stream: true }));
      pre.scrollTop = pre.scrollHeight;
    }
    cursor = piece.next;
    if (piece.done) {
      pre.append(decoder.decode());
      status.textContent = `end of log (${cursor} bytes)`;
      onDone();
      return;
    }
    status.textContent = `following… (${cursor} bytes)`;
  }
}

async function jobPage(app) {
  const id = decodeURIComponent(location.pathname.split("/").pop()).replace(/^j/, "");
  const spec = el("div");
  const attempts = el("div");
  const title = el("h1", { text: `Job j${id}` });
  const cancel = el("button", { type: "button", class: "danger", id: "cancel", text: "Cancel" });
  const pre = el("pre", { class: "log", id: "log" });
  const logState = el("p", { class: "logstate", id: "log-state", text: "following…" });
  async function refresh() {
    const j = await api(`/v1/jobs/${encodeURIComponent(id)}`);
    spec.replaceChildren(specList(j));
    attempts.replaceChildren(attemptsTable(j));
    cancel.hidden = j.done;
    return j;
  }
  cancel.addEventListener("click", async () => {
    if (!confirm(`Cancel job j${id}?`)) return;
    try { await post(`/v1/jobs/${encodeURIComponent(id)}/cancel`); await refresh(); showError(""); }
    catch (e) { showError(e.message); }
  });
  const j = await refresh();
  app.replaceChildren(
    el("div", { class: "toolbar" }, title, cancel),
    spec,
    el("h2", { text: "Attempts" }), attempts,
    el("h2", { text: "Log" }), logState, pre);
  const timer = setInterval(() => { if (!j.done) refresh().catch((e) => showError(e.message)); }, 3000);
  followLog(encodeURIComponent(id), pre, logState, () => {
    clearInterval(timer);
    refresh().catch((e) => showError(e.message));
  });
}

// ---- nodes ----
async function nodesPage(app) {
  const data = await api("/v1/nodes");
  const now = Date.now();
  const rows = data.nodes.map((n) => {
    const used = n.leases;
    const pct = n.capacity ? Math.min(100, Math.round((100 * used) / n.capacity)) : 0;
    const bar = el("span", { class: "bar" }, el("span"));
    bar.firstChild.style.width = `${pct}%`;
    let grace = "";
    if (n.grace_until_ms !== undefined) {
      const left = Math.max(0, Math.round((n.grace_until_ms - now) / 1000));
      grace = `${left} s left (${when(n.grace_until_ms).slice(11)})`;
    }
    const action = el("td");
    if (n.state === "quarantined") {
      const b = el("button", { type: "button", class: "danger", text: "Lift quarantine" });
      b.addEventListener("click", async () => {
        if (!confirm(`Let ${n.node} connect again?`)) return;
        try { await post(`/v1/nodes/${encodeURIComponent(n.node)}/quarantine/lift`); showError(""); }
        catch (e) { showError(e.message); }
        render();
      });
      action.append(b);
    }
    // A node without a live session has no current snapshot: its seats are unknown.
    const known = n.capacity > 0 || n.state === "ready" || n.state === "connected";
    return el("tr", {},
      el("td", { text: n.node }),
      el("td", {}, state(n.state)),
      el("td", { text: n.epoch || "" }),
      el("td", { text: known ? `${used} / ${n.capacity}` : `${used} / —` }),
      el("td", {}, known ? bar : "", known ? `${pct}% (${n.running} running)` : `${n.running} running`),
      el("td", { text: n.engines.join(", ") }),
      el("td", { text: n.labels.join(", ") }),
      el("td", { text: grace }),
      action);
  });
  const table = el("table", { id: "nodes" },
    el("thead", {}, el("tr", {}, ...["Node", "State", "Epoch", "Seats used", "Load", "Engines",
      "Labels", "Grace", ""].map((h) => el("th", { text: h })))),
    el("tbody", {}, ...rows));
  app.replaceChildren(el("h1", { text: "Nodes" }),
    data.nodes.length ? table : el("p", { class: "muted", text: "No executor is connected." }));
}

async function render() {
  const app = document.getElementById("app");
  const page = document.body.dataset.page;
  try {
    if (page === "jobs") await jobsPage(app);
    else if (page === "job") await jobPage(app);
    else if (page === "nodes") await nodesPage(app);
    showError("");
  } catch (e) {
    showError(e.message);
  }
}

async function health() {
  try {
    const r = await fetch("/health");
    const h = await r.json();
    document.getElementById("health").textContent = `${h.role}, term ${h.term}`;
  } catch (_) { /* the header line is a nicety */ }
}

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  const nav = document.getElementById(page === "nodes" ? "nav-nodes" : "nav-jobs");
  if (nav) nav.classList.add("current");
  document.getElementById("logout").addEventListener("click", async () => {
    await fetch("/ui/logout", { method: "POST", credentials: "same-origin",
      headers: { "X-Millrace-UI": "1" } });
    location.assign("/ui/login");
  });
  health();
  render();
  // The lists refresh themselves; the job page refreshes while it follows its log.
  if (page === "nodes") setInterval(render, 3000);
  // (Not while the state filter has the focus: a re-render would close its list.)
  if (page === "jobs" && !new URLSearchParams(location.search).get("after")) {
    setInterval(() => {
      const active = document.activeElement;
      if (!active || active.id !== "state-filter") render();
    }, 5000);
  }
});
