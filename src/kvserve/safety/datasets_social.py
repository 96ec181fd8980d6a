"""Public sources of social-media and chatbot text (issue 59, 2026-11-29): datasets.py calls `add_rows`.

* **davidson** (t-davidson/hate-speech-and-offensive-language, `data/labeled_data.csv`, MIT):
  tweets coded by three or more CrowdFlower workers as hate speech, offensive language or neither.
  A tweet at least two thirds of its coders called hate speech is `hate`; one at least two thirds
  called neither, and nobody hate speech, is benign (every DAVIDSON_BENIGN_EVERY-th, to keep the
  set small). "Offensive language" that is not hate is left out: OpenAI's taxonomy has no
  profanity category (its sample set's benign rows hold swearing and crude talk), but an insult
  aimed at a person is `harassment` there, and the coders' "offensive" mixes the two.
* **toxicchat** (lmsys/toxic-chat, human-annotated rows as dmg-illc/JUDGE-BENCH keeps them in
  `data/toxic_chat/`, CC BY-NC 4.0): real prompts to a chatbot. Its `toxicity` is not our
  harm (it counts "tell me a joke about a girl" and a swear word in a label), so only the
  non-toxic, non-jailbreak prompts are used, as benign: those of its train file split like any
  source, every TOXICCHAT_EVAL_EVERY-th of its test file (the benchmark's own test split)
  evaluation-only (`toxicchat_eval`). A prompt longer than TOXICCHAT_MAX_CHARS is left out (role-play set-ups of
  pages; few, and slow to embed).
"""

from __future__ import annotations

import csv
import json
import pathlib
from collections.abc import Callable

DAVIDSON = "davidson/labeled_data.csv"
TOXICCHAT = "toxic_chat/toxic_chat_{part}.json"
DAVIDSON_BENIGN_EVERY = 2
TOXICCHAT_MAX_CHARS = 2000
TOXICCHAT_EVAL_EVERY = 2        # every 2nd benign prompt of the test file: about 1,200, enough for a false-positive rate
# source -> (file under DATA_DIR, repository it comes from, license)
SOURCES = {
    "davidson": (DAVIDSON, "t-davidson/hate-speech-and-offensive-language data/labeled_data.csv", "MIT"),
    "toxicchat": (TOXICCHAT.format(part="train"),
                  "lmsys/toxic-chat toxicchat0124 (human-annotated rows, copy in dmg-illc/JUDGE-BENCH)",
                  "CC BY-NC 4.0"),
    "toxicchat_eval": (TOXICCHAT.format(part="test"),
                       "lmsys/toxic-chat toxicchat0124 test split (copy in dmg-illc/JUDGE-BENCH)", "CC BY-NC 4.0"),
}
# Davidson's tweets are evaluation-only: a head trained on them too lost ToxiGen's implicit hate
# (test F1 0.673 -> 0.544; BENCHMARKS.md, issue 59, "data and thresholds")
EVAL_ONLY = ("davidson", "toxicchat_eval")


def _tweet(text: str) -> str:
    """The tweet with its HTML escapes decoded (what a reader sees)."""
    return (text.replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">").replace("&#8220;", '"')
            .replace("&#8221;", '"').replace("&#8217;", "'"))


def add_rows(d: pathlib.Path, add: Callable[..., None]) -> None:
    """Call `add(source, labels, text)` for every row of the sources above present under `d`."""
    p = d / DAVIDSON
    if p.exists():
        benign = 0
        for r in csv.DictReader(p.open(encoding="utf-8")):
            n, hate, neither = int(r["count"]), int(r["hate_speech"]), int(r["neither"])
            if 3 * hate >= 2 * n:
                add("davidson", {"hate"}, _tweet(r["tweet"]))
            elif 3 * neither >= 2 * n and hate == 0:
                benign += 1
                if benign % DAVIDSON_BENIGN_EVERY == 0:
                    add("davidson", set(), _tweet(r["tweet"]))
    for part, source in (("train", "toxicchat"), ("test", "toxicchat_eval")):
        p = d / TOXICCHAT.format(part=part)
        if not p.exists():
            continue
        kept = 0
        for inst in json.loads(p.read_text(encoding="utf-8"))["instances"]:
            a = inst["annotations"]
            text = inst["instance"]
            if (a["toxicity"]["majority_human"] == "0" and a["jailbreaking"]["majority_human"] == "0"
                    and len(text) <= TOXICCHAT_MAX_CHARS):
                kept += 1
                if part == "train" or kept % TOXICCHAT_EVAL_EVERY == 0:
                    add(source, set(), text)
