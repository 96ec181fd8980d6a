"""`kvserve eval moderation FILE.jsonl`: check a moderation config on a labelled set before deploying it
(the report is safety/bias.py's: false-positive rate, recall per category, Jigsaw bias AUCs per group)."""

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
) -> None:
    """False-positive rate, recall per category and bias AUCs of moderation on a labelled JSONL."""
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
