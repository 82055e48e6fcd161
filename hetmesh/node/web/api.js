// Talking to the node: the API key (kept per tab) and server-sent events read with fetch().
// EventSource cannot send an Authorization header, and the key must never go in a URL.

const KEY = "hetmesh.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export function headers(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
}

export class Unauthorized extends Error {}

export async function request(path, options = {}) {
  const reply = await fetch(path, { ...options, headers: headers(options.headers || {}) });
  if (reply.status === 401) throw new Unauthorized("the API key was refused");
  return reply;
}

// Split a text/event-stream body into {event, data} records and hand each to onEvent.
export async function readEvents(reply, onEvent) {
  const reader = reply.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(event, data.join("\n"));
    }
  }
}
