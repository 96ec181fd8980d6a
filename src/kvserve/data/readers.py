"""Input readers for `kvserve data clean`: WARC (and WET), HTML, JSON Lines and plain text.

Every reader is a generator of `RawDoc`s, read one record at a time, so a crawl of any size
streams through in constant memory. HTML stays HTML here: main-text extraction is CPU work
and happens in the worker processes (`kvserve.data.quality.extract`).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvserve.errors import InvalidRequest

HTML_SUFFIXES = (".html", ".htm", ".xhtml")
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
WARC_SUFFIXES = (".warc", ".wet", ".arc")


@dataclass
class RawDoc:
    payload: str           # HTML or text
    source: str            # URL, or file[:line]
    is_html: bool


def _kind(path: Path) -> str | None:
    """'warc' | 'html' | 'jsonl' | 'text' from the name, looking through a trailing .gz."""
    name = path.name.lower()
    name = name.removesuffix(".gz")
    for kind, suffixes in (("warc", WARC_SUFFIXES), ("html", HTML_SUFFIXES), ("jsonl", JSONL_SUFFIXES),
                           ("text", TEXT_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    return None


def _open_text(path: Path):
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return path.open(encoding="utf-8", errors="replace")


def input_files(inputs: list[str]) -> list[Path]:
    """The files to read, in a stable order: files as given, directories walked (sorted)."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir():
            files.extend(f for f in sorted(p.rglob("*")) if f.is_file() and _kind(f))
        elif p.is_file():
            if _kind(p) is None:
                raise InvalidRequest(f"{p}: unknown input type; give .warc[.gz], .wet[.gz], .html, .jsonl[.gz], "
                                     ".txt or .md files, or a directory of them", param="input")
            files.append(p)
        else:
            raise InvalidRequest(f"input {p} does not exist", param="input")
    if not files:
        raise InvalidRequest(f"no readable input files in {', '.join(inputs)}", param="input")
    return files


def read_warc(path: Path) -> Iterator[RawDoc]:
    """HTML responses of a WARC, and the text conversions of a WET."""
    from warcio.archiveiterator import ArchiveIterator

    with path.open("rb") as f:
        for record in ArchiveIterator(f):
            if record.rec_type not in ("response", "conversion", "resource"):
                continue
            url = record.rec_headers.get_header("WARC-Target-URI") or str(path)
            if record.rec_type == "conversion":
                yield RawDoc(record.content_stream().read().decode("utf-8", "replace"), url, False)
                continue
            ctype = (record.http_headers.get_header("Content-Type") if record.http_headers else
                     record.rec_headers.get_header("Content-Type")) or ""
            if "html" not in ctype.lower():
                continue
            yield RawDoc(record.content_stream().read().decode("utf-8", "replace"), url, True)


def read_jsonl(path: Path) -> Iterator[RawDoc]:
    """One JSON object per line with "text" (or "content"; "html" is extracted); "source" or
    "url" name it. Lines that are not such objects are skipped (and counted as unreadable)."""
    with _open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                yield RawDoc("", f"{path}:{n}", False)
                continue
            if not isinstance(obj, dict):
                yield RawDoc("", f"{path}:{n}", False)
                continue
            source = str(obj.get("source") or obj.get("url") or f"{path}:{n}")
            if isinstance(obj.get("html"), str):
                yield RawDoc(obj["html"], source, True)
            else:
                text = obj.get("text", obj.get("content", ""))
                yield RawDoc(text if isinstance(text, str) else "", source, False)


def iter_documents(files: list[Path]) -> Iterator[RawDoc]:
    for path in files:
        kind = _kind(path)
        if kind == "warc":
            from warcio.exceptions import ArchiveLoadFailed

            try:
                yield from read_warc(path)
            except (ArchiveLoadFailed, OSError, EOFError) as e:
                raise InvalidRequest(f"{path} is not a readable WARC file ({e})", param="input") from None
        elif kind == "jsonl":
            yield from read_jsonl(path)
        else:
            with _open_text(path) as f:
                yield RawDoc(f.read(), str(path), kind == "html")
