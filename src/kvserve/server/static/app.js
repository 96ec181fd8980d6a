// The chat page: sidebar of saved conversations, streaming chat, settings and the inspector.
//
// State lives in one object; the server is the source of truth for conversations (SQLite via
// /v1/kvserve/conversations) and the URL hash names the open one so a reload reopens it.
// Assistant text is only ever rendered through renderMarkdown (escape first), user text
// through textContent.

import { ApiError, conversations, loadSettings, saveSettings, streamChat } from "./api.js";
import { initArena } from "./arena.js";
import { renderInspector } from "./inspector.js";
import { renderMarkdown } from "./markdown.js";
import { loadModels, onSettingsClosed, openSettings } from "./settings.js";
import { apiMessage, openToolsDialog, requestTools, settingsWithTools, toolCallsBlock, toolConfig, toolResultBody,
  toolResultForm } from "./tools.js";
import { $, button, copyText, showError } from "./ui.js";

const state = { list: [], current: null, generating: null, settings: loadSettings(), models: [], tools: toolConfig(null) };

const titleFrom = (text) => {
  const line = text.trim().split("\n")[0];
  return line.length > 48 ? line.slice(0, 47) + "…" : line || "New chat";
};

function applyTheme() {
  if (state.settings.theme) document.documentElement.dataset.theme = state.settings.theme;
  else delete document.documentElement.dataset.theme;
}

function setDrawer(open) {
  $("app").classList.toggle("drawer-open", open);
  $("scrim").hidden = !open;
  $("toggle-sidebar").setAttribute("aria-expanded", String(open));
}

// ---- sidebar ----------------------------------------------------------------------------

function renderList() {
  const ul = $("conversation-list");
  ul.replaceChildren();
  for (const conv of state.list) {
    const li = document.createElement("li");
    li.className = "conv-item";
    li.dataset.id = conv.id;
    const open = button(conv.title, "conv-open", () => openConversation(conv.id));
    if (state.current?.id === conv.id) open.setAttribute("aria-current", "page");
    const rename = button("✎", "btn-icon conv-action", () => startRename(li, conv), { "aria-label": `Rename ${conv.title}` });
    const del = button("✕", "btn-icon conv-action", () => confirmDelete(conv), { "aria-label": `Delete ${conv.title}` });
    li.append(open, rename, del);
    ul.append(li);
  }
}

function startRename(li, conv) {
  const input = Object.assign(document.createElement("input"), { value: conv.title, className: "conv-rename" });
  input.setAttribute("aria-label", "New title");
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    if (save && title && title !== conv.title) {
      try {
        const updated = await conversations.update(conv.id, { title });
        conv.title = updated.title;
        if (state.current?.id === conv.id) { state.current.title = updated.title; $("chat-title").textContent = updated.title; }
      } catch (e) { showError(e.message); }
    }
    renderList();
    document.querySelector(`.conv-item[data-id="${conv.id}"] .conv-open`)?.focus();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { e.preventDefault(); finish(true); }
    if (e.key === "Escape") { e.preventDefault(); finish(false); }
  });
  input.addEventListener("blur", () => finish(true));
  li.replaceChildren(input);
  input.focus();
  input.select();
}

function confirmDelete(conv) {
  const dialog = $("confirm-dialog");
  $("confirm-text").textContent = `Delete “${conv.title}”? This cannot be undone.`;
  dialog.returnValue = "";
  dialog.onclose = async () => {
    if (dialog.returnValue !== "ok") return;
    try {
      await conversations.remove(conv.id);
      state.list = state.list.filter((c) => c.id !== conv.id);
      if (state.current?.id === conv.id) newChat();
      else renderList();
    } catch (e) { showError(e.message); }
  };
  dialog.showModal();
}

async function refreshList() {
  state.list = await conversations.list();
  renderList();
}

// ---- messages ---------------------------------------------------------------------------

// The model's reasoning (<think> block, delta.reasoning_content), collapsed above the answer.
function reasoningBlock(text) {
  const details = document.createElement("details");
  details.className = "reasoning";
  details.hidden = !text;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const pre = document.createElement("div");
  pre.className = "reasoning-body";
  pre.textContent = text;
  details.append(summary, pre);
  return details;
}

// A blocked question (input moderation: 400 content_policy_violation) or a cut answer (output
// moderation: finish_reason "content_filter") is said plainly under the message.
function moderationNote(meta) {
  if (meta?.blocked) return `Blocked by moderation: ${meta.error}`;
  if (meta?.finish_reason === "content_filter") return "Cut by moderation: the rest of this answer was withheld.";
  return "";
}

function renderMessage(msg, index) {
  const node = document.createElement("article");
  node.className = `msg ${msg.role}`;
  node.dataset.index = String(index);
  if (msg.role === "assistant") node.append(reasoningBlock(msg.meta?.reasoning || msg.reasoning || ""));
  const body = document.createElement("div");
  body.className = "msg-body";
  if (msg.role === "assistant") body.innerHTML = renderMarkdown(msg.content);
  else if (msg.role === "tool") body.append(toolResultBody(msg));
  else body.textContent = msg.content;
  body.hidden = msg.role === "assistant" && !msg.content && !!msg.meta?.tool_calls;
  node.append(body);
  const calls = msg.role === "assistant" ? msg.meta?.tool_calls : null;
  if (calls?.length) {
    node.append(toolCallsBlock(calls));
    if (index === state.current.messages.length - 1) node.append(toolResultForm(calls, sendToolResults));
  }
  const note = moderationNote(msg.meta);
  if (note) node.append(Object.assign(document.createElement("p"), { className: "moderation-note", textContent: note }));
  if (msg.role === "assistant") {
    for (const pre of body.querySelectorAll("pre")) {
      pre.append(button("Copy", "code-copy", (e) => copyText(pre.querySelector("code").textContent, e.target)));
    }
  }
  const actions = document.createElement("div");
  actions.className = "msg-actions";
  if (msg.meta?.stopped) actions.append(Object.assign(document.createElement("span"), { className: "badge", textContent: "stopped" }));
  if (msg.meta?.cache === "semantic") {
    actions.append(Object.assign(document.createElement("span"), { className: "badge cached", textContent: "cached",
      title: `Answered from the semantic cache${msg.trace?.semantic_cache ? `: matched "${msg.trace.semantic_cache.matched_query}"` +
        (msg.trace.semantic_cache.verification ? ` (${msg.trace.semantic_cache.verification.result} by the model)` : "") : ""}` }));
  }
  if (msg.meta?.routed) actions.append(Object.assign(document.createElement("span"), { className: "badge", textContent: `routed to ${msg.meta.routed}` }));
  const copyable = msg.content || (calls?.length ? JSON.stringify(calls, null, 2) : "");
  actions.append(button("Copy", "btn-small", (e) => copyText(copyable, e.target), { "aria-label": "Copy message" }));
  if (msg.role === "assistant") {
    actions.append(button("Inspect", "btn-small inspect", (e) => openInspector(msg, e.target), { "aria-label": "Inspect this answer" }));
    if (index === state.current.messages.length - 1) {
      actions.append(button("↻ Regenerate", "btn-small regenerate", () => generate(index, { fresh: true }), { "aria-label": "Regenerate answer" }));
    }
  }
  node.append(actions);
  return node;
}

function renderMessages() {
  const box = $("messages");
  const msgs = state.current?.messages || [];
  box.replaceChildren();
  if (!msgs.length) box.append(emptyState);
  msgs.forEach((m, i) => box.append(renderMessage(m, i)));
  box.scrollTop = box.scrollHeight;
}
const emptyState = $("empty-state");

function setGenerating(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  for (const b of document.querySelectorAll(".regenerate")) b.disabled = on;
}

// ---- chat -------------------------------------------------------------------------------

function setTools(cfg) {
  state.tools = cfg;
  const n = cfg.tools.length;
  $("tools-count").hidden = !n;
  $("tools-count").textContent = n ? String(n) : "";
}

function editTools() {
  openToolsDialog(state.tools, async (cfg) => {
    setTools(cfg);
    const conv = state.current;
    if (!conv) return;                       // a new chat: saved when it is created
    try {
      const updated = await conversations.update(conv.id, { settings: settingsWithTools(conv.settings, cfg) });
      conv.settings = updated.settings;
    } catch (e) { showError(e.message); }
  });
}

// The person's results for the last answer's tool calls: stored, then the model continues.
async function sendToolResults(results) {
  const conv = state.current;
  if (state.generating || !conv) return;
  showError("");
  const index = conv.messages.length;
  conv.messages.push(...results);
  renderMessages();
  try {
    await conversations.putMessages(conv.id, results, index);
  } catch (e) { showError(e.message); return; }
  await generate(index + results.length);
}

function newChat() {
  if (state.generating) state.generating.controller.abort();
  state.current = null;
  setTools(toolConfig(null));
  history.replaceState(null, "", location.pathname);
  $("chat-title").textContent = "New chat";
  closeInspector();
  renderList();
  renderMessages();
  setDrawer(false);
  $("prompt").focus();
}

async function openConversation(id) {
  if (state.generating) state.generating.controller.abort();
  try {
    state.current = await conversations.get(id);
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) { newChat(); return; }
    throw e;
  }
  history.replaceState(null, "", `#c=${encodeURIComponent(id)}`);
  setTools(toolConfig(state.current));
  $("chat-title").textContent = state.current.title;
  closeInspector();
  renderList();
  renderMessages();
  setDrawer(false);
}

async function send(text) {
  if (state.generating || !text.trim()) return;
  showError("");
  if (!state.current) {
    const conv = await conversations.create({ title: titleFrom(text), model: state.settings.model || null,
      settings: settingsWithTools({}, state.tools) });
    state.current = conv;
    state.list.unshift(conv);
    history.replaceState(null, "", `#c=${encodeURIComponent(conv.id)}`);
    $("chat-title").textContent = conv.title;
    renderList();
  }
  const index = state.current.messages.length;
  const userMsg = { role: "user", content: text };
  state.current.messages.push(userMsg);
  renderMessages();
  await conversations.putMessages(state.current.id, [userMsg], index);
  const listed = state.list.findIndex((c) => c.id === state.current.id);
  if (listed > 0) { state.list.unshift(...state.list.splice(listed, 1)); renderList(); }
  await generate(index + 1);
}

async function generate(index, { fresh = false } = {}) {
  if (state.generating) return;
  const conv = state.current;
  const s = state.settings;
  const messages = conv.messages.slice(0, index).map(apiMessage);
  if (s.system.trim()) messages.unshift({ role: "system", content: s.system });
  const asst = { role: "assistant", content: "", trace: null, meta: null };
  conv.messages.splice(index, conv.messages.length - index, asst);
  renderMessages();
  const node = $("messages").querySelector(`.msg[data-index="${index}"]`);
  const body = node.querySelector(".msg-body");
  node.classList.add("streaming");
  node.setAttribute("aria-busy", "true");
  const controller = new AbortController();
  state.generating = { controller, index };
  setGenerating(true);
  let frame = 0;
  const paint = () => {
    frame = 0;
    const stick = $("messages").scrollHeight - $("messages").scrollTop - $("messages").clientHeight < 80;
    body.innerHTML = renderMarkdown(asst.content);
    if (stick) $("messages").scrollTop = $("messages").scrollHeight;
  };
  const request = { model: s.model || undefined, messages, temperature: Number(s.temperature),
    top_p: Number(s.top_p), max_tokens: Number(s.max_tokens), reasoning_effort: s.reasoning || undefined,
    cache: fresh ? false : undefined,    // a regenerated answer is a new one, never the cached one
    ...requestTools(toolConfig(conv), messages) };
  const thinking = node.querySelector(".reasoning");
  let failed = null;
  try {
    const result = await streamChat(request, {
      signal: controller.signal,
      onDelta: (_, content) => { asst.content = content; if (!frame) frame = requestAnimationFrame(paint); },
      onReasoning: (text) => { thinking.hidden = false; thinking.querySelector(".reasoning-body").textContent = text; },
    });
    asst.content = result.content;
    asst.trace = result.trace;
    asst.meta = { finish_reason: result.finishReason, model: s.model || null, usage: result.usage };
    if (result.cache) asst.meta.cache = result.cache;
    if (result.model && s.model && result.model !== s.model) asst.meta.routed = result.model;
    if (result.reasoning) asst.meta.reasoning = result.reasoning.slice(0, 12000);
    if (result.toolCalls.length) asst.meta.tool_calls = result.toolCalls.filter(Boolean);
  } catch (e) {
    if (e.name === "AbortError") asst.meta = { stopped: true, model: s.model || null };
    else failed = e;
  } finally {
    if (frame) cancelAnimationFrame(frame);
    state.generating = null;
    setGenerating(false);
  }
  if (conv !== state.current) return;  // the user switched chats mid-answer
  const blocked = failed && (failed.body?.error?.code === "content_policy_violation");
  if (blocked) {
    asst.meta = { blocked: true, error: failed.message };
    try { await conversations.putMessages(conv.id, [asst], index); } catch (e) { showError(e.message); }
  } else if (failed && !asst.content && !asst.meta?.tool_calls) {
    conv.messages.splice(index, 1);
    showError(failed.message);
  } else {
    if (failed) { asst.meta = { stopped: true, error: failed.message }; showError(failed.message); }
    try { await conversations.putMessages(conv.id, [asst], index); } catch (e) { showError(e.message); }
  }
  renderMessages();
}

// ---- inspector --------------------------------------------------------------------------

let inspectorReturnFocus = null;

function openInspector(msg, opener) {
  inspectorReturnFocus = opener;
  renderInspector($("inspector-body"), msg);
  $("inspector").hidden = false;
  $("app").classList.add("inspecting");
  $("close-inspector").focus();
}

function closeInspector() {
  if ($("inspector").hidden) return;
  $("inspector").hidden = true;
  $("app").classList.remove("inspecting");
  const tip = $("token-tooltip");
  if (tip) tip.hidden = true;
  inspectorReturnFocus?.focus();
}

// ---- wiring -----------------------------------------------------------------------------

function wire() {
  const prompt = $("prompt");
  const grow = () => { prompt.style.height = "auto"; prompt.style.height = `${Math.min(prompt.scrollHeight, 240)}px`; };
  prompt.addEventListener("input", grow);
  prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = prompt.value;
    if (!text.trim() || state.generating) return;
    prompt.value = "";
    grow();
    send(text).catch((err) => showError(err.message));
  });
  $("stop").addEventListener("click", () => state.generating?.controller.abort());
  $("new-chat").addEventListener("click", newChat);
  $("open-settings").addEventListener("click", () => openSettings(state));
  $("open-tools").addEventListener("click", editTools);
  $("settings-dialog").addEventListener("close", () => onSettingsClosed(state, refreshList).catch((e) => showError(e.message)));
  $("close-inspector").addEventListener("click", closeInspector);
  $("toggle-sidebar").addEventListener("click", () => setDrawer(!$("app").classList.contains("drawer-open")));
  $("scrim").addEventListener("click", () => setDrawer(false));
  $("model-select").addEventListener("change", (e) => { state.settings.model = e.target.value; saveSettings(state.settings); });
  $("theme-toggle").addEventListener("click", () => {
    const dark = state.settings.theme ? state.settings.theme === "dark" : matchMedia("(prefers-color-scheme: dark)").matches;
    state.settings.theme = dark ? "light" : "dark";
    saveSettings(state.settings);
    applyTheme();
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.generating) { state.generating.controller.abort(); e.preventDefault(); }
    else if (e.key === "Escape" && !$("inspector").hidden) closeInspector();
    else if (e.key === "Escape") setDrawer(false);
    if (e.ctrlKey && e.shiftKey && e.key.toLowerCase() === "o") { e.preventDefault(); newChat(); }
  });
}

async function init() {
  applyTheme();
  wire();
  initArena();
  await loadModels(state);
  try {
    await refreshList();
    const id = new URLSearchParams(location.hash.slice(1)).get("c");
    if (id) await openConversation(id);
    else renderMessages();
  } catch (e) {
    showError(e.message);
  }
  $("prompt").focus();
  document.documentElement.dataset.ready = "1";
}

init();
