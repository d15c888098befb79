// What both pages share: calls to kvserve's API with the key, asked for once per tab.
//
// The key lives in sessionStorage: it goes with the tab, never to disk and never to the server
// except as the Authorization header of the API's own calls.

const KEY = "kvserve.apiKey";

function withKey(headers = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...headers, authorization: `Bearer ${key}` } : headers;
}

// Shows the page's key dialog and resolves once a key is entered.
function askForKey(message) {
  const dialog = document.getElementById("key-dialog");
  const form = dialog.querySelector("form");
  const input = dialog.querySelector("input");
  dialog.querySelector(".key-message").textContent = message;
  input.value = "";
  if (!dialog.open) dialog.showModal();
  input.focus();
  return new Promise((resolve) => {
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY, input.value.trim());
      dialog.close();
      resolve();
    }, { once: true });
  });
}

// fetch(path), with the key; on a 401 the page asks for the key and tries again.
export async function api(path, init = {}) {
  let message = "This server needs an API key (kvserve --api-key).";
  for (;;) {
    const response = await fetch(path, { ...init, headers: withKey(init.headers) });
    if (response.status !== 401) return response;
    await askForKey(message);
    message = "That key was refused. Enter the server's API key.";
  }
}

// The message of an API error body (OpenAI's or Anthropic's shape), else the status line.
export async function errorText(response) {
  try {
    const body = await response.json();
    return `${response.status}: ${body.error?.message ?? JSON.stringify(body)}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// Element builder: el("div", { class: "x", dataset: { a: 1 }, style: { width: "5%" } }, "text", child).
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "dataset") Object.assign(node.dataset, value);
    else if (name === "style") Object.assign(node.style, value); // CSSOM: the pages' policy refuses inline style text
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

export function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit && value < 10 ? 1 : 0)} ${units[unit]}`;
}
