// The inspector: what the server measured for one answer (the `kvserve_trace` object).
//
// Everything here is built with createElement/textContent: token texts come from the model and
// are as untrusted as the answer itself, so no string ever reaches innerHTML.

const STAGES = [
  ["validation_auth", "Validation & auth"],
  ["template_tokenize", "Template & tokenize"],
  ["queue", "Queue wait"],
  ["prefill", "Prefill"],
  ["decode", "Decode"],
];

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c != null) node.append(c);
  return node;
}

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);

export function fmtMs(ms) {
  ms = num(ms);
  if (ms == null) return "–";
  if (ms >= 1000) return `${(ms / 1000).toFixed(2)} s`;
  return `${ms < 10 ? ms.toFixed(1) : Math.round(ms)} ms`;
}

// Show whitespace and control characters so a chip of "\n" or " " is visible.
export function visibleToken(text) {
  return String(text ?? "").replace(/ /g, "·").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍") || "∅";
}

function stat(label, value, sub) {
  return el("div", { class: "stat" }, el("div", { class: "stat-value", text: value }),
    el("div", { class: "stat-label", text: label }), sub ? el("div", { class: "stat-sub", text: sub }) : null);
}

function summary(trace) {
  const t = trace.timings_ms || {};
  const tps = num(trace.tokens_per_second);
  const cached = num(trace.cached_prompt_tokens) ?? 0;
  const promptCount = num(trace.prompt_token_count) ?? (trace.prompt_tokens || []).length;
  const blocks = num(trace.kv_blocks_used);
  const blockSize = num(trace.block_size);
  return el("div", { class: "stats" },
    stat("Time to first token", fmtMs(t.ttft)),
    stat("Tokens / second", tps == null ? "–" : tps.toFixed(1)),
    stat("Total", fmtMs(t.total)),
    stat("Prompt tokens", String(promptCount), `${cached} from prefix cache`),
    stat("KV blocks used", blocks == null ? "–" : String(blocks),
      blockSize ? `${blockSize} tokens each = ${blocks * blockSize} slots` : null),
    stat("Output tokens", String(num(trace.completion_token_count) ?? (trace.output_tokens || []).length)));
}

function timeline(trace) {
  const t = trace.timings_ms || {};
  const total = num(t.total) || STAGES.reduce((s, [k]) => s + (num(t[k]) || 0), 0) || 1;
  const rows = el("div", { class: "timeline", role: "list" });
  let start = 0;
  const row = (label, from, dur, cls) => {
    const bar = el("div", { class: `tl-bar ${cls}` });
    bar.style.setProperty("--from", `${Math.min(100, (from / total) * 100)}%`);
    bar.style.setProperty("--width", `${Math.max(0.4, Math.min(100, (dur / total) * 100))}%`);
    rows.append(el("div", { class: "tl-row", role: "listitem" },
      el("span", { class: "tl-label", text: label }),
      el("span", { class: "tl-track" }, bar),
      el("span", { class: "tl-value", text: fmtMs(dur) })));
  };
  for (const [key, label] of STAGES) {
    const dur = num(t[key]);
    if (dur == null) continue;
    row(label, start, dur, `tl-${key}`);
    start += dur;
  }
  if (num(t.ttft) != null) row("First token (TTFT)", 0, t.ttft, "tl-ttft");
  row("Total", 0, total, "tl-total");
  return rows;
}

function promptChips(trace) {
  const wrap = el("div", { class: "chips", role: "list", "aria-label": "Prompt tokens" });
  for (const tok of trace.prompt_tokens || []) {
    const chip = el("span", { class: tok.cached ? "chip cached" : "chip", role: "listitem",
      title: `id ${tok.id}${tok.cached ? " · from prefix cache" : ""}` },
    el("span", { class: "chip-text", text: visibleToken(tok.text) }),
    el("span", { class: "chip-id", text: String(tok.id) }));
    wrap.append(chip);
  }
  return wrap;
}

// Probability → hue from red (unlikely) to green (certain).
function probHue(p) {
  return Math.round(Math.max(0, Math.min(1, p)) * 120);
}

function altTable(tok) {
  const table = el("table", { class: "alts" });
  table.append(el("caption", { text: `Top ${(tok.top || []).length} alternatives` }));
  const top = [...(tok.top || [])].sort((a, b) => (num(b.prob) ?? 0) - (num(a.prob) ?? 0));
  for (const alt of top) {
    const pct = num(alt.prob) == null ? "–" : `${(alt.prob * 100).toFixed(alt.prob < 0.01 ? 2 : 1)}%`;
    const bar = el("span", { class: "alt-bar" });
    bar.style.setProperty("--w", `${Math.round((num(alt.prob) || 0) * 100)}%`);
    table.append(el("tr", { class: alt.id === tok.id ? "alt chosen" : "alt" },
      el("td", { class: "alt-text" }, el("code", { text: visibleToken(alt.text) })),
      el("td", { class: "alt-meter" }, bar),
      el("td", { class: "alt-prob", text: pct })));
  }
  return table;
}

// Where an accepted draft token's guess came from (kvserve_trace output_tokens[].draft_source).
const DRAFT_SOURCES = { prompt: "the prompt", request: "this request's own output", other: "another request's answer",
  model: "the draft model", supplied: "the request's supplied draft" };

function draftFrom(tok) {
  const s = DRAFT_SOURCES[tok.draft_source];
  return s ? `, from ${s}` : "";
}

function outputTokens(trace, tooltip) {
  const wrap = el("div", { class: "out-tokens", "aria-label": "Generated tokens" });
  for (const tok of trace.output_tokens || []) {
    const p = num(tok.prob) ?? (num(tok.logprob) == null ? null : Math.exp(tok.logprob));
    const pct = p == null ? "unknown" : `${(p * 100).toFixed(1)}%`;
    const cls = (p == null ? "out-tok unknown" : "out-tok") + (tok.drafted ? " drafted" : "");
    const from = tok.drafted ? draftFrom(tok) : "";
    const span = el("span", { class: cls, tabindex: "0",
      "aria-label": `${tok.text} — probability ${pct}${tok.drafted ? ` — accepted draft token${from}` : ""}` });
    span.textContent = tok.text || "∅";
    if (p != null) span.style.setProperty("--hue", String(probHue(p)));
    const show = () => {
      tooltip.replaceChildren(el("div", { class: "tip-head" },
        el("code", { text: visibleToken(tok.text) }),
        el("span", { text: ` id ${tok.id} · p = ${pct}${tok.drafted ? ` · accepted draft${from}` : ""}` })), altTable(tok));
      tooltip.hidden = false;
      const r = span.getBoundingClientRect();
      const w = tooltip.offsetWidth;
      const h = tooltip.offsetHeight;
      const left = Math.max(8, Math.min(window.innerWidth - w - 8, r.left));
      const top = r.bottom + 6 + h > window.innerHeight ? r.top - h - 6 : r.bottom + 6;
      tooltip.style.left = `${left}px`;
      tooltip.style.top = `${Math.max(8, top)}px`;
    };
    const hide = () => { tooltip.hidden = true; };
    span.addEventListener("mouseenter", show);
    span.addEventListener("focus", show);
    span.addEventListener("mouseleave", hide);
    span.addEventListener("blur", hide);
    wrap.append(span);
  }
  return wrap;
}

function section(title, ...children) {
  return el("section", { class: "insp-section" }, el("h3", { text: title }), ...children);
}

export function renderInspector(container, message) {
  container.replaceChildren();
  let tooltip = document.getElementById("token-tooltip");
  if (!tooltip) {
    tooltip = el("div", { id: "token-tooltip", class: "token-tooltip", role: "tooltip" });
    tooltip.hidden = true;
    document.body.append(tooltip);
  }
  const trace = message?.trace;
  if (!trace) {
    const why = message?.meta?.stopped ? "This answer was stopped before the server sent its trace."
      : "This answer has no trace.";
    container.append(el("p", { class: "hint", text: why }));
    return;
  }
  if (trace.request_id) container.append(el("p", { class: "hint mono", text: trace.request_id }));
  if (trace.semantic_cache) {
    const c = trace.semantic_cache;
    container.append(el("p", { class: "hint", text: `Answered from the semantic cache: matched "${c.matched_query}" ` +
      `(similarity ${c.similarity}, stored ${c.age_s} s ago, lookup ${c.lookup_ms} ms).` }));
    if (c.verification) {   // the model checked the stored answer as a draft (issue 47)
      const v = c.verification;
      const k = c.cost || {};
      const what = v.result === "verified" ? "the model verified the stored answer whole"
        : v.result === "partial" ? `the model kept the first ${v.accepted_tokens} of its ${v.draft_tokens} tokens, then decoded`
          : "the model rejected the stored answer and decoded its own";
      container.append(el("p", { class: "hint", text: `Verification: ${what}. Cost: ${k.prompt_tokens_computed} prompt ` +
        `tokens computed, ${k.draft_tokens_checked} answer tokens checked, ${k.decoded_tokens} decoded; prefill ` +
        `${k.prefill_ms} ms, decode ${k.decode_ms} ms.` }));
    }
  }
  if (trace.router) {
    container.append(el("p", { class: "hint", text: `Router: sent to ${trace.router.model} (${trace.router.reason}` +
      `${trace.router.level !== undefined ? `, level ${trace.router.level}` : ""}, ${trace.router.router_ms} ms).` }));
  }
  container.append(summary(trace));
  container.append(section("Timeline", timeline(trace)));
  const cached = num(trace.cached_prompt_tokens) ?? 0;
  const legend = el("p", { class: "legend" }, el("span", { class: "chip cached legend-chip", text: "cached" }),
    ` = served from the prefix cache (${cached} tokens); the number under each chip is its token id.`);
  container.append(section(`Prompt as the model saw it (${(trace.prompt_tokens || []).length} tokens)`,
    legend, promptChips(trace)));
  if (trace.prompt_text) {
    container.append(el("details", { class: "raw-prompt" }, el("summary", { text: "Rendered chat template" }),
      el("pre", { text: trace.prompt_text })));
  }
  const outLegend = el("p", { class: "legend" }, el("span", { class: "prob-scale", "aria-hidden": "true" }),
    " colour = probability of the chosen token (red unlikely, green certain); hover or focus a token for its top-5.",
    ...((trace.output_tokens || []).some((t) => t.drafted)
      ? [" ", el("span", { class: "out-tok drafted legend-chip", text: "underlined" }),
        " = a draft token the model accepted (speculative decoding)."] : []));
  container.append(section("Generated tokens", outLegend, outputTokens(trace, tooltip)));
}
