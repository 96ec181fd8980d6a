"""Tasks with verifiable rewards for GRPO: problems, a checker, and (for the thinking task) SFT traces.

    arithmetic   "What is 3+4?"          reward 1 if the first integer in the reply is 7
    repeat       "Repeat the word: stone"  reward 1 if the reply's first word is "stone"
    think        "What is 3+4+5?"        the reply must be `<think>...</think> answer`: reward 1 when the
                                         format holds and the first integer after </think> is right,
                                         0.1 for the format alone, 0 otherwise
    think-mul    "What is 3*4+5*2?"      the same check; products then their sum, where working it out
                                         step by step pays (a small model's direct answers are mostly
                                         wrong, its worked ones mostly right)

`accuracy` is the fraction of replies with reward 1 (for `think`: right answer *and* format).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

WORDS = ("apple river stone light house water bread night sword cloud field horse king gold tree fire "  # noqa: SIM905
         "bird ship road moon star rain snow wind sand salt milk door wall bell").split()
THINK_RE = re.compile(r"^\s*<think>(.*?)</think>(.*)$", re.DOTALL)
THINK_INSTRUCTION = "Think inside <think></think>, then give the answer."


@dataclass
class ArithmeticTask:
    """'What is 3+4?' -> reward 1 if the first integer in the reply is exactly 7, else 0."""

    max_operand: int = 9
    ops: str = "+"

    def problems(self) -> list[tuple[str, str]]:
        out = []
        for a in range(self.max_operand + 1):
            for b in range(self.max_operand + 1):
                for op in self.ops:
                    ans = {"+": a + b, "-": a - b, "*": a * b}[op]
                    out.append((f"What is {a}{op}{b}?", str(ans)))
        return out

    @staticmethod
    def reward(completion: str, answer: str) -> float:
        m = re.search(r"-?\d+", completion)
        return float(m is not None and m.group() == answer)


@dataclass
class ThinkingArithmeticTask:
    """Multi-step sums in the thinking format: 'What is a+b+c? Think inside <think></think>, then give
    the answer.' -> '<think>a+b=s. s+c=t.</think> t'."""

    max_operand: int = 9
    terms: int = 3
    ops: str = "+"       # unused: sums only; kept so every task takes the same arguments

    def problems(self) -> list[tuple[str, str]]:
        return [(f"What is {'+'.join(map(str, nums))}? {THINK_INSTRUCTION}", str(sum(nums)))
                for nums in itertools.product(range(self.max_operand + 1), repeat=self.terms)]

    @staticmethod
    def reward(completion: str, answer: str) -> float:
        m = THINK_RE.match(completion)
        if m is None or "<think>" in m.group(2):
            return 0.0
        num = re.search(r"-?\d+", m.group(2))
        return 1.0 if num is not None and num.group() == answer else 0.1

    @staticmethod
    def trace(question: str, answer: str) -> str:
        """The worked reply SFT teaches: one partial sum per step inside <think>, then the answer."""
        nums = [int(x) for x in re.findall(r"\d+", question.split("?")[0])]
        steps, total = [], nums[0]
        for x in nums[1:]:
            steps.append(f"{total}+{x}={total + x}.")
            total += x
        return f"<think>{' '.join(steps)}</think> {answer}"


@dataclass
class ThinkingProductsTask(ThinkingArithmeticTask):
    """'What is a*b+c*d? Think inside <think></think>, then give the answer.' ->
    '<think>a*b=x. c*d=y. x+y=z.</think> z'. Unlike a sum, which a model can add up in one go, the
    answer composes two table look-ups and an addition: working it out in the thinking block is
    what makes a small model right (docs/training.md, A thinking model)."""

    terms: int = 2       # products per problem

    def problems(self) -> list[tuple[str, str]]:
        out = []
        for nums in itertools.product(range(self.max_operand + 1), repeat=2 * self.terms):
            pairs = list(zip(nums[::2], nums[1::2]))
            q = "+".join(f"{a}*{b}" for a, b in pairs)
            out.append((f"What is {q}? {THINK_INSTRUCTION}", str(sum(a * b for a, b in pairs))))
        return out

    @staticmethod
    def trace(question: str, answer: str) -> str:
        nums = [int(x) for x in re.findall(r"\d+", question.split("?")[0])]
        prods = [a * b for a, b in zip(nums[::2], nums[1::2])]
        steps = [f"{a}*{b}={a * b}." for a, b in zip(nums[::2], nums[1::2])]
        total = prods[0]
        for x in prods[1:]:
            steps.append(f"{total}+{x}={total + x}.")
            total += x
        return f"<think>{' '.join(steps)}</think> {answer}"


def thought(completion: str) -> bool:
    """Whether a reply in the thinking format worked something out (a non-empty <think> block)."""
    m = THINK_RE.match(completion)
    return m is not None and bool(m.group(1).strip())


def cold_start(task, problems: list[tuple[str, str]], direct_fraction: float = 0.0,
               seed: int = 0) -> list[dict]:
    """SFT chats for a thinking task: each problem answered after its worked trace or, for a seeded
    `direct_fraction` of them, with an empty block and the answer straight away (a cold start that
    can both think and not, so RL can find out which pays)."""
    import random

    rng = random.Random(seed)
    chats = []
    for q, a in problems:
        reply = f"<think></think> {a}" if rng.random() < direct_fraction else task.trace(q, a)
        chats.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": reply}]})
    return chats


@dataclass
class RepeatTask:
    """'Repeat the word: stone' -> reward 1 if the reply's first word is 'stone'."""

    max_operand: int = 0     # unused; every task takes the same arguments

    def problems(self) -> list[tuple[str, str]]:
        return [(f"Repeat the word: {w}", w) for w in WORDS]

    @staticmethod
    def reward(completion: str, answer: str) -> float:
        words = re.findall(r"[A-Za-z]+", completion)
        return float(bool(words) and words[0].lower() == answer)


TASKS = {"arithmetic": ArithmeticTask, "think": ThinkingArithmeticTask, "think-mul": ThinkingProductsTask,
         "repeat": RepeatTask}


def heldout_split(problems: list[tuple[str, str]], n: int, seed: int) -> tuple[list, list]:
    """(train problems, eval problems): the `n` eval problems GRPO measures (seeded), and the rest."""
    import random

    held = random.Random(seed + 1).sample(problems, min(n, len(problems)))
    chosen = set(held)
    return [p for p in problems if p not in chosen], held


def accuracy(rewards: list[float]) -> float:
    return sum(r == 1.0 for r in rewards) / max(len(rewards), 1)
