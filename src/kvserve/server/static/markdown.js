// A small Markdown renderer for untrusted model output.
//
// Safety comes from the order of work: the whole input is HTML-escaped first, so no tag or
// attribute the model writes can survive; only then are the few constructs we support turned
// into markup we write ourselves (code blocks, inline code, bold/italic, headings, lists,
// quotes, rules, links). Link targets are checked against an allow-list of schemes and are
// already escaped, so they cannot break out of the attribute. The page's CSP (script-src 'self')
// is the second line of defence.

const SAFE_URL = /^(https?:\/\/|mailto:)[^\s]*$/i;

export function escapeHtml(text) {
  return String(text)
    .replace(/&/g, "&amp;")
    .replace(/</g, "&lt;")
    .replace(/>/g, "&gt;")
    .replace(/"/g, "&quot;")
    .replace(/'/g, "&#39;");
}

// Decode the entities escapeHtml wrote, only to check a URL's scheme.
function unescapeForCheck(text) {
  return text.replace(/&quot;/g, '"').replace(/&#39;/g, "'").replace(/&lt;/g, "<")
    .replace(/&gt;/g, ">").replace(/&amp;/g, "&");
}

export function safeHref(escapedUrl) {
  const raw = unescapeForCheck(escapedUrl).trim();
  return SAFE_URL.test(raw) ? escapedUrl.trim() : null;
}

// Inline constructs on already-escaped text. Code spans are cut out first so that nothing
// inside them is formatted.
function inline(text) {
  const spans = [];
  const hold = (html) => `\u0000${spans.push(html) - 1}\u0000`;
  let out = text.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, __, code) => hold(`<code>${code.trim() || code}</code>`));
  out = out.replace(/\[([^\]\n]+)\]\(([^)\s]+)\)/g, (whole, label, url) => {
    const href = safeHref(url);
    if (!href) return whole;
    return hold(`<a href="${href}" target="_blank" rel="noopener noreferrer nofollow">${label}</a>`);
  });
  out = out.replace(/(^|[\s(])(https?:\/\/[^\s<\u0000]*[^\s<\u0000.,;:!?)\]'"&])/g, (_, pre, url) =>
    pre + hold(`<a href="${url}" target="_blank" rel="noopener noreferrer nofollow">${url}</a>`));
  out = out
    .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>")
    .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>")
    .replace(/(^|[^_\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  return out.replace(/\u0000(\d+)\u0000/g, (_, i) => spans[Number(i)]);
}

function listItem(line) {
  let m = /^(\s*)([-*+])\s+(.*)$/.exec(line);
  if (m) return { indent: m[1].length, ordered: false, text: m[3] };
  m = /^(\s*)(\d{1,9})[.)]\s+(.*)$/.exec(line);
  if (m) return { indent: m[1].length, ordered: true, start: Number(m[2]), text: m[3] };
  return null;
}

// Block structure of one stretch of text without code fences.
function blocks(text) {
  const lines = text.split("\n");
  const html = [];
  let para = [];
  const flush = () => {
    if (para.length) html.push(`<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`);
    para = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    let m;
    if (!line.trim()) { flush(); continue; }
    if ((m = /^(#{1,6})\s+(.*?)\s*#*\s*$/.exec(line))) {
      flush();
      const level = Math.min(m[1].length + 2, 6); // answers never need an <h1>
      html.push(`<h${level}>${inline(m[2])}</h${level}>`);
      continue;
    }
    if (/^\s{0,3}([-*_])(\s*\1){2,}\s*$/.test(line)) { flush(); html.push("<hr>"); continue; }
    if (/^\s{0,3}&gt;/.test(line)) {
      flush();
      const quoted = [];
      while (i < lines.length && /^\s{0,3}&gt;/.test(lines[i])) {
        quoted.push(lines[i].replace(/^\s{0,3}&gt;\s?/, ""));
        i++;
      }
      i--;
      html.push(`<blockquote>${blocks(quoted.join("\n"))}</blockquote>`);
      continue;
    }
    const item = listItem(line);
    if (item) {
      flush();
      const ordered = item.ordered;
      const items = [];
      while (i < lines.length) {
        const it = listItem(lines[i]);
        if (it && it.ordered === ordered) { items.push(it.text); i++; continue; }
        if (it || !lines[i].trim()) break;
        if (/^\s+\S/.test(lines[i]) && items.length) { items[items.length - 1] += "\n" + lines[i].trim(); i++; continue; }
        break;
      }
      i--;
      const tag = ordered ? "ol" : "ul";
      const start = ordered && item.start !== 1 ? ` start="${item.start}"` : "";
      html.push(`<${tag}${start}>${items.map((t) => `<li>${inline(t).replace(/\n/g, "<br>")}</li>`).join("")}</${tag}>`);
      continue;
    }
    para.push(line);
  }
  flush();
  return html.join("");
}

// Render Markdown to an HTML string that contains only markup written here.
// An unterminated code fence (an answer still streaming) renders as an open code block.
export function renderMarkdown(source) {
  const text = escapeHtml(String(source ?? "").replace(/\u0000/g, "").replace(/\r\n?/g, "\n"));
  const out = [];
  const fence = /^ {0,3}(`{3,}|~{3,})[ \t]*([\w+#.-]*)[^\n]*$/gm;
  let pos = 0;
  let m;
  while ((m = fence.exec(text))) {
    out.push(blocks(text.slice(pos, m.index)));
    const marker = m[1];
    const bodyStart = m.index + m[0].length + 1;
    const close = new RegExp(`^ {0,3}${marker[0] === "`" ? "`" : "~"}{${marker.length},}[ \\t]*$`, "gm");
    close.lastIndex = bodyStart;
    const end = bodyStart <= text.length ? close.exec(text) : null;
    const code = end ? text.slice(bodyStart, end.index) : text.slice(bodyStart);
    const lang = m[2] ? ` class="language-${m[2].replace(/[^\w+#-]/g, "")}" data-lang="${m[2].replace(/[^\w+#-]/g, "")}"` : "";
    out.push(`<pre><code${lang}>${code.replace(/\n$/, "")}</code></pre>`);
    pos = end ? end.index + end[0].length + 1 : text.length;
    fence.lastIndex = pos;
  }
  out.push(blocks(text.slice(pos)));
  return out.join("");
}
