// The Library page (frontends/library.py): the live model, swaps, recipes, the HF cache, and
// live figures from /metrics. Plain JS, no dependencies, no external assets.
"use strict";

const POLL_MS = 2000;
const SWAP_POLL_MS = 500;
const KEY_STORE = "metrale.key";
const $ = (id) => document.getElementById(id);
let lastScrape = null;   // {t, tokens, buckets} of the previous /metrics read
let state = "serving";
let swapping = false;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, options) {
  const opts = Object.assign({}, options || {});
  opts.headers = headers(opts.headers);
  const resp = await fetch(path, opts);
  if (resp.status === 401) $("key-form").hidden = false;
  const type = resp.headers.get("content-type") || "";
  const data = type.includes("json") ? await resp.json() : await resp.text();
  return { status: resp.status, data: data };
}

function text(el, value) { el.textContent = value == null || value === "" ? "–" : String(value); }

function message(msg, isError) {
  const el = $("message");
  el.textContent = msg || "";
  el.className = "note" + (isError ? " error" : "");
}

function errorText(data) {
  if (data && data.error && data.error.message) return data.error.message;
  if (data && data.error) return String(data.error);
  return typeof data === "string" ? data : JSON.stringify(data);
}

function bytes(n) {
  if (!n) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}

// ---- the Library's data ---------------------------------------------------------------------

function renderLive(lib) {
  const live = lib.live || {};
  text($("live-model"), live.model || (lib.swap.state === "empty" ? "no model loaded" : ""));
  text($("live-recipe"), live.recipe);
  text($("live-type"), live.model_type);
  text($("live-device"), live.device);
  text($("live-context"), live.max_seq_len ? live.max_seq_len + " tokens" : "");
  const swap = lib.swap;
  state = swap.state;
  const badge = $("swap-state");
  badge.textContent = swap.state;
  badge.className = "state " + swap.state;
  $("swap-progress").textContent = swap.target
    ? "→ " + swap.target + " (" + swap.elapsed_s.toFixed(1) + " s" +
      (swap.state === "draining" ? ", " + swap.in_flight + " in flight" : "") + ")"
    : "";
  const last = swap.last;
  const el = $("last-swap");
  if (!last) { el.textContent = ""; return; }
  el.className = "note" + (last.ok ? "" : " error");
  el.textContent = last.ok
    ? "last swap: " + last.from + " → " + last.target + " in " + last.seconds.toFixed(2) + " s"
    : "last swap to " + last.target + " failed: " + last.error +
      (last.restored ? " (the previous model was restored)" : "");
}

function loadButton(body, liveNow) {
  const b = document.createElement("button");
  b.textContent = liveNow ? "live" : "Load";
  b.disabled = liveNow || state === "draining" || state === "loading" || swapping;
  b.addEventListener("click", () => swapTo(body));
  return b;
}

function cell(row, value, cls) {
  const td = row.insertCell();
  td.textContent = value == null ? "" : String(value);
  if (cls) td.className = cls;
  return td;
}

function renderRecipes(lib) {
  const body = $("recipes").tBodies[0];
  body.replaceChildren();
  const live = lib.live || {};
  for (const r of lib.recipes.recipes) {
    const row = body.insertRow();
    row.dataset.recipe = r.name;
    const isLive = live.recipe === r.name;
    if (isLive) row.className = "live-row";
    cell(row, r.name);
    cell(row, r.family);
    cell(row, r.format);
    cell(row, r.checkpoint);
    cell(row, r.description, "desc");
    row.insertCell().appendChild(loadButton({ recipe: r.name }, isLive));
  }
  $("recipe-errors").textContent = lib.recipes.errors.length
    ? "refused recipes: " + lib.recipes.errors.join("; ") : "";
}

function renderHfCache(lib) {
  $("hf-path").textContent = lib.hf_cache.path;
  const body = $("hf-models").tBodies[0];
  body.replaceChildren();
  const live = lib.live || {};
  if (!lib.hf_cache.models.length) {
    const row = body.insertRow();
    const td = cell(row, "no models in the HF cache", "desc");
    td.colSpan = 3;
  }
  for (const m of lib.hf_cache.models) {
    const row = body.insertRow();
    row.dataset.model = m.id;
    cell(row, m.id);
    cell(row, bytes(m.size_bytes));
    row.insertCell().appendChild(loadButton({ model: m.id }, live.checkpoint === m.id));
  }
}

function renderMemory(mem) {
  const used = mem.device_used_bytes != null ? mem.device_used_bytes : mem.rss_bytes;
  text($("fig-mem"), bytes(used) + (mem.device_used_bytes != null ? " GPU" : " RSS"));
}

async function refreshLibrary() {
  try {
    const r = await api("/v1/library");
    if (r.status !== 200) { message("GET /v1/library: " + r.status + " " + errorText(r.data), true); return null; }
    renderLive(r.data);
    renderRecipes(r.data);
    renderHfCache(r.data);
    renderMemory(r.data.memory);
    return r.data;
  } catch (e) {
    message("the server does not answer (" + e.message + ")", true);
    return null;
  }
}

// ---- live figures from /metrics (Prometheus text) --------------------------------------------

function parseMetrics(body) {
  const out = [];
  for (const line of body.split("\n")) {
    if (!line || line[0] === "#") continue;
    const m = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    if (m[3]) for (const pair of m[3].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
    out.push({ name: m[1], labels: labels, value: parseFloat(m[4]) });
  }
  return out;
}

function sum(samples, name) {
  return samples.filter((s) => s.name === name).reduce((a, s) => a + s.value, 0);
}

function ttftBuckets(samples) {
  const buckets = {};
  for (const s of samples) {
    if (s.name !== "metrale_time_to_first_token_seconds_bucket") continue;
    buckets[s.labels.le] = (buckets[s.labels.le] || 0) + s.value;
  }
  return buckets;
}

// the median from cumulative bucket counts, interpolated inside its bucket
function histogramP50(buckets) {
  const bounds = Object.keys(buckets).map((le) => [le === "+Inf" ? Infinity : parseFloat(le), buckets[le]])
    .sort((a, b) => a[0] - b[0]);
  const total = bounds.length ? bounds[bounds.length - 1][1] : 0;
  if (!total) return null;
  let prevBound = 0, prevCount = 0;
  for (const [bound, count] of bounds) {
    if (count >= total / 2) {
      if (!isFinite(bound)) return prevBound;
      const inBucket = count - prevCount;
      return prevBound + (bound - prevBound) * (inBucket ? (total / 2 - prevCount) / inBucket : 0);
    }
    prevBound = bound; prevCount = count;
  }
  return null;
}

function diffBuckets(now, before) {
  const out = {};
  for (const le of Object.keys(now)) out[le] = now[le] - ((before && before[le]) || 0);
  return out;
}

async function refreshMetrics() {
  if (state !== "serving") return;
  let r;
  try { r = await api("/metrics"); } catch (e) { return; }
  if (r.status !== 200 || typeof r.data !== "string") return;
  const samples = parseMetrics(r.data);
  const now = { t: performance.now(), tokens: sum(samples, "metrale_generation_tokens_total"),
                buckets: ttftBuckets(samples) };
  text($("fig-active"), sum(samples, "metrale_requests_active"));
  text($("fig-kv"), (100 * sum(samples, "metrale_kv_cache_usage_ratio")).toFixed(1) + " %");
  if (lastScrape && now.tokens >= lastScrape.tokens) {
    const dt = (now.t - lastScrape.t) / 1000;
    text($("fig-toks"), dt > 0 ? ((now.tokens - lastScrape.tokens) / dt).toFixed(1) : "–");
  }
  const recent = histogramP50(diffBuckets(now.buckets, lastScrape && lastScrape.buckets));
  const p50 = recent != null ? recent : histogramP50(now.buckets);
  text($("fig-ttft"), p50 == null ? "–" : (1000 * p50).toFixed(1) + " ms");
  lastScrape = now;
}

// ---- the swap action ----------------------------------------------------------------------------

async function swapTo(body) {
  const what = body.recipe || body.model;
  swapping = true;
  message("swapping to " + what + " …");
  try {
    const r = await api("/v1/models/load", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(Object.assign({ wait: false }, body)) });
    if (r.status !== 202 && r.status !== 200) {
      message("the swap to " + what + " was refused (" + r.status + "): " + errorText(r.data), true);
      return;
    }
    await followSwap(r.data.swap_id, what);
  } catch (e) {
    message("the swap request failed: " + e.message, true);
  } finally {
    swapping = false;
    lastScrape = null;
    await refreshLibrary();
  }
}

async function followSwap(swapId, what) {
  for (;;) {
    await new Promise((done) => setTimeout(done, SWAP_POLL_MS));
    const lib = await refreshLibrary();
    if (!lib) continue;
    const last = lib.swap.last;
    if (lib.swap.state !== "draining" && lib.swap.state !== "loading" && last && last.swap_id === swapId) {
      if (last.ok) message("serving " + (lib.live ? lib.live.model : what) + " (loaded in " + last.seconds.toFixed(2) + " s)");
      else message("loading " + what + " failed: " + last.error, true);
      return;
    }
  }
}

// ---- start ---------------------------------------------------------------------------------

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("key").value.trim());
  $("key-form").hidden = true;
  refreshLibrary().then(refreshMetrics);
});

async function tick() {
  if (!swapping) await refreshLibrary();
  await refreshMetrics();
}

tick();
setInterval(tick, POLL_MS);
