"""`kvserve data clean`: raw crawl → training text, streaming, on every core.

    readers (main) ──batches──▶ workers: extract → language → quality → PII → digest + MinHash
                                         │
    DIR/part-00000.jsonl ◀── dedup (main: exact digests, MinHash LSH) ◀──┘

The main process reads one batch ahead while the pool works on the current one, so memory is
bounded by two batches plus the dedup index. Output: `DIR/part-NNNNN.jsonl` (one
{"text", "source"} per line, `shard_docs` per file) and `DIR/report.json` (documents in, kept,
dropped per rule, PII found, languages, throughput). `kvserve train tokenizer/pretrain
--corpus DIR` read the JSONL files directly.
"""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

from kvserve.data.dedup import Deduplicator
from kvserve.data.quality import CleanConfig, process_batch
from kvserve.data.readers import input_files, iter_documents
from kvserve.errors import InvalidRequest


@dataclass
class CleanJob:
    inputs: list[str]
    out: str
    config: CleanConfig = field(default_factory=CleanConfig)
    dedup_threshold: float = 0.5
    workers: int = 0                  # 0 = every core
    batch_size: int = 256
    shard_docs: int = 100_000
    progress: bool = True


class _ShardWriter:
    def __init__(self, out: Path, shard_docs: int):
        self.out, self.shard_docs = out, shard_docs
        self.count, self.file = 0, None

    def write(self, text: str, source: str) -> None:
        if self.count % self.shard_docs == 0:
            self.close()
            self.file = (self.out / f"part-{self.count // self.shard_docs:05d}.jsonl").open("w", encoding="utf-8")
        self.file.write(json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n")
        self.count += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def _batches(files: list[Path], size: int) -> Iterator[list[tuple[str, str, bool]]]:
    docs = ((d.payload, d.source, d.is_html) for d in iter_documents(files))
    while batch := list(islice(docs, size)):
        yield batch


def clean(job: CleanJob) -> dict:
    """Run the pipeline; returns the report (also written to DIR/report.json)."""
    if not 0 < job.dedup_threshold <= 1:
        raise InvalidRequest("the near-duplicate threshold is a Jaccard similarity in (0, 1]", param="threshold")
    if job.workers < 0:
        raise InvalidRequest("--workers is 0 (every core) or a positive number", param="workers")
    if job.config.lang:
        from lingua import Language

        known = {lang.iso_code_639_1.name.lower() for lang in Language.all()}
        if bad := [x for x in job.config.lang if x not in known]:
            raise InvalidRequest(f"unknown language code(s) {', '.join(bad)}: use ISO 639-1 codes such as en, de, fr",
                                 param="lang")
    files = input_files(job.inputs)
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*.jsonl"):
        old.unlink()
    workers = job.workers or os.cpu_count() or 1
    dedup = Deduplicator(job.dedup_threshold, job.config.num_perm)
    writer = _ShardWriter(out, job.shard_docs)
    dropped: Counter = Counter()
    pii: Counter = Counter()
    langs: Counter = Counter()
    n_in = 0
    t0 = time.perf_counter()
    work = functools.partial(process_batch, cfg=job.config)
    progress = _progress(job.progress)

    def consume(results: list[dict]) -> None:
        nonlocal n_in
        for r in results:
            n_in += 1
            if r.get("lang"):
                langs[r["lang"]] += 1
            reason = r.get("drop") or dedup.check(r["digest"], r["minhash"])
            if reason:
                dropped[reason] += 1
                continue
            pii.update(r["pii"])
            writer.write(r["text"], r["source"])
        if progress is not None:
            progress.update(progress.task_ids[0], completed=n_in,
                            info=f"kept {writer.count}  {n_in / (time.perf_counter() - t0):.0f} docs/s")

    try:
        if workers == 1:
            for batch in _batches(files, job.batch_size):
                consume(work(batch))
        else:
            # spawn: workers import only kvserve.data (no torch), and no lock is inherited mid-use
            with mp.get_context("spawn").Pool(workers) as pool:
                pending: list = []
                for batch in _batches(files, job.batch_size):
                    pending.append(pool.apply_async(work, (batch,)))
                    if len(pending) > 2 * workers:         # bounded look-ahead: constant memory
                        consume(pending.pop(0).get())
                for p in pending:
                    consume(p.get())
    finally:
        writer.close()
        if progress is not None:
            progress.stop()
    seconds = time.perf_counter() - t0
    report = {"documents_in": n_in, "kept": writer.count, "dropped": dict(sorted(dropped.items())),
              "pii_scrubbed": dict(sorted(pii.items())), "languages": dict(langs.most_common()),
              "seconds": round(seconds, 3), "docs_per_s": round(n_in / seconds, 1) if seconds else None,
              "workers": workers, "inputs": [str(f) for f in files],
              "config": {**asdict(job.config), "dedup_threshold": job.dedup_threshold}}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _progress(enabled: bool):
    if not enabled:
        return None
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    p = Progress(SpinnerColumn(), TextColumn("[bold]clean"), TextColumn("{task.completed} docs"),
                 TextColumn("{task.fields[info]}"), TimeElapsedColumn())
    p.add_task("clean", total=None, info="")
    p.start()
    return p
