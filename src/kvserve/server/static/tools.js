// Tool calling in the chat page: the person defines functions (OpenAI `tools`, edited as JSON or
// taken from presets), the model's calls are shown plainly (name + arguments), the person types
// each call's result, which goes back as a `tool` message, and the conversation continues.
//
// The tools and the tool choice belong to the conversation (its `settings.tools` and
// `settings.tool_choice`, saved with it); a call is the assistant message's `meta.tool_calls`
// and a result is a stored message with role "tool" and `meta.tool_call_id`/`meta.name`.
// The chosen tool_choice applies to the answer to a user message; the answer that follows tool
// results is asked with "auto", so a forced call does not repeat forever. The calls go through the
// server's usual path (constrained by the tool's parameter schema for "required" or a named choice).
// Everything the model wrote is set through textContent, never as HTML.

const node = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};

const fn = (name, description, properties, required) =>
  ({ type: "function", function: { name, description, parameters: { type: "object", properties, required } } });

export const PRESETS = {
  weather: fn("get_weather", "Get the current weather in a city.",
    { city: { type: "string" }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } }, ["city"]),
  calculator: fn("calculate", "Evaluate an arithmetic expression.", { expression: { type: "string" } }, ["expression"]),
  search: fn("search_web", "Search the web and return the top results.",
    { query: { type: "string" }, max_results: { type: "integer", minimum: 1, maximum: 10 } }, ["query"]),
};

// The conversation's tool settings (or none), in the page's form: {tools: [...], choice: "auto" |
// "required" | "none" | "fn:<name>"}.
export function toolConfig(conv) {
  const s = conv?.settings || {};
  if (!Array.isArray(s.tools) || !s.tools.length) return { tools: [], choice: "auto" };
  const c = s.tool_choice;
  const choice = typeof c === "object" && c?.function?.name ? `fn:${c.function.name}` : (c || "auto");
  return { tools: s.tools, choice };
}

export function choiceValue(choice) {
  return choice.startsWith("fn:") ? { type: "function", function: { name: choice.slice(3) } } : choice;
}

export function settingsWithTools(settings, cfg) {
  const out = { ...(settings || {}) };
  delete out.tools;
  delete out.tool_choice;
  if (cfg.tools.length) { out.tools = cfg.tools; out.tool_choice = choiceValue(cfg.choice); }
  return out;
}

// Check the editor's text: a list of {"type": "function", "function": {"name", "parameters"?}}.
export function parseTools(text) {
  let tools;
  try { tools = text.trim() ? JSON.parse(text) : []; } catch (e) { throw new Error(`Tools are not valid JSON: ${e.message}`); }
  if (!Array.isArray(tools)) throw new Error("Tools must be a JSON list of functions.");
  tools.forEach((t, i) => {
    const name = t?.function?.name;
    if (t?.type !== "function" || typeof name !== "string" || !/^[A-Za-z0-9_-]{1,64}$/.test(name)) {
      throw new Error(`Tool ${i + 1} needs "type": "function" and a "function.name" of letters, digits, _ or -.`);
    }
    const p = t.function.parameters;
    if (p !== undefined && (typeof p !== "object" || p === null || Array.isArray(p))) {
      throw new Error(`Tool ${i + 1} (${name}): "parameters" must be a JSON schema object.`);
    }
  });
  return tools;
}

// The stored messages as OpenAI messages: calls as `tool_calls`, results as `tool` messages.
export function apiMessage(m) {
  if (m.role === "tool") return { role: "tool", content: m.content, tool_call_id: m.meta?.tool_call_id };
  if (m.role === "assistant" && m.meta?.tool_calls?.length) {
    return { role: "assistant", content: m.content || null,
      tool_calls: m.meta.tool_calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } })) };
  }
  return { role: m.role, content: m.content };
}

// The `tools`/`tool_choice` fields of a request continuing `messages` (API shape).
export function requestTools(cfg, messages) {
  if (!cfg.tools.length) return {};
  const afterResults = messages.length && messages[messages.length - 1].role === "tool";
  return { tools: cfg.tools, tool_choice: afterResults ? "auto" : choiceValue(cfg.choice) };
}

function prettyArguments(text) {
  try { return JSON.stringify(JSON.parse(text), null, 2); } catch { return text; }
}

// The model's calls, one box each: the function's name and its arguments.
export function toolCallsBlock(calls) {
  const box = node("div", "tool-calls");
  for (const c of calls) {
    const call = node("div", "tool-call");
    call.dataset.callId = c.id;
    const head = node("div", "tool-call-head");
    head.append(node("span", "tool-call-label", "Tool call"), node("code", "tool-call-name", c.name));
    call.append(head, node("pre", "tool-call-args", prettyArguments(c.arguments || "{}")));
    box.append(call);
  }
  return box;
}

// A stored tool result.
export function toolResultBody(msg) {
  const box = node("div", "tool-result");
  const head = node("div", "tool-call-head");
  head.append(node("span", "tool-call-label", "Tool result"), node("code", "tool-call-name", msg.meta?.name || "tool"));
  box.append(head, node("pre", "tool-result-text", msg.content));
  return box;
}

// Under the last answer when it called tools: a field per call for its result, and a button that
// sends them all back (onSubmit gets [{role: "tool", content, meta}] in the calls' order).
export function toolResultForm(calls, onSubmit) {
  const form = node("form", "tool-result-form");
  const fields = calls.map((c) => {
    const label = node("label", "tool-result-field");
    label.append(node("span", "", `Result of ${c.name}`));
    const ta = node("textarea", "tool-result-input");
    ta.rows = 2;
    ta.placeholder = '{"result": ...}';
    ta.dataset.callId = c.id;
    label.append(ta);
    form.append(label);
    return ta;
  });
  const submit = node("button", "btn btn-primary btn-small tool-result-send", "Send result" + (calls.length > 1 ? "s" : ""));
  submit.type = "submit";
  form.append(submit);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    submit.disabled = true;
    onSubmit(calls.map((c, i) => ({ role: "tool", content: fields[i].value,
      meta: { tool_call_id: c.id, name: c.name } })));
  });
  return form;
}

// The Tools dialog: a JSON editor with presets and the tool choice. `onSave(cfg)` on Save.
export function openToolsDialog(cfg, onSave) {
  const dialog = document.getElementById("tools-dialog");
  const editor = document.getElementById("tools-json");
  const choice = document.getElementById("tool-choice");
  const note = document.getElementById("tools-note");
  const fillChoices = (tools, value) => {
    const opts = [["auto", "auto (the model decides)"], ["required", "required (must call one)"], ["none", "none"]];
    for (const t of tools) opts.push([`fn:${t.function.name}`, `always call ${t.function.name}`]);
    choice.replaceChildren(...opts.map(([v, label]) => new Option(label, v)));
    choice.value = opts.some(([v]) => v === value) ? value : "auto";
  };
  const refresh = () => {
    try { fillChoices(parseTools(editor.value), choice.value); note.textContent = ""; } catch (e) { note.textContent = e.message; }
  };
  editor.value = cfg.tools.length ? JSON.stringify(cfg.tools, null, 2) : "";
  fillChoices(cfg.tools, cfg.choice);
  note.textContent = "";
  editor.oninput = refresh;
  for (const b of dialog.querySelectorAll("[data-preset]")) {
    b.onclick = () => {
      let tools = [];
      try { tools = parseTools(editor.value); } catch { /* replace what does not parse */ }
      const preset = PRESETS[b.dataset.preset];
      if (!tools.some((t) => t.function.name === preset.function.name)) tools.push(preset);
      editor.value = JSON.stringify(tools, null, 2);
      refresh();
    };
  }
  document.getElementById("tools-clear").onclick = () => { editor.value = ""; refresh(); };
  document.getElementById("save-tools").onclick = (e) => {
    try {
      const tools = parseTools(editor.value);
      onSave({ tools, choice: tools.length ? choice.value : "auto" });
    } catch (err) {
      e.preventDefault();
      note.textContent = err.message;
    }
  };
  dialog.showModal();
  editor.focus();
}
