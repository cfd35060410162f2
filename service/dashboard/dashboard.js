// The ckptconv job dashboard: one ES module, no dependencies, same-origin API calls only.
//
// Safety: every value that comes from the API (labels, URIs, error messages, metadata) reaches the
// page through textContent or a form control's value, never as markup; the server's
// Content-Security-Policy allows no inline script. The API key lives in this tab's sessionStorage
// and travels only in the Authorization header (never in a URL): that is also why job events are
// read with fetch() rather than EventSource, which cannot send headers.

const KEY_STORE = "ckptconv.apiKey";
const PAGE_SIZE = 20;
// Browsers open at most 6 HTTP/1.1 connections per origin: follow a few jobs live, keep the rest free.
const MAX_STREAMS = 4;
const RECONNECT_MS = 2000;
const STATES = ["queued", "running", "cancelling", "succeeded", "failed", "cancelled"];
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

const $ = (id) => document.getElementById(id);

const view = {
  jobs: new Map(), // id -> job resource, for the jobs on the current page
  order: [], // ids of the current page, newest first
  cursors: [null], // cursor of each page visited; the last is the current page's
  next: null, // next_cursor of the current page
  detail: null, // id of the job shown in the detail panel
  detailJob: null, // and its resource (it may not be on the current page)
  streams: new Map(), // id -> AbortController of its event stream
  kinds: [],
  formats: [],
  reloadTimer: 0,
  loads: 0, // list requests sent
};

// --- building elements (text only) -----------------------------------------------------------

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "class") node.className = value;
    else if (name === "data") Object.assign(node.dataset, value);
    else node[name] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child)); // a string becomes a text node
  }
  return node;
}

// An output's digest, named by its hash: BLAKE3, or sha256 in a result recorded by an earlier
// version (see the API's OutputFile). A file written out of order carries a block digest instead
// (OutputFile.blake3_blocks): show it with the block size it was computed over.
const DIGESTS = ["blake3", "sha256"];
function digest(output) {
  const algorithm = DIGESTS.find((a) => output[a] || output[`${a}_blocks`]);
  if (!algorithm) return el("code", { class: "sha", textContent: "–" });
  const blocks = output[`${algorithm}_blocks`];
  const cell = el("span");
  if (output[algorithm]) {
    cell.append(
      el("code", { class: "sha", textContent: output[algorithm] }),
      el("span", { class: "muted", textContent: ` (${algorithm})` }),
    );
  } else {
    cell.append(
      el("code", { class: "sha", textContent: blocks[algorithm] }),
      el("span", { class: "muted", textContent: ` (${algorithm} block digest, ${bytes(blocks.block_size)} blocks)` }),
    );
  }
  return cell;
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${i === 0 ? v : v.toFixed(1)} ${units[i]}`;
}

function duration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.round(seconds);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

function when(iso) {
  if (!iso) return el("span", { class: "muted", textContent: "–" });
  return el("time", { dateTime: iso, title: iso, textContent: new Date(iso).toLocaleString() });
}

function notice(message, kind = "error") {
  const box = $("notice");
  box.textContent = message;
  box.className = `notice ${kind}`;
  box.hidden = !message;
}

// --- the API ----------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, problem) {
    super(problem.detail || problem.title || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function api(method, path, body) {
  const headers = { Accept: "application/json", ...authHeaders() };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    cache: "no-store",
  });
  const doc = await response.json().catch(() => ({}));
  if (!response.ok) {
    const error = new ApiError(response.status, doc);
    if (response.status === 401) {
      notice("This service needs an API key: enter it above (it is kept in this tab only).");
      keyStatus();
    }
    throw error;
  }
  return doc;
}

function problemText(problem) {
  const parts = [problem.code ? `[${problem.code}]` : "", problem.detail || problem.title || ""];
  if (problem.hint) parts.push(`(${problem.hint})`);
  return parts.filter(Boolean).join(" ");
}

function fail(error) {
  notice(error instanceof ApiError ? problemText(error.problem) : String(error));
}

// --- the API key ------------------------------------------------------------------------------

function keyStatus() {
  $("key-status").textContent = sessionStorage.getItem(KEY_STORE) ? "a key is set for this tab" : "no key set";
}

function setupKey() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("api-key").value.trim();
    $("api-key").value = "";
    if (value) sessionStorage.setItem(KEY_STORE, value);
    keyStatus();
    notice("");
    reloadAll();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    keyStatus();
    stopStreams();
    closeDetail(); // what the key could see is not shown without it
    $("jobs").tBodies[0].replaceChildren();
    reloadAll();
  });
  keyStatus();
}

// --- the job list -----------------------------------------------------------------------------

function listPath() {
  const query = new URLSearchParams({ limit: String(PAGE_SIZE) });
  if ($("filter-state").value) query.set("state", $("filter-state").value);
  if ($("filter-kind").value) query.set("kind", $("filter-kind").value);
  const cursor = view.cursors[view.cursors.length - 1];
  if (cursor) query.set("cursor", cursor);
  return `/v1/jobs?${query}`;
}

async function loadPage() {
  // Only the latest request may render: a slower answer to an earlier one (another filter, page) is dropped.
  const seq = ++view.loads;
  let page;
  try {
    page = await api("GET", listPath());
  } catch (error) {
    if (seq === view.loads) fail(error);
    return;
  }
  if (seq !== view.loads) return;
  view.jobs = new Map(page.jobs.map((job) => [job.id, job]));
  view.order = page.jobs.map((job) => job.id);
  view.next = page.next_cursor;
  const body = $("jobs").tBodies[0];
  body.replaceChildren(...page.jobs.map(jobRow));
  $("empty").hidden = page.jobs.length > 0;
  $("page-number").textContent = `page ${view.cursors.length}`;
  $("page-prev").disabled = view.cursors.length === 1;
  $("page-first").disabled = view.cursors.length === 1;
  $("page-next").disabled = !view.next;
  syncStreams();
}

function progressCell(job) {
  const p = job.progress;
  const cell = el("td", { class: "progress" });
  if (!p) {
    cell.append(el("span", { class: "muted", textContent: job.done ? "–" : "waiting" }));
    return cell;
  }
  const total = p.bytes_total || 0;
  // The engine opens its last stage, "done", with zero counters: a finished run has done it all.
  const complete = p.stage === "done" || job.state === "succeeded";
  const done = complete ? total : Math.min(p.bytes_done, total);
  const tensors = complete ? p.tensors_total : p.tensors_done;
  const bar = el("progress", { max: total > 0 ? total : 1, value: total > 0 ? done : Number(complete) });
  bar.setAttribute("aria-label", `${job.id} progress`);
  const facts = [p.stage, `${bytes(done)} / ${bytes(total)}`, `${tensors}/${p.tensors_total} tensors`];
  if (!job.done) {
    if (p.throughput_bytes_per_s) facts.push(`${bytes(p.throughput_bytes_per_s)}/s`);
    if (p.eta_seconds !== null && p.eta_seconds !== undefined) facts.push(`ETA ${duration(p.eta_seconds)}`);
  }
  cell.append(bar, el("div", { class: "facts", textContent: facts.join(" · ") }));
  return cell;
}

function labelChips(labels) {
  const entries = Object.entries(labels || {});
  if (!entries.length) return null;
  return el("div", { class: "labels" }, ...entries.map(([k, v]) => el("span", { class: "label", textContent: `${k}=${v}` })));
}

function errorLine(job) {
  if (!job.error) return null;
  return el(
    "div",
    { class: "error" },
    el("code", { class: "error-code", textContent: job.error.code }),
    " ",
    el("span", { class: "error-message", textContent: job.error.detail }),
  );
}

function jobRow(job) {
  const open = el("button", { type: "button", class: "link", textContent: job.id });
  open.addEventListener("click", () => showDetail(job.id));
  const target = job.target ? `${job.target.uri} (${job.target.format})` : "–";
  return el(
    "tr",
    { data: { job: job.id, state: job.state }, class: job.id === view.detail ? "selected" : "" },
    el("td", { class: "id" }, open, labelChips(job.labels)),
    el("td", { textContent: job.kind }),
    el("td", {}, el("span", { class: `state ${job.state}`, textContent: job.state })),
    el(
      "td",
      { class: "uris" },
      el("div", { class: "source", textContent: job.source.uri }),
      el("div", { class: "target", textContent: `→ ${target}` }),
      errorLine(job),
    ),
    progressCell(job),
    el("td", {}, when(job.created_at)),
    el("td", {}, when(job.finished_at)),
  );
}

function updated(job) {
  if (view.jobs.has(job.id)) {
    view.jobs.set(job.id, job);
    const old = document.querySelector(`tr[data-job="${CSS.escape(job.id)}"]`);
    if (old) old.replaceWith(jobRow(job));
  }
  if (view.detail === job.id) renderDetail(job);
}

function setupList() {
  for (const state of STATES) $("filter-state").append(el("option", { value: state, textContent: state }));
  const restart = () => {
    view.cursors = [null];
    loadPage();
  };
  $("filter-state").addEventListener("change", restart);
  $("filter-kind").addEventListener("change", restart);
  $("refresh").addEventListener("click", loadPage);
  $("page-first").addEventListener("click", restart);
  $("page-next").addEventListener("click", () => {
    if (!view.next) return;
    view.cursors.push(view.next);
    loadPage();
  });
  $("page-prev").addEventListener("click", () => {
    if (view.cursors.length > 1) view.cursors.pop();
    loadPage();
  });
}

// --- live updates: the job's server-sent events, read with fetch ------------------------------

function wanted() {
  const ids = [];
  const active = (id) => {
    const job = view.jobs.get(id) || (id === view.detail ? view.detailJob : null);
    return job && !job.done;
  };
  if (view.detail && active(view.detail)) ids.push(view.detail);
  for (const id of view.order) {
    if (ids.length >= MAX_STREAMS) break;
    if (!ids.includes(id) && active(id)) ids.push(id);
  }
  return ids;
}

function syncStreams() {
  const ids = wanted();
  for (const [id, controller] of view.streams) {
    if (!ids.includes(id)) {
      controller.abort();
      view.streams.delete(id);
    }
  }
  for (const id of ids) if (!view.streams.has(id)) follow(id);
  const live = view.streams.size;
  $("live").textContent = live ? `following ${live} job${live === 1 ? "" : "s"} live` : "";
}

function stopStreams() {
  for (const controller of view.streams.values()) controller.abort();
  view.streams.clear();
}

function current(id) {
  return view.jobs.get(id) || (view.detail === id ? view.detailJob : null);
}

function apply(id, type, data) {
  const job = current(id);
  if (type === "job") {
    if (view.detail === id) view.detailJob = data;
    updated(data);
    return;
  }
  if (!job) return;
  const next = { ...job };
  if (type === "progress") next.progress = data;
  else if (type === "state") {
    next.state = data.state;
    next.done = TERMINAL.has(data.state);
  } else return;
  if (view.detail === id) view.detailJob = next;
  updated(next);
}

async function follow(id) {
  const controller = new AbortController();
  view.streams.set(id, controller);
  let lastEventId = null;
  let ended = false;
  while (!controller.signal.aborted && !ended) {
    try {
      const headers = { Accept: "text/event-stream", ...authHeaders() };
      if (lastEventId) headers["Last-Event-ID"] = lastEventId;
      const response = await fetch(`/v1/jobs/${encodeURIComponent(id)}/events`, {
        headers,
        signal: controller.signal,
        cache: "no-store",
      });
      if (!response.ok) break; // 401/404: the list shows why; nothing to follow
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value.replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          const event = parseEvent(buffer.slice(0, cut));
          buffer = buffer.slice(cut + 2);
          if (!event) continue;
          if (event.id) lastEventId = event.id;
          apply(id, event.type, event.data);
        }
      }
      const job = current(id);
      ended = !job || job.done; // a stream closes after the job's final event
    } catch (error) {
      if (controller.signal.aborted) break;
    }
    if (!ended && !controller.signal.aborted) await new Promise((r) => setTimeout(r, RECONNECT_MS));
  }
  if (view.streams.get(id) === controller) view.streams.delete(id);
  if (ended) jobEnded();
}

function parseEvent(block) {
  let type = "message";
  let id = null;
  const data = [];
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") type = value;
    else if (field === "data") data.push(value);
    else if (field === "id") id = value;
  }
  if (!data.length) return null;
  try {
    return { type, id, data: JSON.parse(data.join("\n")) };
  } catch {
    return null;
  }
}

// A job ended: refresh the page once the burst settles (that also shows jobs submitted elsewhere),
// and follow the next active job.
function jobEnded() {
  clearTimeout(view.reloadTimer);
  view.reloadTimer = setTimeout(loadPage, 300);
  syncStreams();
}

// --- a job's detail ---------------------------------------------------------------------------

async function showDetail(id) {
  view.detail = id;
  try {
    view.detailJob = await api("GET", `/v1/jobs/${encodeURIComponent(id)}`);
  } catch (error) {
    fail(error);
    return;
  }
  renderDetail(view.detailJob);
  for (const row of document.querySelectorAll("#jobs tbody tr")) {
    row.classList.toggle("selected", row.dataset.job === id);
  }
  syncStreams();
}

function facts(pairs) {
  const list = el("dl", { class: "facts" });
  for (const [name, value] of pairs) {
    if (value === null || value === undefined || value === "") continue;
    list.append(el("dt", { textContent: name }), el("dd", {}, value instanceof Node ? value : String(value)));
  }
  return list;
}

function table(headings, rows) {
  return el(
    "table",
    { class: "small" },
    el("thead", {}, el("tr", {}, ...headings.map((h) => el("th", { textContent: h })))),
    el("tbody", {}, ...rows.map((cells) => el("tr", {}, ...cells.map((c) => el("td", {}, c instanceof Node ? c : String(c ?? "–")))))),
  );
}

function number(value) {
  return typeof value === "number" ? value.toPrecision(6) : String(value ?? "–");
}

function comparison(doc) {
  // A verify job's logit comparison: in the result, or in a failing verdict's problem details.
  if (!doc || doc.verdict === undefined) return null;
  const section = el(
    "div",
    { class: "comparison" },
    el("h3", { textContent: "Logit comparison" }),
    facts([
      ["verdict", doc.verdict],
      ["max |diff|", number(doc.max_abs_diff)],
      ["max rel diff", number(doc.max_rel_diff)],
      ["cosine", number(doc.cosine_similarity)],
      ["tolerance", number(doc.tolerance)],
      ["rtol", number(doc.rtol)],
    ]),
  );
  const logits = Object.entries(doc.logits || {});
  if (logits.length) {
    section.append(
      table(
        ["output", "shape", "max |diff|", "max rel diff", "cosine"],
        logits.map(([name, c]) => [
          name,
          JSON.stringify(c.shape ?? c.shape_hf ?? null),
          number(c.max_abs_diff),
          number(c.max_rel_diff),
          number(c.cosine_similarity),
        ]),
      ),
    );
  }
  return section;
}

function renderDetail(job) {
  const box = $("detail");
  box.hidden = false;
  const close = el("button", { type: "button", class: "close", textContent: "Close" });
  close.addEventListener("click", closeDetail);
  const header = el("div", { class: "detail-head" }, el("h2", { textContent: job.id }), close);
  if (!job.done) {
    const cancel = el("button", { type: "button", class: "cancel", textContent: "Cancel job" });
    cancel.disabled = job.state === "cancelling";
    cancel.addEventListener("click", () => cancelJob(job.id));
    header.append(cancel);
  }
  const p = job.progress || {};
  const result = job.result || {};
  const parts = [
    header,
    facts([
      ["state", el("span", { class: `state ${job.state}`, textContent: job.state })],
      ["kind", job.kind],
      ["source", job.source.uri + (job.source.format ? ` (${job.source.format})` : "")],
      ["target", job.target ? `${job.target.uri} (${job.target.format})` : null],
      ["labels", labelChips(job.labels)],
      ["created", when(job.created_at)],
      ["started", job.started_at ? when(job.started_at) : null],
      ["finished", job.finished_at ? when(job.finished_at) : null],
      ["attempts", job.attempts],
      ["plan totals", p.tensors_total !== undefined ? `${p.tensors_total} tensors, ${bytes(p.bytes_total)}` : null],
      ["progress", p.stage && !job.done ? `${p.stage}: ${bytes(p.bytes_done)}, ${p.tensors_done} tensors` : null],
    ]),
  ];
  if (Object.keys(job.options || {}).length) {
    parts.push(el("h3", { textContent: "Options" }), facts(Object.entries(job.options).map(([k, v]) => [k, JSON.stringify(v)])));
  }
  if (job.error) {
    parts.push(
      el(
        "div",
        { class: "problem" },
        el("h3", { textContent: "Error" }),
        facts([
          ["code", el("code", { class: "error-code", textContent: job.error.code })],
          ["message", el("span", { class: "error-message", textContent: job.error.detail })],
          ["hint", job.error.hint],
        ]),
      ),
    );
    const verdict = comparison(job.error.details);
    if (verdict) parts.push(verdict);
  }
  if (result.outputs && result.outputs.length) {
    parts.push(
      el("h3", { textContent: "Outputs" }),
      table(
        ["uri", "role", "size", "digest"],
        result.outputs.map((o) => [o.uri, o.role, bytes(o.size), digest(o)]),
      ),
    );
  }
  if (result.manifest) parts.push(facts([["manifest", result.manifest]]));
  if (result.warnings && result.warnings.length) {
    parts.push(el("h3", { textContent: "Warnings" }), el("ul", { class: "warnings" }, ...result.warnings.map((w) => el("li", { textContent: w }))));
  }
  const verdict = comparison(result) || comparison(result.simulator);
  if (verdict) parts.push(verdict);
  parts.push(el("details", {}, el("summary", { textContent: "JSON" }), el("pre", { textContent: JSON.stringify(job, null, 2) })));
  box.replaceChildren(...parts);
}

function closeDetail() {
  view.detail = null;
  view.detailJob = null;
  $("detail").hidden = true;
  $("detail").replaceChildren();
  syncStreams();
}

async function cancelJob(id) {
  try {
    const job = await api("POST", `/v1/jobs/${encodeURIComponent(id)}/cancel`);
    if (view.detail === id) view.detailJob = job;
    updated(job);
    syncStreams();
  } catch (error) {
    fail(error);
  }
}

// --- the submit form, built from /v1/kinds ----------------------------------------------------

function variants(schema) {
  const all = schema.anyOf || schema.oneOf || [schema];
  return all.filter((s) => s.type !== "null");
}

function optionInput(name, schema, required) {
  const kinds = variants(schema);
  const enumOf = kinds.find((s) => s.enum);
  const types = new Set(kinds.map((s) => s.type));
  const title = schema.description || "";
  let input;
  if (types.size === 1 && types.has("boolean")) {
    input = el("input", { type: "checkbox", checked: schema.default === true });
  } else if (enumOf) {
    input = el("select", {}, required ? null : el("option", { value: "", textContent: "default" }));
    for (const value of enumOf.enum) input.append(el("option", { value, textContent: value }));
    if (schema.default !== undefined && schema.default !== null) input.value = schema.default;
  } else {
    const numeric = types.size === 1 && (types.has("integer") || types.has("number"));
    input = el("input", { type: numeric ? "number" : "text", spellcheck: false, required });
    if (types.has("number")) input.step = "any";
    if (schema.default !== undefined && schema.default !== null) input.placeholder = String(schema.default);
    else if (schema.examples) input.placeholder = String(schema.examples[0]);
  }
  input.dataset.option = name;
  input.dataset.types = [...types].join(",");
  const label = el("label", { title }, `${name}${required ? " *" : ""} `, input);
  return label;
}

function optionValue(input, schema) {
  if (input.type === "checkbox") return input.checked === (schema.default === true) ? undefined : input.checked;
  const raw = input.value.trim();
  if (raw === "") return undefined;
  const types = input.dataset.types.split(",");
  if ((types.includes("integer") || types.includes("number")) && /^-?\d+(\.\d+)?([eE][-+]?\d+)?$/.test(raw)) {
    return Number(raw);
  }
  return raw;
}

function selectedKind() {
  return view.kinds.find((k) => k.name === $("submit-kind").value);
}

function renderKindFields() {
  const kind = selectedKind();
  if (!kind) return;
  $("kind-description").textContent = kind.description;
  $("target-fields").hidden = kind.target === "none";
  $("target-uri").required = kind.target === "required";
  const schema = kind.options_schema || {};
  const required = new Set(schema.required || []);
  const fields = Object.entries(schema.properties || {}).map(([name, prop]) => optionInput(name, prop, required.has(name)));
  $("option-fields").replaceChildren(el("legend", { textContent: "Options" }), ...fields);
  $("option-fields").hidden = fields.length === 0;
}

function requestBody(withLabels) {
  const kind = selectedKind();
  const body = { kind: kind.name, source: { uri: $("source-uri").value.trim() } };
  if ($("source-format").value) body.source.format = $("source-format").value;
  if (kind.target !== "none" && $("target-uri").value.trim()) {
    body.target = { uri: $("target-uri").value.trim(), format: $("target-format").value };
  }
  const props = (kind.options_schema || {}).properties || {};
  const options = {};
  for (const input of $("option-fields").querySelectorAll("[data-option]")) {
    const value = optionValue(input, props[input.dataset.option]);
    if (value !== undefined) options[input.dataset.option] = value;
  }
  body.options = options;
  if (withLabels) {
    const labels = {};
    for (const pair of $("labels").value.split(",")) {
      const [k, ...rest] = pair.split("=");
      if (k.trim()) labels[k.trim()] = rest.join("=").trim();
    }
    body.labels = labels;
  }
  return body;
}

function planView(plan) {
  const parts = [
    el("h3", { textContent: plan.ok ? "Dry run: ready" : "Dry run: problems found" }),
    facts([
      ["target format", plan.target_format],
      ["tensors", plan.tensors],
      ["bytes", plan.bytes !== undefined ? bytes(plan.bytes) : null],
      ["largest tensor", plan.largest_tensor_bytes !== undefined ? bytes(plan.largest_tensor_bytes) : null],
      ["peak memory (est.)", plan.estimated_peak_memory_bytes !== undefined ? bytes(plan.estimated_peak_memory_bytes) : null],
    ]),
  ];
  if (plan.shards && plan.shards.length) {
    parts.push(table(["file", "tensors", "size"], plan.shards.map((s) => [s.file, s.tensors, bytes(s.bytes)])));
  }
  if (plan.outputs && plan.outputs.length) {
    parts.push(table(["output"], plan.outputs.map((o) => [typeof o === "string" ? o : JSON.stringify(o)])));
  }
  for (const e of plan.errors || []) parts.push(el("p", { class: "error" }, el("code", { class: "error-code", textContent: e.code }), " ", e.detail));
  for (const w of plan.warnings || []) parts.push(el("p", { class: "warning", textContent: w }));
  parts.push(el("details", {}, el("summary", { textContent: "JSON" }), el("pre", { textContent: JSON.stringify(plan, null, 2) })));
  return el("div", { class: "plan" }, ...parts);
}

function problemView(error) {
  const problem = error instanceof ApiError ? error.problem : { detail: String(error) };
  return el(
    "p",
    { class: "error" },
    el("code", { class: "error-code", textContent: problem.code || "error" }),
    " ",
    el("span", { class: "error-message", textContent: problem.detail || problem.title || "" }),
    problem.hint ? el("span", { class: "muted", textContent: ` (${problem.hint})` }) : null,
  );
}

function setupSubmit() {
  $("submit-kind").addEventListener("change", renderKindFields);
  const out = $("submit-result");
  $("dry-run").addEventListener("click", async () => {
    if (!$("source-uri").reportValidity()) return;
    const body = requestBody(false);
    out.replaceChildren(el("p", { class: "muted", textContent: "planning…" }));
    try {
      out.replaceChildren(planView(await api("POST", "/v1/plans", body)));
    } catch (error) {
      out.replaceChildren(problemView(error));
    }
  });
  $("submit-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      const job = await api("POST", "/v1/jobs", requestBody(true));
      out.replaceChildren(el("p", { class: "ok", textContent: `submitted ${job.id}` }));
      view.cursors = [null];
      await loadPage();
      await showDetail(job.id);
    } catch (error) {
      out.replaceChildren(problemView(error));
    }
  });
}

async function loadCatalog() {
  try {
    const [kinds, formats] = await Promise.all([api("GET", "/v1/kinds"), api("GET", "/v1/formats")]);
    view.kinds = kinds.kinds;
    view.formats = formats.formats;
  } catch (error) {
    fail(error);
    return;
  }
  const kindFilter = $("filter-kind");
  const chosen = kindFilter.value;
  kindFilter.replaceChildren(el("option", { value: "", textContent: "any" }));
  $("submit-kind").replaceChildren();
  for (const kind of view.kinds) {
    kindFilter.append(el("option", { value: kind.name, textContent: kind.name }));
    $("submit-kind").append(el("option", { value: kind.name, textContent: kind.name }));
  }
  kindFilter.value = chosen;
  $("source-format").replaceChildren(el("option", { value: "", textContent: "detect" }));
  $("target-format").replaceChildren();
  for (const f of view.formats) {
    if (f.read) $("source-format").append(el("option", { value: f.name, textContent: f.name }));
    if (f.write) $("target-format").append(el("option", { value: f.name, textContent: f.name }));
  }
  renderKindFields();
}

function reloadAll() {
  view.cursors = [null];
  loadPage();
  if (view.detail) showDetail(view.detail);
}

setupKey();
setupList();
setupSubmit();
loadCatalog();
loadPage();
