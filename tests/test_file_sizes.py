"""No source file under src/kvserve/ is longer than 420 lines, unless its first lines say why
(issue 62: long files are split at their seams; a kernel that must stay one translation unit says so)."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvserve"
LIMIT = 420
SOURCES = (".py", ".cpp", ".h", ".js", ".css", ".html")


def test_no_long_file_without_a_reason_at_its_top():
    long = []
    for path in sorted(SRC.rglob("*")):
        if path.suffix not in SOURCES or not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        if len(lines) > LIMIT and not any("on purpose" in line for line in lines[:5]):
            long.append(f"{path.relative_to(SRC)}: {len(lines)} lines")
    assert not long, "files over 420 lines with no reason at their top:\n" + "\n".join(long)
