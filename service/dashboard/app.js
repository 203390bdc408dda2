// The relaunch dashboard: plain JavaScript, no build step, nothing from the internet.
// It polls the REST API with the user's token, sends ETags back (If-None-Match) so an
// unchanged answer costs a 304, and slows down while the tab is hidden.
"use strict";

const API = "/api/v1";
const POLL_MS = 2000;
const HIDDEN_POLL_MS = 15000;
const TOKEN_KEY = "relaunch-token";
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
const STATES = ["PENDING", "RUNNING", "RESTARTING", "WAITING", "SUCCEEDED", "FAILED", "CANCELLED"];
const PAGE_SIZE = 20;
const LOG_TAIL = 25;

class Offline extends Error {}
class SignedOut extends Error {}
class ApiError extends Error {
  constructor(status, detail) {
    super(typeof detail === "string" ? detail : JSON.stringify(detail));
    this.status = status;
  }
}

const session = {
  token: sessionStorage.getItem(TOKEN_KEY),
  cached: new Map(), // path -> {etag, body}
  timer: null,
  page: null,
  lastUpdate: null,
  requests: 0,
  notModified: 0,
};

// ---- talking to the API -------------------------------------------------------------

async function call(method, path, { conditional = false } = {}) {
  const headers = { Authorization: `Bearer ${session.token}` };
  const cached = conditional ? session.cached.get(path) : undefined;
  if (cached) headers["If-None-Match"] = cached.etag;
  let response;
  try {
    response = await fetch(API + path, { method, headers, cache: "no-store" });
  } catch (err) {
    throw new Offline(String(err));
  }
  session.requests += 1;
  if (response.status === 304 && cached) {
    session.notModified += 1;
    return cached.body;
  }
  if (response.status === 401) {
    signOut("The controller refused the token; sign in again.");
    throw new SignedOut();
  }
  if (response.status >= 500) throw new Offline(`HTTP ${response.status}`);
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new ApiError(response.status, body.detail);
  const etag = response.headers.get("ETag");
  if (conditional && etag) session.cached.set(path, { etag, body });
  return body;
}

const get = (path) => call("GET", path, { conditional: true });
const getNew = (path) => call("GET", path); // after_id polling: each path is asked once

// ---- small DOM helpers (text only: data never becomes markup) ----------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function s(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, value);
  if (text !== undefined) el.textContent = text;
  return el;
}

// A table cell for a short value (a time, a kind, a state, a count): one line, as wide as it
// needs. Other cells hold free text, which takes the rest of the row's width and wraps.
const fit = (...children) => h("td", { class: "fit" }, ...children);

const view = () => document.getElementById("view");
const stateTag = (state) => h("span", { class: `state ${state}`, "data-testid": "state" }, state);

function ago(iso) {
  if (!iso) return "–";
  const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (seconds < 60) return `${Math.round(seconds)} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${(seconds / 3600).toFixed(1)} h ago`;
}

function duration(start, end) {
  if (!start) return "–";
  const seconds = ((end ? Date.parse(end) : Date.now()) - Date.parse(start)) / 1000;
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

const clock = (iso) => (iso ? new Date(iso).toLocaleTimeString() : "–");

function progress(job) {
  const step = job.last_step ?? 0;
  const total = job.total_steps;
  const share = total ? Math.min(100, (100 * step) / total) : 0;
  return h(
    "span",
    { "data-testid": "progress" },
    h("span", { class: "bar" }, h("span", { style: `width:${share.toFixed(1)}%` })),
    `${step} / ${total ?? "?"}`,
  );
}

// ---- connection state: never show old data as current ------------------------------------

function setConnection(ok, why = "") {
  const badge = document.getElementById("conn");
  badge.className = `conn ${ok ? "ok" : "down"}`;
  badge.textContent = ok ? `updated ${new Date().toLocaleTimeString()}` : "reconnecting…";
  badge.title = why;
  view().classList.toggle("stale", !ok);
}

async function tick() {
  clearTimeout(session.timer);
  const page = session.page;
  if (!page || !session.token) return;
  try {
    await page.refresh();
    setConnection(true);
  } catch (err) {
    if (err instanceof SignedOut) return;
    if (err instanceof ApiError) page.fail?.(err);
    else setConnection(false, String(err.message || err));
  }
  if (page === session.page) {
    session.timer = setTimeout(tick, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }
}

document.addEventListener("visibilitychange", () => {
  if (!document.hidden) tick(); // catch up at once when the tab comes back
});

// ---- pages ---------------------------------------------------------------------------

function jobsPage(params) {
  const filter = params.get("state") || "";
  const offset = Number(params.get("offset") || 0);
  const body = h("tbody");
  const total = h("span", { class: "muted" });
  const select = h(
    "select",
    {
      "data-testid": "state-filter",
      onchange: (e) => go(`#/jobs?state=${e.target.value}`),
    },
    h("option", { value: "" }, "all states"),
    STATES.map((st) => h("option", { value: st, selected: st === filter }, st)),
  );
  const pageLink = (to, label) =>
    h("a", { href: `#/jobs?state=${filter}&offset=${Math.max(0, to)}` }, label);
  const pager = h("div", { class: "pager" });
  view().replaceChildren(
    h(
      "section",
      { class: "card" },
      h("h2", {}, "Jobs ", total),
      h("label", {}, "Filter: ", select),
      h(
        "table",
        { "data-testid": "jobs" },
        h(
          "thead",
          {},
          h(
            "tr",
            {},
            ["id", "name", "state", "world / nodes", "progress", "restarts", "last snapshot",
              "owner", "started", "duration"].map((c) => h("th", {}, c)),
          ),
        ),
        body,
      ),
      pager,
    ),
  );
  return {
    async refresh() {
      const query = `?limit=${PAGE_SIZE}&offset=${offset}${filter ? `&state=${filter}` : ""}`;
      const page = await get(`/jobs${query}`);
      total.textContent = `(${page.total})`;
      body.replaceChildren(
        ...page.items.map((job) =>
          h(
            "tr",
            { "data-job": job.id },
            fit(h("a", { href: `#/jobs/${job.id}` }, job.id)),
            h("td", {}, h("a", { href: `#/jobs/${job.id}` }, job.name)),
            fit(stateTag(job.state)),
            fit(`${job.world_size ?? "–"} / ${job.min_nodes}:${job.max_nodes}`),
            fit(progress(job)),
            fit(`${job.restart_count} / ${job.spec.max_restarts}`),
            fit(ago(job.last_snapshot_at)),
            h("td", {}, job.owner ?? "–"),
            fit(clock(job.started_at)),
            fit(duration(job.started_at, job.finished_at)),
          ),
        ),
      );
      pager.replaceChildren(
        offset > 0 ? pageLink(offset - PAGE_SIZE, "← newer") : "",
        h("span", { class: "muted" }, `${offset + 1}–${offset + page.items.length}`),
        offset + PAGE_SIZE < page.total ? pageLink(offset + PAGE_SIZE, "older →") : "",
      );
    },
  };
}

function lossChart(metrics, events) {
  const width = 640;
  const height = 240;
  const pad = { l: 48, r: 48, t: 12, b: 28 };
  const svg = s("svg", {
    viewBox: `0 0 ${width} ${height}`,
    width: "100%",
    "data-testid": "loss-chart",
  });
  const points = metrics.filter((m) => m.loss !== null);
  if (points.length === 0) {
    svg.append(s("text", { x: pad.l, y: height / 2 }, "no progress reported yet"));
    return svg;
  }
  const maxStep = Math.max(...metrics.map((m) => m.step), 1);
  const losses = points.map((m) => m.loss);
  const [lo, hi] = [Math.min(...losses), Math.max(...losses)];
  const speeds = metrics.filter((m) => m.samples_per_s !== null).map((m) => m.samples_per_s);
  const topSpeed = Math.max(...speeds, 1);
  const x = (step) => pad.l + ((width - pad.l - pad.r) * step) / maxStep;
  const y = (loss) => pad.t + (height - pad.t - pad.b) * (1 - (loss - lo) / (hi - lo || 1));
  const ySpeed = (v) => pad.t + (height - pad.t - pad.b) * (1 - v / topSpeed);
  const line = (data, fx, fy) => data.map((m, i) => `${i ? "L" : "M"}${fx(m).toFixed(1)},${fy(m).toFixed(1)}`).join("");

  svg.append(
    s("line", { x1: pad.l, y1: height - pad.b, x2: width - pad.r, y2: height - pad.b, stroke: "#999" }),
    s("text", { x: pad.l, y: height - 8 }, "step 0"),
    s("text", { x: width - pad.r - 40, y: height - 8 }, `step ${maxStep}`),
    s("text", { x: 2, y: pad.t + 10 }, hi.toFixed(3)),
    s("text", { x: 2, y: height - pad.b }, lo.toFixed(3)),
    s("text", { x: width - pad.r + 4, y: pad.t + 10 }, `${Math.round(topSpeed)}/s`),
  );
  const withSpeed = metrics.filter((m) => m.samples_per_s !== null);
  if (withSpeed.length > 1) {
    svg.append(s("path", {
      d: line(withSpeed, (m) => x(m.step), (m) => ySpeed(m.samples_per_s)),
      fill: "none", stroke: "#b7c4d8", "stroke-width": 1.2, "data-testid": "throughput-line",
    }));
  }
  svg.append(s("path", {
    d: line(points, (m) => x(m.step), (m) => y(m.loss)),
    fill: "none", stroke: "#2b6cb0", "stroke-width": 2, "data-testid": "loss-line",
  }));

  // World-size changes: where the world size of consecutive reports differs.
  metrics.forEach((m, i) => {
    if (i > 0 && m.world_size !== metrics[i - 1].world_size) {
      svg.append(
        s("line", { x1: x(m.step), x2: x(m.step), y1: pad.t, y2: height - pad.b, stroke: "#2b6cb0",
          "stroke-dasharray": "2 3", "data-testid": "world-marker" }),
        s("text", { x: x(m.step) + 3, y: pad.t + 22 }, `world ${m.world_size}`),
      );
    }
  });
  // Restarts: at the last step reported before the restart.
  const times = metrics.map((m) => Date.parse(m.time));
  for (const event of events.filter((e) => e.kind === "restarting")) {
    const when = Date.parse(event.time);
    let step = 0;
    times.forEach((t, i) => { if (t <= when) step = metrics[i].step; });
    svg.append(
      s("line", { x1: x(step), x2: x(step), y1: pad.t, y2: height - pad.b, stroke: "#c0392b",
        "stroke-dasharray": "4 3", "data-testid": "restart-marker" }),
      s("text", { x: x(step) + 3, y: pad.t + 10 }, "restart"),
    );
  }
  return svg;
}

// One recovery as a line of text: its cause, then each phase reported, in order.
function recoveryText(recovery) {
  const phases = recovery.phases
    .filter((p) => p.seconds !== null)
    .map((p) => `${p.name.replaceAll("_", " ")} ${p.seconds.toFixed(2)} s${p.same_clock ? "" : "*"}`);
  const total = recovery.total_s !== null ? ` = ${recovery.total_s.toFixed(2)} s` : " (not back yet)";
  return `${clock(recovery.moments.failed)} ${recovery.cause}: ${phases.join(" · ")}${total}`;
}

function jobPage(jobId) {
  const seen = { events: [], metrics: [], logs: new Map(), eventId: 0, metricId: 0, logId: 0 };
  const head = h("section", { class: "card" });
  const chart = h("section", { class: "card" }, h("h3", {}, "Loss and throughput"));
  const timeline = h("tbody");
  const recoveries = h("ul", { "data-testid": "recoveries" });
  const attempts = h("tbody");
  const snapshots = h("tbody");
  const logs = h("div", { class: "grid logs" });
  const spec = h("pre", { "data-testid": "spec" });
  view().replaceChildren(
    head,
    chart,
    h(
      "div",
      { class: "grid" },
      h("section", { class: "card" }, h("h3", {}, "Timeline"),
        h("table", { "data-testid": "timeline" }, timeline),
        h("h3", {}, "Recoveries"), recoveries,
        h("p", { class: "muted" }, "* between two clocks (two nodes, or a node and the controller): holds their difference too")),
      h(
        "div",
        {},
        h("section", { class: "card" }, h("h3", {}, "Attempts"),
          h("table", { "data-testid": "attempts" }, attempts)),
        h("section", { class: "card" }, h("h3", {}, "Snapshots"),
          h("table", { "data-testid": "snapshots" }, snapshots)),
        h("section", { class: "card" }, h("h3", {}, "Spec"), spec),
      ),
    ),
    h("section", { class: "card" }, h("h3", {}, "Logs (the tail of each rank)"), logs),
  );

  async function cancel() {
    if (!window.confirm(`Cancel job ${jobId}? Its workers are stopped on every node.`)) return;
    await call("POST", `/jobs/${jobId}/cancel`);
    tick();
  }

  function renderHead(job) {
    const parts = [
      h("h2", {}, `Job ${job.id}: ${job.name} `, stateTag(job.state)),
      h(
        "p",
        {},
        `owner ${job.owner ?? "–"} · ${deviceText(job)} · world size ${job.world_size ?? "–"} of ${job.min_nodes}:${job.max_nodes} nodes · restarts ${job.restart_count} / ${job.spec.max_restarts} · membership changes ${job.membership_changes} · last snapshot ${ago(job.last_snapshot_at)} · running ${duration(job.started_at, job.finished_at)}`,
      ),
      h(
        "p",
        {},
        "progress ",
        progress(job),
        job.last_loss !== null ? ` · loss ${job.last_loss.toFixed(4)}` : "",
        job.step_time_s != null ? ` · ${job.step_time_s.toPrecision(3)} s/step` : "",
      ),
      job.message ? h("p", { class: "muted" }, job.message) : null,
      TERMINAL.has(job.state)
        ? null
        : h("button", { class: "danger", onclick: cancel, "data-testid": "cancel" }, "Cancel job"),
    ];
    head.replaceChildren(...parts.filter((part) => part !== null));
  }

  return {
    async refresh() {
      const job = await get(`/jobs/${jobId}`);
      const [events, metrics, lines, snaps, recovered] = await Promise.all([
        getNew(`/jobs/${jobId}/events?after_id=${seen.eventId}`),
        getNew(`/jobs/${jobId}/metrics?after_id=${seen.metricId}`),
        getNew(`/jobs/${jobId}/logs?after_id=${seen.logId}&limit=1000`),
        get(`/jobs/${jobId}/snapshots`),
        get(`/jobs/${jobId}/recoveries`),
      ]);
      seen.events.push(...events.items);
      seen.metrics.push(...metrics.items);
      seen.eventId = events.items.at(-1)?.id ?? seen.eventId;
      seen.metricId = metrics.items.at(-1)?.id ?? seen.metricId;
      for (const line of lines.items) {
        const who = line.global_rank != null ? `rank ${line.global_rank}`
          : line.local_rank != null ? `local rank ${line.local_rank}` : "launcher";
        const key = `attempt ${line.attempt_number} · node ${line.node_name} · ${who}`;
        const tail = seen.logs.get(key) ?? [];
        tail.push(line.line);
        seen.logs.set(key, tail.slice(-LOG_TAIL));
        seen.logId = line.id;
      }
      renderHead(job);
      chart.replaceChildren(h("h3", {}, "Loss and throughput"), lossChart(seen.metrics, seen.events),
        h("p", { class: "legend muted" }, h("span", {}, "blue: loss"), h("span", {}, "grey: samples/s"),
          h("span", {}, "red dashes: restart"), h("span", {}, "blue dashes: world size change")));
      timeline.replaceChildren(
        ...seen.events.map((e) =>
          h("tr", { "data-kind": e.kind }, fit(clock(e.time)), fit(e.kind), h("td", {}, e.message)),
        ),
      );
      recoveries.replaceChildren(
        ...recovered.items.map((r) => h("li", { "data-cause": r.cause }, recoveryText(r))),
      );
      attempts.replaceChildren(
        ...job.attempts.map((a) =>
          h(
            "tr",
            {},
            fit(`#${a.number}`),
            fit(stateTag(a.state)),
            fit(`world ${a.world_size ?? "–"}`),
            fit(a.device ?? "cpu"),
            h("td", {}, a.members.map((m) => `${m.node_name} (${m.state.toLowerCase()}${m.gpus?.length ? `, GPU ${m.gpus.join(",")}` : ""})`).join(", ")),
            h("td", {}, a.result),
          ),
        ),
      );
      snapshots.replaceChildren(
        ...snaps.items.slice(-10).reverse().map((sn) =>
          h("tr", {}, fit(`step ${sn.step}`), fit(`epoch ${sn.epoch}`),
            fit(`world ${sn.world_size ?? "–"}`), fit(`${(sn.bytes / 1024).toFixed(0)} KiB`),
            fit(clock(sn.created_at))),
        ),
      );
      logs.replaceChildren(
        ...[...seen.logs.entries()].sort().map(([key, tail]) =>
          h("div", {}, h("strong", {}, key), h("pre", { "data-testid": "log-tail" }, tail.join("\n"))),
        ),
      );
      spec.textContent = JSON.stringify(job.spec, null, 2);
    },
    fail(err) {
      head.replaceChildren(h("p", { class: "error" }, err.status === 404 ? `No job ${jobId}.` : err.message));
    },
  };
}

const GIB = 1024 ** 3;

// One line per GPU of a node: index and model, its use at the last heartbeat, and who holds it.
function gpuList(node) {
  if (!node.gpus?.length) return "–";
  const versions = [node.gpu_driver && `driver ${node.gpu_driver}`, node.cuda_version && `CUDA ${node.cuda_version}`]
    .filter(Boolean).join(" · ");
  return h(
    "div",
    {},
    versions ? h("div", { class: "muted" }, versions) : null,
    ...node.gpus.map((gpu) => {
      const memory = gpu.memory_total_bytes != null
        ? `${gpu.memory_used_bytes != null ? (gpu.memory_used_bytes / GIB).toFixed(1) : "?"} / ${(gpu.memory_total_bytes / GIB).toFixed(1)} GiB`
        : null;
      const use = gpu.utilization_pct != null ? `${Math.round(gpu.utilization_pct)}%` : null;
      const holder = gpu.job_id != null
        ? h("a", { href: `#/jobs/${gpu.job_id}` }, `job ${gpu.job_id}`)
        : gpu.held ? "another user's job" : "free";
      return h(
        "div",
        { "data-gpu": gpu.index },
        [`${gpu.index}: ${gpu.name || "GPU"}`, use, memory].filter(Boolean).join(" · "),
        " · ",
        holder,
      );
    }),
  );
}

// "cuda (asked: auto)": the device the newest attempt was placed for, and the spec's.
function deviceText(job) {
  const asked = job.spec.device ?? "auto";
  if (!job.device) return `device ${asked}`;
  return job.device === asked ? `device ${job.device}` : `device ${job.device} (asked: ${asked})`;
}

function nodesPage() {
  const body = h("tbody");
  view().replaceChildren(
    h(
      "section",
      { class: "card" },
      h("h2", {}, "Nodes"),
      h(
        "table",
        { "data-testid": "nodes" },
        h("thead", {}, h("tr", {}, ["name", "state", "last heartbeat", "serving", "slots", "cpus", "GPUs", "address"].map((c) => h("th", {}, c)))),
        body,
      ),
    ),
  );
  return {
    async refresh() {
      const page = await get("/nodes?limit=1000");
      body.replaceChildren(
        ...page.items.map((node) =>
          h(
            "tr",
            { "data-node": node.name },
            h("td", {}, node.name),
            fit(stateTag(node.state)),
            fit(ago(node.last_heartbeat_at)),
            fit(node.job_id ? h("a", { href: `#/jobs/${node.job_id}` }, `job ${node.job_id}`) : node.busy ? "another user's job" : "–"),
            fit(node.slots),
            fit(node.cpus ?? "–"),
            h("td", { "data-testid": "gpus" }, gpuList(node)),
            h("td", {}, node.address),
          ),
        ),
      );
    },
  };
}

// ---- sign-in and routing ---------------------------------------------------------------

function signOut(message = "") {
  sessionStorage.removeItem(TOKEN_KEY);
  session.token = null;
  session.cached.clear();
  session.page = null;
  document.getElementById("who").textContent = "";
  document.getElementById("logout").hidden = true;
  const form = document.getElementById("login-template").content.cloneNode(true);
  view().classList.remove("stale");
  view().replaceChildren(form);
  document.getElementById("login-error").textContent = message;
  document.getElementById("login").addEventListener("submit", async (e) => {
    e.preventDefault();
    session.token = document.getElementById("token").value.trim();
    try {
      await signIn();
      sessionStorage.setItem(TOKEN_KEY, session.token);
      route();
    } catch (err) {
      if (!(err instanceof SignedOut)) {
        document.getElementById("login-error").textContent = `Cannot reach the controller: ${err.message}`;
      }
    }
  });
}

async function signIn() {
  const me = await call("GET", "/users/me");
  document.getElementById("who").textContent = `${me.name} (${me.role})`;
  document.getElementById("logout").hidden = false;
}

function go(hash) {
  window.location.hash = hash;
}

function route() {
  if (!session.token) return signOut();
  const [path, query] = (window.location.hash.slice(1) || "/jobs").split("?");
  const params = new URLSearchParams(query);
  const parts = path.split("/").filter(Boolean);
  document.querySelectorAll("[data-nav]").forEach((a) => a.classList.toggle("active", a.dataset.nav === parts[0]));
  if (parts[0] === "jobs" && parts[1]) session.page = jobPage(Number(parts[1]));
  else if (parts[0] === "nodes") session.page = nodesPage();
  else session.page = jobsPage(params);
  tick();
}

window.addEventListener("hashchange", route);
document.getElementById("logout").addEventListener("click", () => signOut());
window.relaunchStats = () => ({ requests: session.requests, notModified: session.notModified });

if (session.token) {
  signIn().then(route, (err) => {
    if (!(err instanceof SignedOut)) {
      setConnection(false, String(err.message));
      setTimeout(() => window.location.reload(), HIDDEN_POLL_MS);
    }
  });
} else {
  signOut();
}
