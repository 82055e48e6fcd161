// The chat box: streams a reply through /v1/chat/completions (OpenAI-shaped SSE).

import { readEvents, request, Unauthorized } from "./api.js";

export function setupChat({ model, onUnauthorized }) {
  const form = document.getElementById("chat-form");
  const input = document.getElementById("chat-input");
  const log = document.getElementById("chat-log");
  const send = document.getElementById("chat-send");
  const history = [];

  function bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    log.append(div);
    log.scrollTop = log.scrollHeight;
    return div;
  }

  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      form.requestSubmit();
    }
  });
  document.getElementById("chat-clear").addEventListener("click", () => {
    history.length = 0;
    log.replaceChildren();
  });

  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const text = input.value.trim();
    if (!text || send.disabled) return;
    input.value = "";
    history.push({ role: "user", content: text });
    bubble("user", text);
    const out = bubble("assistant", "");
    out.dataset.state = "streaming";
    const ids = [];
    let reply = "";
    send.disabled = true;
    try {
      const body = {
        model: model(),
        messages: history,
        stream: true,
        max_tokens: Number(document.getElementById("chat-max").value) || 64,
        temperature: Number(document.getElementById("chat-temp").value) || 0,
      };
      const answer = await request("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
      });
      if (!answer.ok) {
        const err = await answer.json().catch(() => ({}));
        throw new Error((err.error && err.error.message) || `HTTP ${answer.status}`);
      }
      await readEvents(answer, (_event, data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          ids.push(...(choice.token_ids || []));
          reply += (choice.delta && choice.delta.content) || "";
        }
        out.textContent = reply;
        out.dataset.tokenIds = ids.join(",");
        log.scrollTop = log.scrollHeight;
      });
      history.push({ role: "assistant", content: reply });
      out.dataset.state = "done";
    } catch (err) {
      out.dataset.state = "error";
      out.textContent = `${reply}\n[error: ${err.message}]`;
      history.pop();
      if (err instanceof Unauthorized) onUnauthorized();
    } finally {
      send.disabled = false;
      input.focus();
    }
  });
}
