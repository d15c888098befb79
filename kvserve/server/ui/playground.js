// The playground: a chat against /v1/chat/completions, streamed.
//
// Conversations live in localStorage (nothing is stored on the server). Each answer shows what the
// API's usage says (prompt and cached tokens) and what this page timed: time to the first token
// and tokens per second after it.

import { api, el, errorText } from "./api.js";

const STORE = "kvserve.conversations";
const SETTINGS = ["temperature", "top_p", "max_tokens", "seed", "tools"];
const $ = (id) => document.getElementById(id);

let conversations = JSON.parse(localStorage.getItem(STORE) || "[]");
let current = null; // the open conversation
let model = "any";
let running = null; // the AbortController of the answer being streamed

function save() {
  localStorage.setItem(STORE, JSON.stringify(conversations));
}

function newConversation() {
  const conversation = { id: crypto.randomUUID(), title: "New chat", system: $("system").value, messages: [] };
  conversations.unshift(conversation);
  open(conversation);
}

function open(conversation) {
  current = conversation;
  $("system").value = conversation.system;
  $("messages").replaceChildren(...conversation.messages.map(messageView));
  listConversations();
}

function listConversations() {
  $("conversation-list").replaceChildren(...conversations.map((c) => el("li",
    { class: c === current ? "current" : "" },
    el("a", { href: "#", onclick: (e) => { e.preventDefault(); open(c); } }, c.title),
    el("button", { type: "button", title: "delete", "aria-label": "delete", onclick: () => remove(c) }, "×"),
  )));
}

function remove(conversation) {
  conversations = conversations.filter((c) => c !== conversation);
  save();
  if (conversation === current) conversations.length ? open(conversations[0]) : newConversation();
  else listConversations();
}

// --- one message on screen -----------------------------------------------------------------------

function messageView(message) {
  const view = el("li", { class: `message ${message.role}` });
  view.append(el("div", { class: "role" }, message.role));
  if (message.role === "assistant") {
    view.append(el("details", { class: "reasoning", hidden: "" }, el("summary", {}, "reasoning"), el("div")));
    view.append(el("div", { class: "content" }), el("div", { class: "tool-calls" }), el("div", { class: "stats" }));
  } else {
    view.append(el("div", { class: "content" }, message.content));
  }
  if (message.role === "assistant") showAnswer(view, message);
  return view;
}

function showAnswer(view, message) {
  view.querySelector(".content").textContent = message.content;
  const reasoning = view.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  reasoning.querySelector("div").textContent = message.reasoning || "";
  view.querySelector(".tool-calls").replaceChildren(...(message.tool_calls || []).map((call) =>
    el("div", { class: "tool-call" }, el("span", { class: "name" }, call.function.name),
      el("code", {}, `(${call.function.arguments})`))));
  const stats = view.querySelector(".stats");
  stats.replaceChildren(...Object.entries(message.stats || {}).map(([name, text]) =>
    el("span", { dataset: { stat: name } }, text)));
  if (message.error) stats.append(el("span", { class: "error" }, message.error));
}

function statsOf(usage, timing) {
  const stats = {};
  if (usage) {
    stats.prompt = `${usage.prompt_tokens} prompt tokens`;
    stats.cached = `${usage.prompt_tokens_details?.cached_tokens ?? 0} cached`;
    stats.completion = `${usage.completion_tokens} generated`;
  }
  if (timing.first !== null) {
    stats.ttft = `TTFT ${Math.round(timing.first - timing.sent)} ms`;
    const tokens = (usage?.completion_tokens ?? 0) - 1; // those that came after the first
    const seconds = (timing.last - timing.first) / 1000;
    if (tokens > 0 && seconds > 0) stats.speed = `${(tokens / seconds).toFixed(1)} tok/s`;
  }
  return stats;
}

// --- sending and streaming -----------------------------------------------------------------------

function requestBody(history) {
  const system = $("system").value.trim();
  const body = {
    model, stream: true, stream_options: { include_usage: true },
    messages: [...(system ? [{ role: "system", content: system }] : []),
      ...history.map(({ role, content, tool_calls }) => (tool_calls ? { role, content, tool_calls } : { role, content }))],
    temperature: Number($("temperature").value), top_p: Number($("top_p").value),
    max_tokens: Number($("max_tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("tools").value.trim()) body.tools = JSON.parse($("tools").value);
  return body;
}

// Each `data:` payload of an SSE response, parsed, as it arrives; stops at [DONE].
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        yield JSON.parse(line.slice(6));
      }
    }
  }
}

function addDelta(message, delta) {
  if (delta.content) message.content += delta.content;
  if (delta.reasoning_content) message.reasoning = (message.reasoning || "") + delta.reasoning_content;
  for (const part of delta.tool_calls || []) {
    message.tool_calls ??= [];
    const call = (message.tool_calls[part.index] ??= { id: part.id, type: "function", function: { name: "", arguments: "" } });
    if (part.id) call.id = part.id;
    if (part.function?.name) call.function.name += part.function.name;
    if (part.function?.arguments) call.function.arguments += part.function.arguments;
  }
}

async function send(text) {
  const conversation = current;
  conversation.system = $("system").value;
  const user = { role: "user", content: text };
  conversation.messages.push(user);
  if (conversation.title === "New chat") conversation.title = text.slice(0, 40);
  const answer = { role: "assistant", content: "", stats: {} };
  let body;
  try {
    body = requestBody(conversation.messages);
  } catch (error) {
    conversation.messages.pop();
    alert(`tools: ${error.message}`);
    return;
  }
  conversation.messages.push(answer);
  save();
  listConversations();
  const view = messageView(answer);
  $("messages").append(messageView(user), view);
  view.dataset.streaming = "";

  running = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const timing = { sent: performance.now(), first: null, last: null };
  let usage = null;
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body), signal: running.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const { delta } = choice;
        if (delta.content || delta.reasoning_content || delta.tool_calls) {
          timing.last = performance.now();
          timing.first ??= timing.last;
        }
        addDelta(answer, delta);
      }
      answer.stats = statsOf(usage, timing);
      showAnswer(view, answer);
    }
  } catch (error) {
    answer.error = error.name === "AbortError" ? "stopped" : error.message;
  } finally {
    running = null;
    $("send").disabled = false;
    $("stop").disabled = true;
    answer.stats = statsOf(usage, timing);
    showAnswer(view, answer);
    delete view.dataset.streaming;
    view.dataset.done = "";
    save();
  }
}

// --- wiring ---------------------------------------------------------------------------------------

function restoreSettings() {
  const saved = JSON.parse(localStorage.getItem("kvserve.settings") || "{}");
  for (const name of SETTINGS) {
    if (saved[name] !== undefined) $(name).value = saved[name];
    $(name).addEventListener("change", () => {
      localStorage.setItem("kvserve.settings", JSON.stringify(Object.fromEntries(SETTINGS.map((n) => [n, $(n).value]))));
    });
  }
}

// The models that chat (every model of /v1/models but embedding ones and LoRA adapters' entries), the
// one last picked first; a model that is not loaded loads on the first message sent to it.
async function showModel() {
  const response = await api("/v1/models");
  if (!response.ok) {
    $("model").replaceChildren(el("option", {}, await errorText(response)));
    return;
  }
  const chat = (await response.json()).data.filter((m) => !m.parent && m.kind !== "embedding");
  const label = (m) => (m.status?.value && m.status.value !== "loaded" ? `${m.id} (${m.status.value})` : m.id);
  $("model").replaceChildren(...chat.map((m) => el("option", { value: m.id }, label(m))));
  const saved = localStorage.getItem("kvserve.model");
  model = chat.some((m) => m.id === saved) ? saved : chat[0]?.id ?? "any";
  $("model").value = model;
}

$("model").addEventListener("change", () => {
  model = $("model").value;
  localStorage.setItem("kvserve.model", model);
});

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || running) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => running?.abort());
$("new-chat").addEventListener("click", newConversation);
$("system").addEventListener("change", () => {
  current.system = $("system").value;
  save();
});

restoreSettings();
conversations.length ? open(conversations[0]) : newConversation();
showModel();
