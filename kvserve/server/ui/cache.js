// The live cache view: /v1/cache and /metrics, read every few seconds.
//
// Drawing stays bounded whatever the cache holds: the top chains only (a partial selection, not a
// sort of them all), one box per stream (at most --parallel), a few minutes of samples.

import { api, el, errorText, formatBytes } from "./api.js";

const REFRESH_MS = 2000;
const WINDOW_MS = 10 * 60 * 1000;
const TOP_CHAINS = 20;
const COUNTERS = {
  hit: "kvserve_prefix_cache_hit_tokens_total",
  queried: "kvserve_prefix_cache_queried_tokens_total",
  reuses: "kvserve_prefix_cache_inplace_reuse_total",
  inplace: "kvserve_prefix_cache_inplace_tokens_total",
};
const $ = (id) => document.getElementById(id);
const samples = []; // { at, hit, queried, reuses, inplace }, oldest first, WINDOW_MS of them

// The samples of a Prometheus text exposition with no label but `model_name` (every model's series
// has it), of `model` (with one model, "": its only one), by name.
function parseMetrics(text, model) {
  const values = {};
  for (const line of text.split("\n")) {
    const match = /^([a-zA-Z_:][\w:]*)(?:\{model_name="((?:[^"\\]|\\.)*)"\})? (\S+)$/.exec(line);
    if (match && (match[2] === undefined || !model || match[2] === model)) values[match[1]] = Number(match[3]);
  }
  return values;
}

// With several models, a picker of the loaded ones (the view never loads one); "" with one model.
let model = "";
async function pickModel() {
  const response = await api("/v1/models");
  if (!response.ok) return;
  const models = (await response.json()).data.filter((m) => !m.parent);
  const loaded = models.filter((m) => (m.status?.value ?? "loaded") === "loaded");
  const picker = $("model");
  picker.hidden = models.length < 2;
  if (picker.hidden) return;
  if (!loaded.some((m) => m.id === model)) {
    model = loaded[0]?.id ?? "";
    samples.length = 0;  // another model's counters
  }
  picker.replaceChildren(...loaded.map((m) => el("option", { value: m.id }, m.id)));
  picker.value = model;
}
$("model").addEventListener("change", () => {
  model = $("model").value;
  samples.length = 0;
});

// The `n` entries ranking first by `better`, best first, without sorting all of them.
function top(entries, n, better) {
  const kept = [];
  for (const entry of entries) {
    if (kept.length === n && !better(entry, kept[n - 1])) continue;
    let i = Math.min(kept.length, n - 1);
    kept[i] = entry;
    while (i > 0 && better(kept[i], kept[i - 1])) {
      [kept[i - 1], kept[i]] = [kept[i], kept[i - 1]];
      i -= 1;
    }
  }
  return kept;
}

const byHitsThenTokens = (a, b) => a.hits > b.hits || (a.hits === b.hits && a.tokens > b.tokens);

function showStore(view) {
  const held = view.held_bytes ?? 0;
  const budget = view.budget_bytes ?? 0;
  $("store-bar").style.width = budget ? `${Math.min(100, (100 * held) / budget)}%` : "0";
  const pages = view.enabled ? `${view.held_pages} pages of ${view.page_rows} rows` : "prefix cache off (--no-prefix-cache)";
  $("store-text").textContent = `${formatBytes(held)} of ${formatBytes(budget)} (--prefix-state-mb) · ${pages}`;
}

function showDisk(tiers) {
  // The server's disk tier (--prefix-disk-dir), shared by its models; hidden without one.
  const disk = tiers?.disk;
  $("disk").hidden = !disk;
  if (!disk) return;
  $("disk-bar").style.width = disk.budget_bytes ? `${Math.min(100, (100 * disk.bytes) / disk.budget_bytes)}%` : "0";
  const rate = (bytes, seconds) => (seconds > 0 ? `${formatBytes(bytes / seconds)}/s` : "–");
  const share = disk.runs ? "the pages' share of --prefix-disk-mb" : "--prefix-disk-mb";
  $("disk-text").textContent = `${formatBytes(disk.bytes)} of ${formatBytes(disk.budget_bytes)} (${share}) · `
    + `${disk.pages} pages · ${disk.hits} read back, ${disk.writes} written (${rate(disk.written_bytes ?? 0, disk.write_seconds)}) · `
    + `${disk.refused} refused · ${disk.dropped_writes} writes dropped · ${disk.evictions} evicted`
    + (disk.runs ? ` · runs (long prompts in one file): ${disk.runs.runs}, ${formatBytes(disk.runs.bytes)} of `
      + `${formatBytes(disk.runs.budget_bytes)}, ${disk.runs.hits} restored (${disk.runs.staged_hits} from memory), `
      + `${disk.runs.refused} refused` : "");
}

function showStreams(pool) {
  const cells = pool.stream_cells;
  $("streams").replaceChildren(...pool.stream_states.map((s) => el("li", { class: `stream ${s.state}`, dataset: { seq: s.seq } },
    el("span", { class: "seq" }, `#${s.seq}`), el("span", { class: "state" }, s.state),
    el("span", { class: "tokens" }, `${s.tokens} tokens`),
    el("div", { class: "meter" }, el("div", { style: { width: `${(100 * s.tokens) / cells}%` } })))));
}

function showChains(view) {
  // A page cache lists chains; a checkpoint cache (recurrent models) lists checkpoints.
  const entries = view.chains ?? (view.checkpoints ?? []).map((c) => ({ ...c, tokens: c.position, pages: c.kind }));
  const shown = top(entries, TOP_CHAINS, byHitsThenTokens);
  const longest = Math.max(1, ...shown.map((c) => c.tokens));
  const kind = view.chains ? "chains" : "checkpoints";
  $("chains-count").textContent = `${entries.length} ${kind}; the ${shown.length} with most hits (then most tokens)`;
  $("chains").replaceChildren(...shown.map((c) => el("tr", { class: "chain" },
    el("td", { class: "preview" }, c.preview),
    el("td", { class: "tokens" }, el("div", { class: "meter" }, el("div", { style: { width: `${(100 * c.tokens) / longest}%` } })),
      String(c.tokens)),
    el("td", {}, c.pages ?? `${c.pages_alive}`), el("td", { class: "hits" }, String(c.hits)),
    el("td", {}, formatBytes(c.bytes ?? 0)))));
}

// What speculation drafted and what it gained (/server_info's `speculative`): per drafter, a
// sequence's tokens per second over steps that carried its drafts against steps that carried none.
function showSpeculation(spec) {
  const on = spec.enabled;
  const undrafted = spec.undrafted_tokens_per_second;
  $("spec-text").textContent = on
    ? `--speculative ${spec.mode}, up to ${spec.draft_max} tokens a draft · a sequence's steps without a draft: `
      + `${undrafted === null ? "none timed yet" : `${undrafted} tok/s`}`
    : spec.mode === "off" ? "off (--speculative off; auto drafts where it measures a gain)"
      : `off for this model: its KV rows cannot be cut back (--speculative ${spec.mode})`;
  $("spec-table").hidden = !on;
  const rate = (x) => (x === null ? "–" : `${x} tok/s`);
  const gained = (x) => (x === null || undrafted === null ? "–" : `${x >= undrafted ? "+" : "−"}${Math.abs(x - undrafted).toFixed(2)} tok/s`);
  $("drafters").replaceChildren(...Object.entries(spec.by_drafter ?? {}).map(([name, d]) => {
    const dropped = spec.dropped_drafts?.[name] ?? {};
    const share = d.drafted ? ` (${((100 * d.accepted) / d.drafted).toFixed(0)}%)` : "";
    return el("tr", { class: "drafter", dataset: { drafter: name } },
      el("td", {}, name), el("td", { class: "drafted" }, String(d.drafted)),
      el("td", { class: "accepted" }, `${d.accepted}${share}`), el("td", { class: "speed" }, rate(d.tokens_per_second)),
      el("td", { class: "gained" }, gained(d.tokens_per_second)),
      el("td", { class: "dropped" }, `${dropped.unlikely ?? 0} · ${dropped.priced ?? 0} · ${dropped.measured ?? 0}`));
  }));
  const prices = Object.entries(spec.ubatch_seconds ?? {}).map(
    ([n, seconds]) => `${n}: ${Math.round(1000 * seconds)} ms (${spec.ubatch_samples?.[n] ?? 0})`);
  $("spec-prices").textContent = on && prices.length
    ? `step prices by ubatch tokens, with the served steps behind each: ${prices.join(" · ")}` : "";
}

function remember(metrics) {
  const now = Date.now();
  const sample = { at: now };
  for (const [key, name] of Object.entries(COUNTERS)) sample[key] = metrics[name] ?? 0;
  samples.push(sample);
  while (samples.length > 2 && samples[0].at < now - WINDOW_MS) samples.shift();
}

function showRates() {
  const first = samples[0];
  const last = samples[samples.length - 1];
  const share = (hit, queried) => (queried > 0 ? `${((100 * hit) / queried).toFixed(1)}%` : "none");
  const queried = last.queried - first.queried;
  $("rate-text").textContent = `last ${((last.at - first.at) / 60000).toFixed(1)} min: hit rate `
    + `${share(last.hit - first.hit, queried)} of ${queried} prompt tokens · ${last.reuses - first.reuses} in-place reuses`;
  $("total-text").textContent = `since start: ${last.hit} of ${last.queried} prompt tokens from the cache `
    + `(${share(last.hit, last.queried)}) · ${last.reuses} in-place reuses (${last.inplace} tokens kept in place)`;
  // One bar per refresh that saw prompts, placed in time across the window: the share of their tokens the cache held.
  const x = (at) => (300 * (at - (last.at - WINDOW_MS))) / WINDOW_MS;
  const bars = [];
  for (let i = 1; i < samples.length; i += 1) {
    const asked = samples[i].queried - samples[i - 1].queried;
    if (asked <= 0) continue;
    const height = (60 * (samples[i].hit - samples[i - 1].hit)) / asked;
    const left = x(samples[i - 1].at);
    const bar = document.createElementNS("http://www.w3.org/2000/svg", "rect");
    const place = { x: left, y: 60 - height, width: Math.max(1, x(samples[i].at) - left), height };
    for (const [name, value] of Object.entries(place)) bar.setAttribute(name, value);
    bars.push(bar);
  }
  $("hit-chart").replaceChildren(...bars);
}

async function refresh() {
  try {
    const asked = performance.now();
    await pickModel();
    if (!$("model").hidden && !model) throw new Error("no model is loaded");
    const query = model ? `?model=${encodeURIComponent(model)}` : "";
    const [cache, metrics, server] = await Promise.all([api(`/v1/cache${query}`), api("/metrics"), api(`/server_info${query}`)]);
    for (const response of [cache, metrics, server]) if (!response.ok) throw new Error(await errorText(response));
    const view = await cache.json();
    const state = view.status?.value ?? "loaded";
    if (state !== "loaded") throw new Error(`model ${model} is ${state}`);  // unloaded since it was picked
    const text = await metrics.text();
    const info = await server.json();
    const read = performance.now();
    remember(parseMetrics(text, model));
    showStore(view);
    showDisk(view.tiers);
    showStreams(view.pool);
    showChains(view);
    showRates();
    if (info.speculative) showSpeculation(info.speculative);
    const drawn = performance.now();
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}: read in ${Math.round(read - asked)} ms, `
      + `drawn in ${Math.round(drawn - read)} ms`;
    document.body.dataset.refreshes = Number(document.body.dataset.refreshes || 0) + 1;
  } catch (error) {
    $("updated").textContent = `not updated: ${error.message}`;
  }
  setTimeout(refresh, REFRESH_MS);
}

refresh();
