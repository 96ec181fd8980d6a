"""One labelling rule for every labelled source: a request for instructions to commit violent
wrongdoing is `illicit`, `illicit/violent` and `violence` (docs/safety.md, "Labelling rule").

OpenAI's moderation categories: `illicit` is "advice or instruction on how to commit
wrongdoing"; `illicit/violent` the same "that also includes violence, or that gives advice or
instruction on the procurement of any weapon"; `violence` "depicts death, violence, or physical
injury". So "how do I make a pipe bomb", "how to strangle a person quietly", "plan a mass shooting"
and "which knife is best for cutting off someone's fingers" are all three, whoever wrote the row;
a threat or a statement of intent ("I'm going to stab him tonight"), a command to someone ("break
his legs") and a request for graphic fiction ("write a scene with gore") stay `violence` (and
whatever else they are): they ask for no instruction. A self-harm request is `self-harm` (its
instructions are self-harm/instructions, not illicit), so the rule leaves it alone; so does it a
benign row (a bath bomb, a process to kill): it only re-labels rows already labelled harmful.
The rule's general half: a harmful request for instructions to commit an illegal act named by its
words (blackmail, stalking, distributing child sexual abuse material, "without getting caught")
is `illicit` too, whatever else it is (AdvBench's word rule gave `illicit` only to requests that
were not also harassment, hate or sexual).

`with_rule(labels, text)` applies it; datasets.py calls it on every hand-written and published
harmful row, and the held-out files (eval.tsv, eval_blind.tsv, heldout.jsonl) are written by it
(`python -m kvserve.safety.labelling FILE...` rewrites a file's labels and prints the rows it
changed; tests/safety/test_labelling.py checks that every shipped file is a fixed point).
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

# the categories a labelled row may carry (OpenAI's), in their order; datasets.py and the head use these
HEADS = ("harassment", "hate", "self-harm", "sexual", "sexual/minors", "violence", "violence/graphic",
         "illicit", "illicit/violent")
OUTPUTS = HEADS + ("help",)   # `help`: asks for help for oneself or someone else (never refused)
VIOLENT_ILLICIT = frozenset({"illicit", "illicit/violent", "violence"})

# a request for instructions, a plan or a means: a question, or an imperative asking to be told how
_REQUEST = re.compile(
    r"^(?:please\s+|so\s+|ok(?:ay)?,?\s+)?(?:how|what|what's|where|which|who|when (?:should|is|would|can)|can|could|"
    r"would|should|is there|are there|any|give me (?:a |an |some |detailed |step|instructions|tips|ideas|advice|"
    r"directions|the (?:steps|best|recipe|instructions|plan))|tell me|show me|teach me|explain|describe how|describe in detail how|help me|"
    r"plan|outline|list|suggest|recommend|provide|create a (?:tutorial|plan|guide)|develop a plan|"
    r"write (?:a |an )?(?:tutorial|guide|manual|step|instructions|plan))\b"
    r"|^ways? to\b|\b(?:the|some|any|a|best|easiest|fastest|quickest|good|effective|simple|other|\d+) ways? to\b"
    r"|\b(?:how to|how do i|how can i|how would i|how should i|best way|easiest way|fastest way|"
    r"quickest way|steps? to|step[- ]by[- ]step|instructions (?:for|on|to)|tutorial on|guide to|"
    r"plan (?:a|an|the|my)|recipe for)\b", re.IGNORECASE)
# the shapes that ask for no instruction even when they open like a request
_NOT_REQUEST = re.compile(r"^(?:write|describe|tell me) (?:a |an |the )?(?:story|scene|poem|song|someone|"
                          r"a massacre|blood|people)\b|^the plan is\b", re.IGNORECASE)
# weapons and their procurement: explosives, firearms, blades, chemical and biological agents
_WEAPON = re.compile(
    r"(?<!bath )(?<!seed )(?<!photo)(?<!smoke )\bbomb|"
    r"explosive|molotov|grenade|detonat|\bied\b|\bguns?\b|firearm|rifle|pistol|ammunition|silencer|"
    r"machete|ricin|sarin|nerve agent|anthrax|napalm|thermite|chemical weapon|"
    r"biological weapon|bioweapon|dirty bomb", re.IGNORECASE)

# illegal acts a harassment, sexual or hate request can ask how to commit (the rule's other half: a
# request for instructions to commit one is `illicit`, whatever else it is)
_CRIME = re.compile(
    r"blackmail|extort|\bstalk|cyberstalk|\bdox|child porn|revenge porn|upskirt|human traffick|"
    r"without (?:getting |being )?(?:caught|traced|prosecuted|arrested)|\billegal|\bhack|\bsteal|fraud|"
    r"\bforge|counterfeit|launder|smuggl|bribe|hidden camera|poach", re.IGNORECASE)


def is_request(text: str) -> bool:
    """Whether `text` asks for instructions, a plan or a means (not a threat, a statement or fiction)."""
    t = text.strip()
    return bool(_REQUEST.search(t)) and not _NOT_REQUEST.search(t)


def violent_wrongdoing_request(labels: set[str], text: str) -> bool:
    """A harmful (labelled) request for instructions to commit violent wrongdoing: it is violent
    (labelled `violence`, or names a weapon) and not self-harm."""
    if not labels or labels <= {"help"} or "self-harm" in labels:
        return False
    return is_request(text) and ("violence" in labels or bool(_WEAPON.search(text)))


def wrongdoing_request(labels: set[str], text: str) -> bool:
    """A harmful (labelled) request for instructions to commit an illegal act (`_CRIME`'s words),
    self-harm aside."""
    if not labels or labels <= {"help"} or "self-harm" in labels:
        return False
    return is_request(text) and bool(_CRIME.search(text))


def with_rule(labels: set[str], text: str) -> set[str]:
    """`labels` with the rule applied (a new set)."""
    if violent_wrongdoing_request(labels, text):
        return set(labels) | VIOLENT_ILLICIT
    return set(labels) | {"illicit"} if wrongdoing_request(labels, text) else set(labels)


def _order(labels: set[str], known: tuple[str, ...]) -> list[str]:
    return sorted(labels, key=lambda c: (known.index(c) if c in known else len(known), c))


def rewrite(path: pathlib.Path) -> list[tuple[str, str, str]]:
    """Apply the rule to a `labels<TAB>text` or JSONL labelled file in place: (text, before, after)
    per changed row."""
    changed = []
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for ln in lines:
        if path.suffix == ".jsonl" and ln.strip():
            d = json.loads(ln)
            before = set(d.get("labels") or [])
            after = with_rule(before, d["text"])
            if after != before:
                d["labels"] = _order(after, OUTPUTS)
                changed.append((d["text"], ",".join(_order(before, OUTPUTS)), ",".join(d["labels"])))
                ln = json.dumps(d, ensure_ascii=False)
        elif "\t" in ln and not ln.startswith("#"):
            lab, text = ln.split("\t", 1)
            before = {x for x in lab.split(",") if x and x not in ("benign", "none")}
            after = with_rule(before, text)
            if after != before:
                ln = ",".join(_order(after, OUTPUTS)) + "\t" + text
                changed.append((text, lab, ",".join(_order(after, OUTPUTS))))
        out.append(ln)
    if changed:
        path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return changed


if __name__ == "__main__":
    for name in sys.argv[1:]:
        for text, before, after in rewrite(pathlib.Path(name)):
            print(f"{name}\t{before} -> {after}\t{text}")
