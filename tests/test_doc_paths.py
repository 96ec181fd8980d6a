"""Every repository file the README and docs/ name exists (issue 62: the README's stage table named
`engine/router.py` for months after it became `replica_router.py`).

A name in backticks that looks like a source path (`engine/scheduler.py`, `lease.py`,
`cpu/kvserve_forward.cpp`, `scripts/test-deps.sh`) must be the tail of a tracked file's path.
Placeholders a user fills in (`DIR/...`, `FILE.gguf`) and files a command writes are not repo
paths: they are upper-case or outside the extensions checked here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Only source-like extensions: JSON/TOML names in the docs are mostly files a user writes.

# A bare file name (a table row's "`step.py`, `pool.py`" after a folder) must be some tracked
# file's name; a name with a folder must be the tail of a tracked file's path.
TOKEN_RE = re.compile(r"`([A-Za-z0-9_][A-Za-z0-9_./-]*)`")
EXT = (".py", ".cpp", ".h", ".sh", ".md", ".html", ".css", ".js")
# Names of files kvserve writes or a user supplies, not files of this repository.
NOT_REPO = {"part-00000.js", "report.js"}

def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], check=False, cwd=ROOT, capture_output=True, text=True)
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.split()
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]

def _named(doc: Path) -> set[str]:
    names = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        for m in TOKEN_RE.finditer(line):
            name = m.group(1).lstrip("./")
            if not name.endswith(EXT):
                continue
            parts = name.split("/")
            if any(part[:1].isupper() for part in parts[:-1]) or parts[-1] in NOT_REPO:
                continue                    # DIR/..., placeholders and files a command writes
            if parts[-1][:1].isupper() and len(parts) == 1 and parts[-1] not in {"README.md", "BENCHMARKS.md"}:
                continue                    # FILE.py-style placeholders
            names.add(name)
    return names

def test_paths_named_in_docs_exist():
    tracked = ["/" + p for p in _tracked()]
    missing = []
    for doc in DOCS:
        for name in sorted(_named(doc)):
            if not any(p.endswith("/" + name) for p in tracked):
                missing.append(f"{doc.relative_to(ROOT)}: {name}")
    assert not missing, "files named in the docs that do not exist:\n" + "\n".join(missing)

def test_checker_finds_a_missing_path(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("see `engine/router.py` and `engine/replica_router.py`, `DIR/out.py`\n")
    names = _named(doc)
    assert names == {"engine/router.py", "engine/replica_router.py"}
    tracked = ["/" + p for p in _tracked()]
    assert not any(p.endswith("/engine/router.py") for p in tracked)
    assert any(p.endswith("/engine/replica_router.py") for p in tracked)
