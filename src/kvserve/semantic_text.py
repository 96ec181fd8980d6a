"""The semantic cache's text rules: normalization, the exact-facts guard, creative prompts.

Cosine similarity of sentence embeddings cannot tell "the capital of France" from "the capital of
Spain" (0.9+) or "2+2" from "2+3": the vectors are about the topic, not the facts. So a hit needs,
beside cosine >= threshold, the same *facts*: `facts(text)` is the ordered numbers (digits and
number words), the arithmetic operators (symbols and words), the names (capitalized words that are
not common words, and all-caps acronyms), whether the text negates, and its units of measure when
it has a number ("50 feet in meters" vs "50 miles in kilometers"). Two queries whose facts
differ never share an answer; the unit right after a number is a fact of its own ("10 miles to
kilometers" and "10 kilometers to miles" share their units, not their question). What remains uncovered (documented in docs/models.md): names typed
in lowercase, and antonyms ("largest" / "smallest") that the embedding itself must separate.

`split_query` keeps long shared text out of the comparison: a message is cut into its *context*
(documents, code, passages, every paragraph but one) and its *question* (the short last paragraph,
else the short first one). Only the question is compared by meaning; the context must match
exactly (the cache hashes it into the partition). A wrong split only costs hits, never a wrong
match: whatever is not the question is compared byte for byte.

`normalize` strips what does not change a question (case, spacing, contractions, polite
fillers) before the embedding, which brings true paraphrases closer together.
`is_creative` is a rule set (poems, stories, jokes, ...): creative requests want a new answer
every time and bypass the cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
          "seventeen eighteen nineteen twenty")
NUMBER_WORDS = {w: str(i) for i, w in enumerate(_UNITS.split())}
NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80",
                     "ninety": "90", "hundred": "100", "thousand": "1000", "million": "1000000",
                     "half": "0.5", "dozen": "12"})
OPERATOR_WORDS = {"plus": "+", "add": "+", "added": "+", "sum": "+", "minus": "-", "subtract": "-",
                  "subtracted": "-", "times": "*", "multiplied": "*", "multiply": "*", "product": "*",
                  "divided": "/", "divide": "/", "squared": "^2", "cubed": "^3", "power": "^",
                  "percent": "%"}
# Units of measure: "50 feet in meters" and "50 miles in kilometers" share their numbers, not their question.
_UNIT_WORDS = """mile kilometer km meter metre m centimeter centimetre cm millimeter millimetre mm inch foot yard
pound lb kilogram kg gram g ounce oz ton tonne gallon liter litre l milliliter millilitre ml cup pint quart
second sec minute min hour hr day week month year decade century celsius fahrenheit kelvin degree acre hectare
mph kph byte kilobyte megabyte gigabyte terabyte bit calorie joule watt volt dollar euro yen"""
UNITS = set(_UNIT_WORDS.split())
IRREGULAR_UNITS = {"feet": "foot", "inches": "inch", "centuries": "century"}
NEGATIONS = {"not", "no", "never", "none", "nothing", "neither", "nor", "without", "cannot"}
# Capitalized words that are not names: sentence starters, question words, pronouns, fillers.
_COMMON = """a an the i i'm i've i'd i'll me my we our you your he she it they them their this that these those
what what's whats which who whom whose when where why how is are was were be been do does did can could would
should will shall may might must tell give show explain describe list name define please hey hi hello ok okay so
and or but if then also just quick quickly briefly in on at of for to from by with about as into per is it's
there here let let's find get help need want know any some all each every one many much more most few other
yes no not sure thanks thank again now today still"""
COMMON = set(_COMMON.split())
CONTRACTIONS = [(r"\bwhat's\b", "what is"), (r"\bwhere's\b", "where is"), (r"\bwho's\b", "who is"),
                (r"\bhow's\b", "how is"), (r"\bit's\b", "it is"), (r"\bthat's\b", "that is"),
                (r"\bcan't\b", "cannot"), (r"\bwon't\b", "will not"), (r"n't\b", " not"), (r"\bi'm\b", "i am")]
# Question framing that does not change what is asked: "what is", "tell me", "how can I", "calculate".
FRAMING = re.compile(
    r"^(?:(?:what|which|who|where|when)(?: is| are| was| were)?(?: the)?(?: way| best way)?(?: to)?|"
    r"(?:tell|show|give) me(?: how to| the| what)?|(?:please )?name(?: the)?|calculate|compute|"
    r"how (?:do|can|should|would) (?:i|you|we)|how to|how much is|i need to know)\b\s*")
FILLERS = [r"^(hey|hi|hello|ok|okay|so)\b[,!.]?\s*", r"\bplease\b", r"^(can|could|would) you( please)? (tell me|say)\b",
           r"^(tell me|i want to know|i'd like to know|i would like to know|do you know|quick question:?)\b",
           r"\bthanks?( you)?\b[.!]?$"]
CREATIVE = re.compile(
    r"\b(poems?|poetry|haikus?|limericks?|sonnets?|verses?|rhymes?|lyrics|song|stor(y|ies)|tales?|fables?|jokes?|"
    r"fiction|novel|screenplay|script|dialogue|roleplay|role-play|pretend|imagine|brainstorm|creative|"
    r"invent|slogan|riddle|pun)\b", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]*|\d+(?:[.,]\d+)*|[+\-*/^=%×÷]")


@dataclass(frozen=True)
class Facts:
    numbers: tuple[str, ...]
    operators: tuple[str, ...]
    names: frozenset[str]
    negated: bool
    units: frozenset[str] = frozenset()
    measured: frozenset[str] = frozenset()    # the units right after a number: what the quantity is in

    @property
    def arithmetic(self) -> bool:
        """Two or more numbers and an operator, nothing else: the facts *are* the question."""
        return len(self.numbers) >= 2 and bool(self.operators) and not self.names

    def key(self) -> str:
        return "|".join([",".join(self.numbers), ",".join(self.operators), ",".join(sorted(self.names)),
                         "neg" if self.negated else "", ",".join(sorted(self.units)), ",".join(sorted(self.measured))])


QUESTION_WORDS = 40       # a question is at most this many words (longer text is context)
_FENCE = re.compile(r"```.*?(?:```|$)", re.DOTALL)
_PARA = re.compile(r"\n\s*\n")


def _blocks(text: str) -> list[str]:
    """Paragraphs (blank-line separated; a fenced code block is one, whatever it holds); one
    paragraph of several lines is cut into its lines."""
    fences: list[str] = []

    def hide(m: re.Match) -> str:
        fences.append(m.group())
        return f"\x00{len(fences) - 1}\x00"

    hidden = _FENCE.sub(hide, text.strip())
    parts = [b.strip() for b in _PARA.split(hidden) if b.strip()]
    if len(parts) == 1:
        parts = [b.strip() for b in parts[0].split("\n") if b.strip()]
    return [re.sub("\x00(\\d+)\x00", lambda m: fences[int(m.group(1))], b) for b in parts]


def _short(block: str) -> bool:
    return "```" not in block and "\x00" not in block and len(block.split()) <= QUESTION_WORDS


def split_query(text: str) -> tuple[str, str]:
    """(context, question): the question is the text itself when it is one short line, else its short last
    paragraph, else its short first one; the context is everything else, as written (compared
    exactly). No short paragraph at either end: all context, question ""."""
    blocks = _blocks(text)
    if len(blocks) < 2:
        return ("", text.strip()) if _short(text) else (text.strip(), "")
    i = len(blocks) - 1 if _short(blocks[-1]) else 0 if _short(blocks[0]) else None
    return "\n\n".join(b for j, b in enumerate(blocks) if j != i), ("" if i is None else blocks[i])


def normalize(text: str) -> str:
    """What the embedding sees: lower case, one space, contractions expanded, polite fillers gone."""
    t = " ".join(text.lower().split())
    for pat, rep in CONTRACTIONS:
        t = re.sub(pat, rep, t)
    for pat in FILLERS:
        t = re.sub(pat, "", t).strip(" ,")
    t = FRAMING.sub("", t).strip(" ,?.!:")
    return t or " ".join(text.lower().split())


def facts(text: str) -> Facts:
    """The facts two queries must share exactly to share an answer (see the module's docstring)."""
    numbers, operators, names, negated, units, measured = [], [], set(), False, set(), set()
    after_number = False
    text = re.sub(r"(?<=\d)\s*[xX]\s*(?=\d)", " * ", text)
    starts = {m.end() for m in re.finditer(r"(^|[.!?:;]\s+|\n)\s*", text)}
    for m in _WORD.finditer(text):
        w = m.group()
        low = w.lower()
        was_after, after_number = after_number, w[0].isdigit() or low in NUMBER_WORDS
        if w[0].isdigit():
            numbers.append(w.replace(",", ""))
        elif low in NUMBER_WORDS:
            numbers.append(NUMBER_WORDS[low])
        elif w in "+-*/^=%×÷":
            operators.append({"×": "*", "÷": "/"}.get(w, w))
        elif low in OPERATOR_WORDS:
            operators.append(OPERATOR_WORDS[low])
        elif low in NEGATIONS or low.endswith("n't"):
            negated = True
        elif low in UNITS or low in IRREGULAR_UNITS or (low.endswith("s") and low[:-1] in UNITS):
            units.add(low if low in UNITS else IRREGULAR_UNITS.get(low, low[:-1]))
            if was_after:        # "10 miles to kilometers" is not "10 kilometers to miles"
                measured.add(low if low in UNITS else IRREGULAR_UNITS.get(low, low[:-1]))
        elif (w[0].isupper() and low not in COMMON and m.start() not in starts) or \
                (len(w) > 1 and w.isupper() and low != "i"):
            names.add(re.sub(r"'s$", "", low))
    # units count only beside a number ("what year did X die" names no quantity)
    return Facts(tuple(numbers), tuple(sorted(o for o in operators if o != "=")), frozenset(names), negated,
                 frozenset(units) if numbers else frozenset(), frozenset(measured))


def is_creative(text: str) -> bool:
    return CREATIVE.search(text) is not None
