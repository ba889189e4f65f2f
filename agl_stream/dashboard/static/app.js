// The dashboard page: plain JavaScript over the JSON API (/api/openapi.json describes it),
// re-rendered when /api/live says the read model changed. No framework, nothing from a CDN.
"use strict";

const view = document.getElementById("view");
const state = { rollouts: { filters: {}, form: {}, cursors: [null] }, selectedSpan: null };

const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
};

class Unauthorized extends Error {}

// With a token the server answers 401 until the browser has signed in at /login (its cookie
// then goes with every call, the event stream's too); actions add X-AGL-Dashboard, which
// another site's page cannot send.
async function api(path, params, method = "GET", body = undefined) {
  const url = new URL(path, location.origin);
  for (const [key, value] of Object.entries(params || {})) {
    for (const item of [].concat(value)) if (item !== "" && item !== undefined && item !== null) url.searchParams.append(key, item);
  }
  const headers = method === "GET" ? {} : { "Content-Type": "application/json", "X-AGL-Dashboard": "1" };
  const response = await fetch(url, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const answer = await response.json();
  if (response.status === 401) throw new Unauthorized("this dashboard needs its token");
  if (!response.ok) throw new Error(typeof answer.error === "string" ? answer.error : response.statusText);
  return answer;
}

function signInView() {
  return [el("h2", {}, "Token needed"), el("p", {}, "This dashboard has a token: ", el("a", { href: "/login" }, "sign in"), " once.")];
}

const when = (iso) => (iso ? new Date(iso).toLocaleString() : "");
const num = (x, digits = 3) => (x === null || x === undefined ? "" : Number(x).toFixed(digits));
const statusCell = (s) => el("td", { class: `status-${s}` }, s);

function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))), el("tbody", {}, rows));
}

// -- runs -------------------------------------------------------------------------------

function curve(points) {
  const w = 520, h = 160, pad = 28;
  const ys = points.map((p) => p.reward).filter((r) => r !== null);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "curve");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  if (!ys.length) return svg;
  const lo = Math.min(0, ...ys), hi = Math.max(1, ...ys);
  const steps = points.map((p) => p.step), s0 = Math.min(...steps), s1 = Math.max(...steps, s0 + 1);
  const x = (s) => pad + ((s - s0) / (s1 - s0)) * (w - 2 * pad);
  const y = (r) => h - pad - ((r - lo) / (hi - lo)) * (h - 2 * pad);
  const d = points.filter((p) => p.reward !== null).map((p, i) => `${i ? "L" : "M"}${x(p.step)},${y(p.reward)}`).join(" ");
  svg.innerHTML = `<line x1="${pad}" y1="${h - pad}" x2="${w - pad}" y2="${h - pad}" stroke="#bbb"/>
    <line x1="${pad}" y1="${pad}" x2="${pad}" y2="${h - pad}" stroke="#bbb"/>
    <text x="4" y="${y(hi) + 4}" font-size="10">${hi.toFixed(1)}</text>
    <text x="4" y="${y(lo) + 4}" font-size="10">${lo.toFixed(1)}</text>
    <text x="${w - pad}" y="${h - 8}" font-size="10" text-anchor="end">step ${s1}</text>
    <path d="${d}" fill="none" stroke="#1a5fb4" stroke-width="2"/>`;
  return svg;
}

async function runsView() {
  const runs = await api("/api/runs");
  if (!runs.length) return [el("h2", {}, "Runs"), el("p", { class: "muted" }, "No training run has published a version yet.")];
  return [
    el("h2", {}, "Runs"),
    runs.map((run) => {
      const last = run.points[run.points.length - 1];
      const counts = Object.entries(last.counts).map(([k, v]) => `${k} ${v}`).join(", ");
      const rate = last.samples_per_second === null || last.samples_per_second === undefined ? "" : `, ${num(last.samples_per_second, 1)} samples/s`;
      return el("div", { class: "card run", "data-run": run.name },
        el("h3", {}, `${run.name} `, el("span", { class: "muted" }, `${run.algorithm}, ${run.versions} versions`)),
        el("p", {}, `latest reward `, el("strong", { class: "latest-reward" }, num(run.latest_reward)),
          ` at ${run.algorithm === "apo" ? "round" : "step"} `, el("span", { class: "latest-step" }, last.step),
          `, ${when(run.last_published_at)}${rate}`,
          counts ? el("span", { class: "muted" }, ` (${counts})`) : null),
        curve(run.points),
        el("p", { class: "muted" }, "versions: ", run.points.slice(-8).map((p) => p.resources_id).join(" · ")));
    }),
  ];
}

// -- rollouts ---------------------------------------------------------------------------

const STATUSES = ["queuing", "requeuing", "running", "succeeded", "failed", "cancelled"];

// The form shows what the person chose, applied or not: a live update that re-renders the
// view while they choose keeps their choices (state.rollouts.form), and Filter applies them.
function formValues(form) {
  const data = new FormData(form);
  const text = (name) => data.get(name) || "";
  return { status: data.getAll("status"), mode: text("mode"), worker_id: text("worker_id"), metadata: text("metadata"), since: text("since"), id: text("id") };
}

function filtersFrom(f) {
  return {
    status: f.status, mode: f.mode, worker_id: f.worker_id, metadata: f.metadata.split(/\s+/).filter(Boolean),
    since: f.since ? new Date(f.since).toISOString() : "", id: f.id,
  };
}

function filtersForm() {
  const f = state.rollouts.form;
  const remember = (event) => { state.rollouts.form = formValues(event.currentTarget); };
  const submit = (event) => {
    event.preventDefault();
    state.rollouts.form = formValues(event.target);
    state.rollouts.filters = filtersFrom(state.rollouts.form);
    state.rollouts.cursors = [null];
    render();
  };
  return el("form", { class: "filters", onsubmit: submit, oninput: remember, onchange: remember },
    el("label", {}, "status", el("select", { name: "status", multiple: "", size: 3 },
      STATUSES.map((s) => el("option", { value: s, ...((f.status || []).includes(s) ? { selected: "" } : {}) }, s)))),
    el("label", {}, "mode", el("select", { name: "mode" }, ["", "train", "val", "test"].map((m) =>
      el("option", { value: m, ...((f.mode || "") === m ? { selected: "" } : {}) }, m || "any")))),
    el("label", {}, "worker", el("input", { name: "worker_id", value: f.worker_id || "" })),
    el("label", {}, "metadata k=v", el("input", { name: "metadata", value: f.metadata || "" })),
    el("label", {}, "updated since", el("input", { name: "since", type: "datetime-local", value: f.since || "" })),
    el("label", {}, "rollout id", el("input", { name: "id", value: f.id || "", placeholder: "search by id" })),
    el("button", { type: "submit" }, "Filter"));
}

async function byId(rolloutId) {  // a search by id: that rollout, or none
  const response = await fetch(`/api/rollouts/${encodeURIComponent(rolloutId)}`);
  if (response.status === 404) return { items: [], next_cursor: null };
  if (response.status === 401) throw new Unauthorized("this dashboard needs its token");
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return { items: [body.rollout], next_cursor: null };
}

async function rolloutsView() {
  const { filters, cursors } = state.rollouts;
  const cursor = cursors[cursors.length - 1];
  let page;
  try {
    page = filters.id ? await byId(filters.id) : await api("/api/rollouts", { ...filters, id: undefined, cursor, descending: "true", limit: 50 });
  } catch (error) {
    return [el("h2", {}, "Rollouts"), filtersForm(), el("p", { class: "error" }, error.message)];
  }
  const rows = page.items.map((r) =>
    el("tr", { class: "clickable", "data-rollout": r.rollout_id, onclick: () => (location.hash = `#/rollout/${encodeURIComponent(r.rollout_id)}`) },
      el("td", {}, r.rollout_id), statusCell(r.status), el("td", {}, r.mode || ""), el("td", {}, r.attempt_count),
      el("td", {}, num(r.reward)), el("td", {}, r.worker_id || ""), el("td", {}, when(r.updated_at))));
  const pager = el("p", {},
    cursors.length > 1 ? el("button", { onclick: () => { cursors.pop(); render(); } }, "← previous") : null, " ",
    page.next_cursor ? el("button", { class: "next", onclick: () => { cursors.push(page.next_cursor); render(); } }, "next →") : null);
  return [el("h2", {}, "Rollouts"), filtersForm(),
    table(["rollout", "status", "mode", "attempts", "reward", "worker", "updated"], rows),
    rows.length ? pager : el("p", { class: "muted empty" }, "No rollout matches.")];
}

// -- one rollout ------------------------------------------------------------------------

function depthOf(spans) {
  const byId = new Map(spans.map((s) => [s.span_id, s]));
  const depth = (s, seen = 0) => (s.parent_span_id && byId.has(s.parent_span_id) && seen < 50 ? 1 + depth(byId.get(s.parent_span_id), seen + 1) : 0);
  return new Map(spans.map((s) => [s.span_id, depth(s)]));
}

function transcript(span) {
  const a = span.attributes;
  let prompt = {};
  try { prompt = JSON.parse(a["gen_ai.prompt.json"] || "{}"); } catch (e) { prompt = {}; }
  const messages = prompt.messages || (prompt.text ? [{ role: "prompt", content: prompt.text }] : []);
  const logprobs = a["agl.llm.response_logprobs"] || [];
  const mean = logprobs.length ? logprobs.reduce((x, y) => x + y, 0) / logprobs.length : null;
  return el("div", { class: "chat" },
    messages.map((m) => el("div", { class: "msg" }, el("div", { class: "role" }, m.role), typeof m.content === "string" ? m.content : JSON.stringify(m.content))),
    el("div", { class: "msg assistant" }, el("div", { class: "role" }, "answer"), a["gen_ai.completion"] ?? ""),
    el("p", { class: "muted" }, `${a["gen_ai.usage.input_tokens"] ?? "?"} prompt tokens, ${a["gen_ai.usage.output_tokens"] ?? "?"} answer tokens`,
      mean === null ? "" : `, mean logprob ${mean.toFixed(3)}`, a["agl.llm.resources_id"] ? `, version ${a["agl.llm.resources_id"]}` : ""));
}

function waterfall(spans) {
  if (!spans.length) return el("p", { class: "muted" }, "No spans.");
  const t = (iso) => new Date(iso).getTime();
  const t0 = Math.min(...spans.map((s) => t(s.start_time))), t1 = Math.max(...spans.map((s) => t(s.end_time)), t0 + 1);
  const depths = depthOf(spans);
  const detail = el("div", { class: "span-detail" });
  const show = (span) => {
    detail.replaceChildren(el("h3", {}, span.name),
      span.name === "agl.llm.call" ? transcript(span) : null,
      el("pre", {}, JSON.stringify(span.attributes, null, 2)));
  };
  const rows = [...spans].sort((a, b) => t(a.start_time) - t(b.start_time)).map((s) => {
    const left = ((t(s.start_time) - t0) / (t1 - t0)) * 100, width = ((t(s.end_time) - t(s.start_time)) / (t1 - t0)) * 100;
    const kind = s.status_code === "ERROR" ? "error" : s.name === "agl.llm.call" ? "llm" : s.name === "agl.reward" ? "reward" : "";
    return el("div", { class: "row span", "data-span": s.name, onclick: () => show(s) },
      el("div", { class: "name", style: `padding-left:${depths.get(s.span_id) * 14}px`, title: s.name }, s.name),
      el("div", { class: "track" }, el("div", { class: `bar ${kind}`, style: `left:${left}%;width:${width}%` })));
  });
  return el("div", {}, el("p", { class: "muted" }, `${spans.length} spans over ${((t1 - t0) / 1000).toFixed(3)} s`),
    el("div", { class: "waterfall" }, rows), detail);
}

function actionsBar(r) {
  if (!state.actions) return null;
  const note = el("span", { class: "muted action-result" });
  const act = (action, body) => async () => {
    try {
      const done = await api(`/api/rollouts/${encodeURIComponent(r.rollout_id)}/${action}`, {}, "POST", body);
      note.textContent = done.requeued_as ? `requeued as ${done.requeued_as}` : `${action} requested`;
      if (done.requeued_as) note.append(" ", el("a", { href: `#/rollout/${encodeURIComponent(done.requeued_as)}` }, "open"));
    } catch (error) {
      note.textContent = error.message;
    }
  };
  const open = ["queuing", "requeuing", "running"].includes(r.status);
  return el("p", { class: "actions" },
    open ? el("button", { class: "cancel", onclick: act("cancel", { reason: "cancelled from the dashboard" }) }, "Cancel") : null,
    open ? null : el("button", { class: "requeue", onclick: act("requeue") }, "Requeue"), " ", note);
}

async function rolloutView(rolloutId, attemptId) {
  const detail = await api(`/api/rollouts/${encodeURIComponent(rolloutId)}`);
  const r = detail.rollout;
  const chosen = attemptId || r.latest_attempt_id;
  const spans = chosen ? await api(`/api/rollouts/${encodeURIComponent(rolloutId)}/spans`, { attempt_id: chosen }) : [];
  const attempts = detail.attempts.map((a) =>
    el("tr", { class: "clickable", onclick: () => (location.hash = `#/rollout/${encodeURIComponent(rolloutId)}/${encodeURIComponent(a.attempt_id)}`) },
      el("td", {}, a.attempt_number, a.attempt_id === chosen ? " ◀" : ""), statusCell(a.status), el("td", {}, a.worker_id),
      el("td", {}, num(a.reward)), el("td", {}, `${a.spans_received}${a.span_count === null ? "" : "/" + a.span_count}`),
      el("td", {}, when(a.started_at)), el("td", { class: "error" }, a.error ? `${a.error.type}: ${a.error.message}` : "")));
  return [
    el("h2", {}, `Rollout ${r.rollout_id}`),
    el("div", { class: "card" },
      el("p", {}, "status ", el("strong", { class: `status-${r.status}` }, r.status), ` · mode ${r.mode || ""} · reward ${num(r.reward)} · resources ${r.resources_id || r.attempt_resources_id || ""}`),
      el("pre", {}, JSON.stringify(r.input, null, 2)), actionsBar(r)),
    el("h3", {}, "Attempts"),
    table(["#", "status", "worker", "reward", "spans", "started", "error"], attempts),
    detail.rewards.length ? [el("h3", {}, "Rewards given later"), table(["name", "value", "attempt", "source", "given"],
      detail.rewards.map((w) => el("tr", { class: "late-reward" }, el("td", {}, w.name), el("td", {}, num(w.value)),
        el("td", {}, w.attempt_id || "the rollout"), el("td", {}, w.source || ""), el("td", {}, when(w.given_at)))))] : null,
    el("h3", {}, "Spans"),
    waterfall(spans),
  ];
}

// -- workers and resources --------------------------------------------------------------

async function workersView() {
  const workers = await api("/api/workers");
  const rolloutLinks = (ids) => ids.slice(0, 5).flatMap((id) => [el("a", { href: `#/rollout/${encodeURIComponent(id)}` }, id), " "]);
  return [el("h2", {}, "Workers"), table(["worker", "role", "status", "health", "current rollouts", "lag", "counts", "last heartbeat"],
    workers.map((w) => el("tr", { "data-worker": w.worker_id }, el("td", {}, w.worker_id), el("td", {}, w.role), el("td", {}, w.status),
      el("td", { class: `health-${w.health}` }, w.health),
      el("td", {}, `${w.current_rollouts.length} `, rolloutLinks(w.current_rollouts)),
      el("td", {}, w.counts.lag ?? ""),
      el("td", {}, Object.entries(w.counts).filter(([k]) => k !== "lag").slice(0, 6).map(([k, v]) => `${k} ${v}`).join(", ")),
      el("td", {}, when(w.last_heartbeat_at)))))];
}

async function deadLettersView() {
  const letters = await api("/api/dead-letters", { limit: 200 });
  if (!letters.length) return [el("h2", {}, "Dead letters"), el("p", { class: "muted empty" }, "No dead letters.")];
  return [el("h2", {}, "Dead letters"), table(["#", "from", "kind", "reason", "consumer", "at", "value"],
    letters.map((d) => el("tr", { "data-dead-letter": d.dlq_offset }, el("td", {}, d.dlq_offset),
      el("td", {}, `${d.source_topic}[${d.source_partition}]@${d.source_offset}`), el("td", {}, d.kind),
      el("td", { class: "reason" }, d.reason), el("td", {}, d.consumer), el("td", {}, d.at),
      el("td", {}, el("details", {}, el("summary", {}, d.size === null ? "no value" : `${d.size} bytes${d.event ? ", " + d.event.type : ""}`),
        el("pre", {}, d.event ? JSON.stringify(d.event, null, 2) : d.preview))))))];
}

function lineDiff(before, after) {
  const a = before.split("\n"), b = after.split("\n");
  const inA = new Set(a), inB = new Set(b);
  return el("div", { class: "diff" }, a.filter((l) => !inB.has(l)).map((l) => el("div", { class: "del" }, l)), b.map((l) => el("div", { class: inA.has(l) ? "" : "add" }, l)));
}

async function resourcesView() {
  const versions = await api("/api/resources", { limit: 200 });
  const byId = new Map(versions.map((v) => [v.resources_id, v]));
  const rows = versions.map((v) => {
    const parent = v.parent_resources_id && byId.get(v.parent_resources_id);
    const cells = Object.entries(v.resources).map(([name, r]) => {
      if (r.template !== undefined) {
        const before = parent && parent.resources[name] && parent.resources[name].template;
        return el("div", {}, el("strong", {}, name), before !== undefined && before !== r.template ? lineDiff(before, r.template) : el("pre", {}, r.template));
      }
      if (r.uri !== undefined) return el("div", {}, el("strong", {}, name), ` checkpoint ${r.uri.split("/").slice(-1)[0]} (${r.content_hash.slice(0, 19)}…)`);
      if (r.endpoint !== undefined) return el("div", {}, el("strong", {}, name), ` ${r.model} at ${r.endpoint}`);
      return el("div", {}, el("strong", {}, name), " ", JSON.stringify(r));
    });
    return el("tr", {}, el("td", {}, v.resources_id, el("div", { class: "muted" }, `v${v.version} ← ${v.parent_resources_id || "—"}`)),
      el("td", {}, cells), el("td", {}, v.published_by || ""), el("td", {}, when(v.published_at)));
  });
  return [el("h2", {}, "Resources"), table(["version", "resources (prompt changes against the parent)", "by", "published"], rows)];
}

// -- routing and live updates -----------------------------------------------------------

async function overview() {
  try {
    const o = await api("/api/overview");
    state.actions = o.actions;
    const counts = Object.entries(o.status_counts).map(([s, n]) => `${n} ${s}`).join(" · ") || "no rollouts";
    const workers = Object.entries(o.workers_alive).map(([r, n]) => `${n} ${r}`).join(", ") || "none";
    document.getElementById("overview").textContent = `${counts} — workers alive: ${workers}`;
  } catch (error) {
    document.getElementById("overview").textContent = error.message;
  }
}

let rendering = Promise.resolve();
// A live update (`fromLive`) leaves the rollouts view alone while the person is in its
// filter form; anything the person did renders at once.
function render(fromLive = false) {
  rendering = rendering.then(async () => {
    const [, name, ...rest] = location.hash.replace(/^#/, "").split("/");
    const current = name || "runs";
    document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.view === current));
    const views = {
      runs: runsView, rollouts: rolloutsView, rollout: () => rolloutView(...rest.map(decodeURIComponent)),
      workers: workersView, resources: resourcesView, "dead-letters": deadLettersView,
    };
    try {
      if (state.actions === undefined) await overview();
      const content = await (views[current] || runsView)();
      const keep = fromLive && current === "rollouts" && document.activeElement && document.activeElement.closest("form.filters");
      if (!keep) view.replaceChildren(...[content].flat(Infinity).filter((x) => x !== null && x !== undefined));
      view.dataset.rendered = String(Number(view.dataset.rendered || 0) + 1);
    } catch (error) {
      view.replaceChildren(...[error instanceof Unauthorized ? signInView() : el("p", { class: "error" }, error.message)].flat());
    }
    await overview();
  });
  return rendering;
}

let source = null;
function live() {
  const badge = document.getElementById("live");
  if (source) source.close();
  source = new EventSource("/api/live");
  source.addEventListener("open", () => { badge.textContent = "● live"; badge.className = "on"; });
  source.addEventListener("error", () => { badge.textContent = "○ reconnecting"; badge.className = ""; });
  source.addEventListener("changed", () => render(true));
}

window.addEventListener("hashchange", () => render());
render();
live();
