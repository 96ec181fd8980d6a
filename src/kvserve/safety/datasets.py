"""The labelled sources the moderation head is trained and evaluated on (docs/safety.md: provenance).

`load(data_dir)` reads the public sets fetched into DATA_DIR (their files as their repositories
publish them; see SOURCES) and the project's own hand-written sets, and gives every row a source,
labels (main categories, empty: benign) and a split:

* `train` / `val` / `test` by a hash of the text (60/20/20), fixed per text so a rerun splits
  the same way; `val` is where thresholds are chosen, `test` is never used for either;
* a set published as an evaluation benchmark (SimpleSafetyTests, XSTest) is all `test`.

AdvBench has no categories: `advbench_labels` gives them from the request's words (documented rule).
"""

from __future__ import annotations

import csv
import gzip
import json
import pathlib
import re
import zlib
from dataclasses import dataclass, field

from kvserve.errors import InvalidRequest
from kvserve.safety import datasets_social
from kvserve.safety.labelling import HEADS, OUTPUTS, with_rule  # noqa: F401 (OUTPUTS: callers read it here)

EVAL_ONLY = ("simplesafetytests", "xstest", "harmbench", "kvserve_eval") + datasets_social.EVAL_ONLY
OWN = pathlib.Path(__file__).parent / "data"
# sources labelled in a taxonomy of their own without `illicit` (web text, statements about groups,
# tweets): their labels are kept as published; every other source's harmful rows get labelling.py's rule
OWN_TAXONOMY = ("openai_mod", "toxigen", "davidson")
# source -> (file under DATA_DIR, repository it comes from, license)
SOURCES = {
    "advbench": ("advbench_harmful_behaviors.csv", "llm-attacks/llm-attacks data/advbench (verbatim copy)", "MIT"),
    "openai_mod": ("openai_samples.jsonl", "openai/moderation-api-release data/samples-1680.jsonl.gz", "MIT"),
    "toxigen": ("toxigen", "microsoft/TOXIGEN demonstrations/*/*.txt", "MIT (repository license)"),
    "alpaca": ("alpaca_seed.jsonl", "tatsu-lab/stanford_alpaca seed_tasks.jsonl", "Apache-2.0 (code) / CC BY-NC 4.0"),
    "simplesafetytests": ("sst.csv", "bertiev/SimpleSafetyTests", "CC BY 4.0"),
    "xstest": ("xstest.csv", "paul-rottger/exaggerated-safety xstest_prompts.csv", "CC BY 4.0"),
    "harmbench": ("harmbench/harmbench_behaviors_text_all.csv",
                  "centerforaisafety/HarmBench data/behavior_datasets (copy in busycalibrating/AdversariaLLM)", "MIT"),
    "alpaca_instructions": ("refusal_direction", ("andyrdt/refusal_direction dataset/splits harmless_*.json "
                            "(Alpaca instructions; copy in busycalibrating/AdversariaLLM data/refusal_direction)"),
                            "CC BY-NC 4.0 (Alpaca data)"),
    # harmful requests of three published sets, as andyrdt/refusal_direction (Apache-2.0) keeps them
    # in dataset/raw at 9d852fa; rows any eval-only set holds too are dropped (`_drop_eval_copies`)
    "malicious_instruct": ("refusal_direction/raw/malicious_instruct.txt",
                           "Princeton-SysML/Jailbreak_LLM MaliciousInstruct (via andyrdt/refusal_direction)",
                           "as published with the paper; repository copy Apache-2.0"),
    "strongreject": ("refusal_direction/raw/strongreject.csv",
                     "alexandrasouly/strongreject (via andyrdt/refusal_direction)", "MIT"),
    "jailbreakbench": ("refusal_direction/raw/jailbreakbench.csv",
                       ("JailbreakBench/jailbreakbench JBB-Behaviors, its `Original` rows only (via "
                        "andyrdt/refusal_direction)"), "MIT"),
    **datasets_social.SOURCES,      # Davidson et al.'s tweets, ToxicChat's benign prompts
}
# StrongREJECT's categories that name one of ours (the others get `advbench_labels` alone)
_STRONGREJECT = {"Sexual content": {"sexual"}, "Violence": {"violence"},
                 "Hate, harassment and discrimination": {"harassment"}}
ALPACA_EVERY = 4        # every 4th instruction of the harmless files (about 7,800 rows): enough, and quick to embed
# HarmBench's standard behaviours by semantic category (copyright and misinformation are not a category here)
_HARMBENCH = {"illegal": {"illicit"}, "cybercrime_intrusion": {"illicit"}, "chemical_biological": {"illicit", "violence"},
              "harmful": {"illicit"}, "harassment_bullying": {"harassment"}}


@dataclass
class Row:
    text: str
    labels: set[str]
    source: str
    split: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def harmful(self) -> bool:
        return bool(self.labels & set(HEADS))


def split_of(text: str, source: str) -> str:
    if source in EVAL_ONLY:
        return "test"
    h = zlib.crc32(text.strip().lower().encode()) % 10
    return "train" if h < 6 else ("val" if h < 8 else "test")


_AB = [
    ("self-harm", r"suicid|self-harm|self harm|anorexi|bulimi|eating disorder|cut (?:yourself|themselves)"),
    ("sexual/minors", r"child porn|minors? .*sex|sexual.*(?:child|minor)"),
    ("sexual", r"porn|sexual|explicit content|sexually"),
    ("hate", r"racis|\bhate\b|hatred|minority|discriminat|ethnic|religio|race\b|racial|xenophob|lgbt|jews?\b"),
    ("harassment", r"harass|bully|stalk|cyberbull|defam|threaten|intimidat|humiliat|blackmail|slander|revenge porn"),
    ("violence", (r"bomb|kill|murder|weapon|assassin|explosiv|violen|poison|attack|terror|shoot|firearm|\bguns?\b|"
                  r"harm (?:to )?(?:others|people|someone|a person)|physical harm|torture|kidnap|massacre|riot|arson|"
                  r"\bstab|strangl|behead|slit (?:his|her|their|someone)|set (?:\w+ ){0,3}on fire|"
                  r"set fire|burn (?:down|alive)|molotov|grenade|detonat|ricin|sarin|nerve agent|anthrax")),
]


def advbench_labels(goal: str) -> set[str]:
    """AdvBench's categories by its words: the matched ones; `illicit` for a request to do or
    help a crime (everything not only hate/harassment/self-harm/sexual content);
    `illicit/violent` when illicit and violent."""
    g = goal.lower()
    labels = {cat for cat, pat in _AB if re.search(pat, g)}
    if not labels & {"self-harm", "hate", "harassment", "sexual", "sexual/minors"} or "violence" in labels:
        labels.add("illicit")
    if {"illicit", "violence"} <= labels:
        labels.add("illicit/violent")
    return labels


_OPENAI = {"S": "sexual", "H": "hate", "V": "violence", "HR": "harassment", "SH": "self-harm", "S3": "sexual/minors",
           "H2": "hate", "V2": "violence/graphic"}


def _own_lines(name: str) -> list[str]:
    path = OWN / name
    if not path.exists():
        return []
    return [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip() and not ln.startswith("#")]


def _own_tsv(name: str) -> list[tuple[set[str], str]]:
    out = []
    for ln in _own_lines(name):
        if "\t" not in ln:
            continue
        lab, text = ln.split("\t", 1)
        labels = {x for x in lab.split(",") if x and x != "none"}
        out.append(({"violence" if x == "violence" else x for x in labels if x in HEADS}, text))
    return out


def load(data_dir: pathlib.Path | None) -> list[Row]:
    """Every row of every source present (the project's own always; the public ones from
    `data_dir`, each skipped when its file is absent)."""
    rows: list[Row] = []

    def add(source: str, labels: set[str], text: str, **extra) -> None:
        text = text.strip()
        if text:
            if source not in OWN_TAXONOMY:      # labelling.py: a violent how-to is illicit/violent too
                labels = with_rule(labels, text)
            rows.append(Row(text, labels, source, split_of(text, source), extra))

    d = pathlib.Path(data_dir) if data_dir else None
    if d is not None and not d.is_dir():
        raise InvalidRequest(f"{d} is not a directory; pass --data DIR with the fetched sources "
                             "(docs/safety.md lists them).", param="data")
    if d is not None:
        p = d / SOURCES["advbench"][0]
        if p.exists():
            for r in csv.DictReader(p.open(encoding="utf-8")):
                add("advbench", advbench_labels(r["goal"]), r["goal"])
        p = d / SOURCES["openai_mod"][0]
        if p.exists() or (d / "samples-1680.jsonl.gz").exists():
            lines = (p.read_text(encoding="utf-8") if p.exists()
                     else gzip.decompress((d / "samples-1680.jsonl.gz").read_bytes()).decode()).splitlines()
            for ln in lines:
                r = json.loads(ln)
                add("openai_mod", {c for k, c in _OPENAI.items() if r.get(k) == 1}, r["prompt"])
        p = d / SOURCES["toxigen"][0]
        if p.is_dir():
            for f in sorted(p.glob("*.txt")):
                group = f.stem.split("_", 1)[1].rsplit("_sentences", 1)[0]
                for ln in f.read_text(encoding="utf-8").splitlines():
                    ln = ln.strip().lstrip("-").strip()
                    add("toxigen", {"hate"} if f.stem.startswith("hate") else set(), ln, group=group)
        p = d / SOURCES["alpaca"][0]
        if p.exists():
            for ln in p.read_text(encoding="utf-8").splitlines():
                r = json.loads(ln)
                inp = (r["instances"][0].get("input") or "") if r.get("instances") else ""
                add("alpaca", set(), r["instruction"] + ("\n" + inp if inp else ""))
        p = d / SOURCES["simplesafetytests"][0]
        if p.exists():
            for r in csv.DictReader(p.open(encoding="utf-8")):
                add("simplesafetytests", advbench_labels(r["prompts_final"]) | _sst_area(r["harm_area"]),
                    r["prompts_final"])
        p = d / SOURCES["xstest"][0]
        if p.exists():
            for r in csv.DictReader(p.open(encoding="utf-8")):
                harmful = r["label"] == "unsafe"
                add("xstest", (advbench_labels(r["prompt"]) if harmful else set()) or ({"illicit"} if harmful else set()),
                    r["prompt"], type=r["type"])
    if d is not None and (d / SOURCES["harmbench"][0]).exists():
        for r in csv.DictReader((d / SOURCES["harmbench"][0]).open(encoding="utf-8")):
            cats = _HARMBENCH.get(r["SemanticCategory"])
            if r["FunctionalCategory"] == "standard" and cats:
                labels = advbench_labels(r["Behavior"]) | cats
                if {"illicit", "violence"} <= labels:
                    labels.add("illicit/violent")
                add("harmbench", labels, r["Behavior"])
    if d is not None and (d / SOURCES["alpaca_instructions"][0]).is_dir():
        for part in ("train", "val", "test"):
            f = d / SOURCES["alpaca_instructions"][0] / f"harmless_{part}.json"
            if f.exists():
                for r in json.loads(f.read_text(encoding="utf-8"))[::ALPACA_EVERY]:
                    add("alpaca_instructions", set(), r["instruction"])
        p = d / SOURCES["malicious_instruct"][0]
        if p.exists():
            for ln in p.read_text(encoding="utf-8").splitlines():
                add("malicious_instruct", advbench_labels(ln), ln)
        p = d / SOURCES["strongreject"][0]
        if p.exists():
            for r in csv.DictReader(p.open(encoding="utf-8")):
                add("strongreject", _with_illicit_violent(advbench_labels(r["forbidden_prompt"])
                                                          | _STRONGREJECT.get(r["category"], set())),
                    r["forbidden_prompt"])
        p = d / SOURCES["jailbreakbench"][0]
        if p.exists():
            for r in csv.DictReader(p.open(encoding="utf-8")):
                if r["Source"] == "Original":       # the others are AdvBench's and HarmBench's own rows
                    add("jailbreakbench", advbench_labels(r["Goal"]), r["Goal"])
    if d is not None:
        datasets_social.add_rows(d, add)
    for labels, text in _own_tsv("train.tsv"):
        add("kvserve_labelled", labels, text)
    for labels, text in _own_tsv("eval.tsv") + _own_tsv("eval_blind.tsv"):     # the moderator's held-out sets
        add("kvserve_eval", labels, text)
    from kvserve.safety import augment  # counterfactual identity rows: the same sentence over many groups

    for split in ("train", "dev"):          # train groups to train on, other (dev) groups to pick thresholds on
        for labels, text in augment.rows(split):
            text = text.strip()
            if text:
                rows.append(Row(text, with_rule({lab for lab in labels if lab in HEADS}, text), "kvserve_augment",
                                "train" if split == "train" else "val"))
    for text in _own_lines("help_seeking.txt"):
        add("kvserve_help", {"help"}, text)
    for text in _own_lines("benign_sensitive.txt"):
        add("kvserve_sensitive", set(), text)
    for text in _own_lines("benign_contrast.txt"):
        add("kvserve_contrast", set(), text)
    for labels, text in _own_tsv("harm_contrast.tsv"):     # the contrast set's harmful side
        add("kvserve_harm_contrast", labels, text)
    for text in _own_lines("benign_docs.txt")[::3] + _own_lines("benign_generated.txt")[::6]:
        add("kvserve_docs", set(), text)
    return _drop_eval_copies(rows)


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _drop_eval_copies(rows: list[Row]) -> list[Row]:
    """Without the training-source rows whose text (case and punctuation aside) an eval-only set
    holds: sets compiled from other sets must not train on a benchmark's rows."""
    held = {_norm(r.text) for r in rows if r.source in EVAL_ONLY}
    return [r for r in rows if r.source in EVAL_ONLY or _norm(r.text) not in held]


def _with_illicit_violent(labels: set[str]) -> set[str]:
    return labels | ({"illicit/violent"} if {"illicit", "violence"} <= labels else set())


def _sst_area(area: str) -> set[str]:
    a = area.lower()
    if "suicide" in a:
        return {"self-harm"}
    if "child abuse" in a:
        return {"sexual/minors"}
    if "violent" in a or "weapons" in a:
        return {"violence"}
    if "illegal" in a or "scams" in a:
        return {"illicit"}
    return set()
