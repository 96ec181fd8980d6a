"""A small `<think>` dataset: arithmetic problems answered after worked steps, for SFT of a model
that thinks before it answers (what the server's reasoning split and reasoning budget need).

    user:      What is 47 + 38?
    assistant: <think>
               7 + 8 = 15, write 5 carry 1.
               4 + 3 + 1 = 8.
               So 47 + 38 = 85.
               </think>

               85

Addition and subtraction are worked digit by digit (carries and borrows), multiplication as
partial products. `python -m kvserve.train.thinking_data --out think.jsonl --n 2000` writes the
JSONL that `kvserve train sft --data` reads (recipe: docs/training.md).

With `--task think|think-mul` it writes instead the cold start for GRPO on that verifiable task
(`tasks.cold_start`): `--n` problems drawn from outside the set GRPO evaluates on (`--eval-prompts`,
`--seed`: the same split `kvserve train grpo --heldout` makes), a `--direct-fraction` of them
answered without working.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def _add_steps(a: int, b: int) -> list[str]:
    steps, carry = [], 0
    da, db = str(a)[::-1], str(b)[::-1]
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        carry, digit = divmod(s, 10)
        steps.append(f"{terms} = {s}" + (f", write {digit} carry {carry}." if carry else "."))
    return steps


def _sub_steps(a: int, b: int) -> list[str]:
    steps, borrow = [], 0
    da, db = str(a)[::-1], str(b)[::-1]
    for i in range(len(da)):
        x = int(da[i]) - borrow
        y = int(db[i]) if i < len(db) else 0
        borrow = 1 if x < y else 0
        steps.append(f"{x + 10 * borrow} - {y} = {x + 10 * borrow - y}" + (", borrow 1." if borrow else "."))
    return steps


def _mul_steps(a: int, b: int) -> list[str]:
    parts = [(int(d) * 10 ** i) for i, d in enumerate(str(b)[::-1]) if d != "0"]
    steps = [f"{a} * {p} = {a * p}." for p in parts]
    if len(parts) > 1:
        steps.append(" + ".join(str(a * p) for p in parts) + f" = {a * b}.")
    return steps


def problem(rng: random.Random, max_operand: int = 99) -> tuple[str, list[str], int]:
    """(question, worked steps, answer) for one random problem."""
    op = rng.choice("+-*")
    a, b = rng.randint(2, max_operand), rng.randint(2, max_operand)
    if op == "+":
        steps, ans = _add_steps(a, b), a + b
    elif op == "-":
        a, b = max(a, b), min(a, b)
        steps, ans = _sub_steps(a, b), a - b
    else:
        b = rng.randint(2, 12)
        steps, ans = _mul_steps(a, b), a * b
    return f"What is {a} {op} {b}?", steps + [f"So {a} {op} {b} = {ans}."], ans


def thinking_chat(question: str, steps: list[str], answer: int) -> dict:
    reply = "<think>\n" + "\n".join(steps) + "\n</think>\n\n" + str(answer)
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]}


def make_dataset(n: int, seed: int = 0, max_operand: int = 99) -> list[dict]:
    rng = random.Random(seed)
    return [thinking_chat(*problem(rng, max_operand)) for _ in range(n)]


def write_jsonl(path: str | Path, n: int, seed: int = 0, max_operand: int = 99) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(c) + "\n" for c in make_dataset(n, seed, max_operand)))
    return p


def write_cold_start(path: str | Path, task: str, n: int, direct_fraction: float = 0.0, seed: int = 0,
                     max_operand: int = 9, eval_prompts: int = 32) -> Path:
    """GRPO's cold-start SFT data for a thinking task, none of it from GRPO's evaluation problems."""
    from kvserve.errors import InvalidRequest
    from kvserve.train.tasks import TASKS, cold_start, heldout_split

    if task not in ("think", "think-mul"):
        raise InvalidRequest(f"--task must be think or think-mul, not {task!r}", param="task")
    if not 0.0 <= direct_fraction <= 1.0:
        raise InvalidRequest("--direct-fraction must be between 0 and 1", param="direct_fraction")
    t = TASKS[task](max_operand=max_operand)
    train, _ = heldout_split(t.problems(), eval_prompts, seed)
    chosen = random.Random(seed + 5).sample(train, min(n, len(train)))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(c) + "\n" for c in cold_start(t, chosen, direct_fraction, seed)))
    return p


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write a <think> arithmetic SFT dataset (JSONL).")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-operand", type=int, default=None, help="99, or 9 with --task")
    ap.add_argument("--task", choices=("think", "think-mul"), help="GRPO's cold start for this task instead")
    ap.add_argument("--direct-fraction", type=float, default=0.0, help="with --task: answered without working")
    ap.add_argument("--eval-prompts", type=int, default=32, help="with --task: GRPO's held-out problems, left out")
    args = ap.parse_args(argv)
    if args.task:
        from kvserve.errors import InvalidRequest

        try:
            print(write_cold_start(args.out, args.task, args.n, args.direct_fraction, args.seed,
                                   9 if args.max_operand is None else args.max_operand, args.eval_prompts))
        except InvalidRequest as e:
            ap.error(str(e))
    else:
        print(write_jsonl(args.out, args.n, args.seed, 99 if args.max_operand is None else args.max_operand))


if __name__ == "__main__":
    main()
