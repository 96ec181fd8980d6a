"""`kvserve data clean INPUT... --out DIR`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvserve.cli_errors import user_errors

data_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Prepare training data.")


@data_app.command("clean")
def clean_cmd(
    inputs: Annotated[list[str], typer.Argument(help="WARC/WET (.gz), HTML, JSONL (.gz) or text files, "
                                                     "or directories of them.")],
    out: str = typer.Option(..., "--out", help="Output directory: part-*.jsonl and report.json."),
    lang: Annotated[list[str] | None, typer.Option(
        "--lang", help="Keep only this language (ISO 639-1, e.g. en); repeatable. Default: every language.")] = None,
    min_words: int = typer.Option(50, "--min-words"),
    max_words: int = typer.Option(100_000, "--max-words"),
    threshold: float = typer.Option(0.5, "--threshold", help="Near-duplicate Jaccard similarity (MinHash LSH)."),
    no_pii: bool = typer.Option(False, "--no-pii", help="Keep e-mails, phone numbers, IPs as they are."),
    workers: int = typer.Option(0, "--workers", help="Worker processes; 0 = every core."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Extract main text, identify the language, filter quality, deduplicate, scrub PII."""
    from kvserve.data.clean import CleanJob, clean
    from kvserve.data.quality import CleanConfig

    cfg = CleanConfig(lang=tuple(x.lower() for x in lang or ()), min_words=min_words, max_words=max_words,
                      scrub_pii=not no_pii)
    with user_errors():
        report = clean(CleanJob(inputs=inputs, out=out, config=cfg, dedup_threshold=threshold, workers=workers,
                                progress=progress))
    typer.echo(json.dumps({k: report[k] for k in ("documents_in", "kept", "dropped", "docs_per_s")}, indent=2))
