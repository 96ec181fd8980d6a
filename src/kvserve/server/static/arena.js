// The Arena tab: one prompt, two anonymous contestants answering side by side (both streamed at
// once), a vote (A / B / tie / both bad), then the names, and the leaderboard.
//
// Which contestant is A and which is B is known only to the server until the vote
// (server/api/arena.py); answers are rendered through renderMarkdown (escape first), like the chat.

import { api, streamSSE } from "./api.js";
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const CHAT_PARTS = ["messages", "composer", "composer-hint"];
const VOTES = [["a", "A is better"], ["b", "B is better"], ["tie", "Tie"], ["both_bad", "Both are bad"]];
const arena = { battle: null, controller: null };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  node.append(...children);
  return node;
}

function build() {
  const view = $("arena-view");
  const form = el("form", { id: "arena-form", class: "arena-form", autocomplete: "off" },
    el("label", { for: "arena-prompt", class: "visually-hidden", text: "Arena prompt" }),
    el("textarea", { id: "arena-prompt", rows: "2", placeholder: "Ask two anonymous models the same question" }),
    el("button", { id: "arena-send", class: "btn btn-primary", type: "submit", text: "Ask both" }));
  const side = (s) => el("article", { class: "arena-side", id: `arena-side-${s}` },
    el("h3", { id: `arena-name-${s}`, text: `Model ${s.toUpperCase()}` }),
    el("div", { class: "arena-answer msg-body", id: `arena-answer-${s}`, "aria-live": "polite" }));
  const votes = el("div", { id: "arena-votes", class: "arena-votes" });
  votes.hidden = true;
  for (const [winner, label] of VOTES) {
    const b = el("button", { class: "btn btn-ghost", type: "button", "data-winner": winner, text: label });
    b.addEventListener("click", () => vote(winner).catch((e) => status(e.message)));
    votes.append(b);
  }
  const table = el("table", { id: "arena-leaderboard", class: "arena-table" },
    el("thead", {}, el("tr", {}, ...["Rank", "Model", "Rating", "95% CI", "Elo", "Votes"].map(
      (h) => el("th", { scope: "col", text: h })))),
    el("tbody"));
  view.append(form, el("div", { class: "arena-sides" }, side("a"), side("b")), votes,
    el("p", { id: "arena-status", class: "hint", role: "status" }),
    el("h2", { class: "arena-heading", text: "Leaderboard" }), table,
    el("p", { id: "arena-votes-total", class: "hint" }));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const prompt = $("arena-prompt").value.trim();
    if (prompt) battle(prompt).catch((err) => status(err.message));
  });
  $("arena-prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); form.requestSubmit(); }
  });
}

function status(text) { $("arena-status").textContent = text; }

function show(view) {
  const inArena = view === "arena";
  $("arena-view").hidden = !inArena;
  for (const id of CHAT_PARTS) $(id).hidden = inArena;
  $("tab-chat").setAttribute("aria-selected", String(!inArena));
  $("tab-arena").setAttribute("aria-selected", String(inArena));
  if (inArena) {
    refreshLeaderboard().catch((e) => status(e.message));
    $("arena-prompt").focus();
  }
}

async function battle(prompt) {
  arena.controller?.abort();
  const controller = new AbortController();
  arena.controller = controller;
  $("arena-send").disabled = true;
  $("arena-votes").hidden = true;
  status("Both models are answering…");
  for (const s of ["a", "b"]) {
    $(`arena-name-${s}`).textContent = `Model ${s.toUpperCase()}`;
    $(`arena-answer-${s}`).replaceChildren();
    $(`arena-side-${s}`).classList.add("streaming");
    $(`arena-side-${s}`).classList.remove("winner");
  }
  try {
    const { id } = await api("POST", "/v1/kvserve/arena/battles", { prompt });
    arena.battle = id;
    await Promise.all(["a", "b"].map((s) => streamSSE(
      `/v1/kvserve/arena/battles/${encodeURIComponent(id)}/answers/${s}`, {},
      { signal: controller.signal, onDelta: (_, full) => { $(`arena-answer-${s}`).innerHTML = renderMarkdown(full); } },
    ).finally(() => $(`arena-side-${s}`).classList.remove("streaming"))));
    $("arena-votes").hidden = false;
    status("Which answer is better?");
  } finally {
    $("arena-send").disabled = false;
  }
}

async function vote(winner) {
  if (!arena.battle) return;
  const r = await api("POST", `/v1/kvserve/arena/battles/${encodeURIComponent(arena.battle)}/vote`, { winner });
  arena.battle = null;
  $("arena-votes").hidden = true;
  $("arena-name-a").textContent = `Model A: ${r.model_a}`;
  $("arena-name-b").textContent = `Model B: ${r.model_b}`;
  if (winner === "a" || winner === "b") $(`arena-side-${winner}`).classList.add("winner");
  status(`Thanks! A was ${r.model_a}, B was ${r.model_b}.`);
  await refreshLeaderboard();
}

async function refreshLeaderboard() {
  const r = await api("GET", "/v1/kvserve/arena/leaderboard");
  const body = $("arena-leaderboard").querySelector("tbody");
  body.replaceChildren(...r.data.map((row) => el("tr", { "data-model": row.model },
    el("td", { text: String(row.rank) }), el("td", { text: row.model }), el("td", { text: row.rating.toFixed(0) }),
    el("td", { text: `${row.ci_lower.toFixed(0)} – ${row.ci_upper.toFixed(0)}` }),
    el("td", { text: row.elo.toFixed(0) }), el("td", { text: String(row.battles) }))));
  $("arena-votes-total").textContent = `${r.votes} vote${r.votes === 1 ? "" : "s"} in all; ratings are ` +
    "Bradley-Terry on the Elo scale with bootstrap 95% intervals.";
}

export function initArena() {
  build();
  $("tab-chat").addEventListener("click", () => show("chat"));
  $("tab-arena").addEventListener("click", () => show("arena"));
}
