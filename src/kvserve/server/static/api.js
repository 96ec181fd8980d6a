// Talking to the server: the conversation API, /v1/models and streamed chat completions.
//
// Every request carries the browser id (X-KVServe-Client, used to scope conversations when the
// server runs without auth) and, when the user entered one, the API key as a Bearer token.

const STORAGE = { client: "kvserve.clientId", apiKey: "kvserve.apiKey", settings: "kvserve.settings" };

export const DEFAULT_SETTINGS = { reasoning: "", system: "", temperature: 0.7, top_p: 0.95, max_tokens: 512, model: "", theme: "" };

export function clientId() {
  let id = localStorage.getItem(STORAGE.client);
  if (!id || !/^[A-Za-z0-9_-]{8,64}$/.test(id)) {
    const bytes = crypto.getRandomValues(new Uint8Array(16));
    id = "web-" + Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
    localStorage.setItem(STORAGE.client, id);
  }
  return id;
}

export const apiKey = {
  get: () => localStorage.getItem(STORAGE.apiKey) || "",
  set: (v) => (v ? localStorage.setItem(STORAGE.apiKey, v) : localStorage.removeItem(STORAGE.apiKey)),
};

export function loadSettings() {
  try {
    return { ...DEFAULT_SETTINGS, ...JSON.parse(localStorage.getItem(STORAGE.settings) || "{}") };
  } catch {
    return { ...DEFAULT_SETTINGS };
  }
}

export function saveSettings(settings) {
  localStorage.setItem(STORAGE.settings, JSON.stringify(settings));
}

export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

function headers(extra = {}) {
  const h = { "X-KVServe-Client": clientId(), ...extra };
  const key = apiKey.get();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorFrom(resp) {
  let body = null;
  let message = `${resp.status} ${resp.statusText}`;
  try {
    body = await resp.json();
    if (body?.error?.message) message = body.error.message;
    else if (typeof body?.detail === "string") message = body.detail;
  } catch { /* not JSON */ }
  if (resp.status === 401) message += " Enter an API key in Settings.";
  return new ApiError(resp.status, message, body);
}

export async function api(method, path, body) {
  const init = { method, headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const resp = await fetch(path, init);
  if (!resp.ok) throw await errorFrom(resp);
  return resp.json();
}

export const conversations = {
  list: () => api("GET", "/v1/kvserve/conversations").then((r) => r.data),
  create: (body) => api("POST", "/v1/kvserve/conversations", body),
  get: (id) => api("GET", `/v1/kvserve/conversations/${encodeURIComponent(id)}`),
  update: (id, body) => api("PATCH", `/v1/kvserve/conversations/${encodeURIComponent(id)}`, body),
  remove: (id) => api("DELETE", `/v1/kvserve/conversations/${encodeURIComponent(id)}`),
  putMessages: (id, messages, start) =>
    api("POST", `/v1/kvserve/conversations/${encodeURIComponent(id)}/messages`, { messages, start }),
};

export async function listModels() {
  const r = await api("GET", "/v1/models");
  return (r.data || []).filter((m) => m.kvserve_kind !== "embedding").map((m) => m.id);
}

// Stream one chat completion. Calls onDelta(text) for each piece of content (onReasoning(all) for
// each piece of delta.reasoning_content) and returns {content, reasoning, finishReason, trace, usage, toolCalls:
// [{id, name, arguments}]}. Aborting `signal` closes the connection, which makes
// the server abort the request and free its KV blocks.
export async function streamChat(request, { signal, onDelta, onReasoning }) {
  const body = { ...request, stream: true, stream_options: { include_usage: true }, kvserve_trace: true };
  return streamSSE("/v1/chat/completions", body, { signal, onDelta, onReasoning });
}

// POST `body` to `path` and read the chat-completion SSE stream it answers with (the chat
// endpoint, or an arena battle's side, which the server runs through the same handler).
export async function streamSSE(path, body, { signal, onDelta, onReasoning }) {
  const resp = await fetch(path, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    body: JSON.stringify(body),
    signal,
  });
  if (!resp.ok) throw await errorFrom(resp);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  const result = { content: "", reasoning: "", finishReason: null, trace: null, usage: null, toolCalls: [] };
  let buffer = "";
  const handle = (data) => {
    if (data === "[DONE]") return true;
    let chunk;
    try { chunk = JSON.parse(data); } catch { return false; }
    if (chunk.error) throw new ApiError(500, chunk.error.message || "The server reported an error.", chunk);
    if (chunk.kvserve_trace) result.trace = chunk.kvserve_trace;
    if (chunk.kvserve_cache) result.cache = chunk.kvserve_cache;
    if (chunk.model) result.model = chunk.model;
    if (chunk.usage) result.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      if (choice.index !== 0) continue;
      const thought = choice.delta?.reasoning_content;
      if (thought) {
        result.reasoning += thought;
        onReasoning?.(result.reasoning);
      }
      const piece = choice.delta?.content;
      if (piece) {
        result.content += piece;
        onDelta(piece, result.content);
      }
      for (const d of choice.delta?.tool_calls || []) {     // id and name first, arguments after
        const call = (result.toolCalls[d.index] ||= { id: "", name: "", arguments: "" });
        if (d.id) call.id = d.id;
        if (d.function?.name) call.name = d.function.name;
        if (d.function?.arguments) call.arguments += d.function.arguments;
      }
      if (choice.finish_reason) result.finishReason = choice.finish_reason;
    }
    return false;
  };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data && handle(data)) return result;
    }
  }
  return result;
}
