// The model picker and the Settings dialog (system prompt, sampling, reasoning, API key), kept in
// this browser's localStorage. `state` is the page's state object; `refreshList` reloads the
// conversation list after the API key changed.

import { ApiError, apiKey, listModels, saveSettings } from "./api.js";
import { $, showError } from "./ui.js";

export async function loadModels(state) {
  const select = $("model-select");
  try {
    state.models = await listModels();
  } catch (e) {
    showError(e.message);
    if (e instanceof ApiError && e.status === 401 && !$("settings-dialog").open) {
      $("settings-note").textContent = "This server requires an API key.";
      openSettings(state);
      $("set-api-key").focus();
    }
    return;
  }
  $("settings-note").textContent = "";
  select.replaceChildren(...state.models.map((id) => new Option(id, id)));
  if (!state.models.includes(state.settings.model)) state.settings.model = state.models[0] || "";
  select.value = state.settings.model;
}

export function openSettings(state) {
  const s = state.settings;
  $("set-system").value = s.system;
  $("set-temperature").value = s.temperature;
  $("set-top-p").value = s.top_p;
  $("set-reasoning").value = s.reasoning || "";
  $("set-max-tokens").value = s.max_tokens;
  $("set-api-key").value = apiKey.get();
  $("settings-dialog").showModal();
}

export async function onSettingsClosed(state, refreshList) {
  const dialog = $("settings-dialog");
  if (dialog.returnValue !== "save") return;
  const clamp = (v, lo, hi, dflt) => (Number.isFinite(Number(v)) && v !== "" ? Math.min(hi, Math.max(lo, Number(v))) : dflt);
  const s = state.settings;
  s.system = $("set-system").value;
  s.temperature = clamp($("set-temperature").value, 0, 2, 0.7);
  s.top_p = clamp($("set-top-p").value, 0.01, 1, 0.95);
  s.reasoning = $("set-reasoning").value;
  s.max_tokens = Math.round(clamp($("set-max-tokens").value, 1, 32768, 512));
  saveSettings(s);
  const key = $("set-api-key").value.trim();
  if (key !== apiKey.get()) {
    apiKey.set(key);
    showError("");
    await loadModels(state);
    await refreshList().catch((e) => showError(e.message));
  }
}

