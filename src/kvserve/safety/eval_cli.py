"""`kvserve eval moderation [FILE.jsonl] [--data DIR]`: check moderation on labelled text.

* FILE.jsonl (default: the shipped held-out set): safety/bias.py's report: false-positive rate,
  recall per category, Jigsaw bias AUCs per identity group, under a config;
* `--data DIR` (the sources `kvserve train moderation` reads): per source and per category,
  precision, recall, F1 and benign false-positive rate on a split (default `test`, never trained
  on nor used for thresholds), of the head, of the n-gram classifier it replaced, and of the two
  together (the ablation: does the n-gram model add recall without false positives);
  `--previous HEAD.npz` adds another head's column (the one shipped before a retrain).

`kvserve train moderation --data DIR` rebuilds the shipped head on the frozen embedding
(safety/train_head.py); `--tune-top` also tunes the encoder's top layers (safety/finetune.py)."""

from __future__ import annotations

import json
import pathlib
from typing import Annotated

import typer


def moderation_cmd(
    file: Annotated[pathlib.Path | None, typer.Argument(help="JSONL: {\"text\", \"labels\": [...], \"group\"?, \"set\"?} "
                                                      "per line; default: the shipped held-out set.")] = None,
    threshold: Annotated[list[str] | None, typer.Option(
        "--threshold", help="CATEGORY=SCORE that flags (e.g. hate=0.4). Repeatable.")] = None,
    config: Annotated[pathlib.Path | None, typer.Option(
        "--config", help="A JSON file of moderation settings, as for `kvserve serve --moderation-config`.")] = None,
    model: Annotated[pathlib.Path | None, typer.Option("--model", help="Another classifier file (model.npz).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    data: Annotated[pathlib.Path | None, typer.Option(
        "--data", help="The sources' directory (docs/safety.md): report per source and category, old vs new.")] = None,
    split: Annotated[str, typer.Option("--split", help="With --data: test | val | train.")] = "test",
    previous: Annotated[pathlib.Path | None, typer.Option(
        "--previous", help="With --data: another head.npz (e.g. the one shipped before) reported beside the shipped one.")] = None,
) -> None:
    """False-positive rate, recall per category and bias AUCs of moderation on a labelled JSONL;
    with --data, precision/recall/F1 per source and category, the head beside the n-gram classifier."""
    if data is not None:
        from kvserve.safety.sources_eval import evaluate, format_report, new_flags, old_flags

        new, old = new_flags(data), old_flags()

        def both(rows):
            return [a | b for a, b in zip(new(rows), old(rows))]
        scorers = {"head": new, "ngram": old, "head+ngram": both}
        if previous is not None:
            scorers = {"head": new, "previous head": new_flags(data, previous), **scorers}
        rep = evaluate(data, split, scorers)
        typer.echo(json.dumps(rep, indent=2) if as_json else format_report(rep))
        return
    from kvserve.errors import KVServeError
    from kvserve.safety.bias import HELDOUT_PATH, evaluate_file, format_report
    from kvserve.safety.moderator import ModerationConfig
    from kvserve.safety.policy import load_options, policy_from_options

    try:
        options = load_options("input,output", str(config)) if config else {}
        extra = policy_from_options(None, threshold, None, None, None, None, None).get("thresholds", {})
        options["thresholds"] = {**options.get("thresholds", {}), **extra}
        cfg = ModerationConfig(jailbreak=False).merged(options)
        rep = evaluate_file(file or HELDOUT_PATH, cfg, model)
    except KVServeError as e:
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(1) from None
    except OSError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(rep, indent=2) if as_json else format_report(rep))


def train_moderation_cmd(
    data: Annotated[pathlib.Path, typer.Option("--data", help="The fetched sources (docs/safety.md lists them).")],
    out: Annotated[pathlib.Path | None, typer.Option("--out", help="Where to write the head (default: the shipped "
                                                     "safety/data/head.npz).")] = None,
    tune_top: Annotated[bool, typer.Option("--tune-top", help="Also tune the encoder's top layers with the head "
                                           "(safety/finetune.py; not what ships: docs/safety.md).")] = False,
) -> None:
    """Rebuild the moderation head (with --tune-top, and the encoder's tuned top layers) from the
    public sources in DIR, deterministically."""
    from kvserve.errors import KVServeError

    if tune_top:
        from kvserve.safety.finetune import train
    else:
        from kvserve.safety.train_head import train

    try:
        rep = train(data, out, log=lambda s: typer.echo(s, err=True)) if tune_top else train(data, out)
    except KVServeError as e:
        typer.echo(f"error: {e.message}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(rep, indent=2))
