"""GRPO (Group Relative Policy Optimization): learn from a checkable reward, no value model.

Each step, for every prompt, sample a *group* of G completions through kvserve's own engine
(`kvserve.LLM` sharing the very model being trained), score each with a verifiable reward
(here: is the arithmetic answer exactly right?), and push up the completions that did better
than their siblings:

    A_i   = (r_i − mean(r_group)) [/ std(r_group)]              group-relative advantage
    loss  = −mean_i [ A_i · mean_t ρ_t ] + β_KL · mean_i mean_t KL_t
    ρ_t   = π(y_t)/π_old(y_t)   (= 1 in value, ∇ log π in gradient: one update per sample batch,
                                 so PPO's clipping never engages and is left out)
    KL_t  = π_ref/π − log(π_ref/π) − 1                           (k3 estimator, optional)

The reward is the task's verifiable check (`tasks.py`: arithmetic, or `think` / `think-mul`: multi-step
sums, or products and their sum, in the `<think>...</think>` format), or with `--reward-model DIR` the score of a reward model trained
by `kvserve train reward` (RLHF with GRPO in PPO's place); the task's check is still logged as
`task_reward` and `accuracy`, so the two can be compared. Reward, KL and loss curves are saved as
`curves.png` beside the checkpoint.

Groups whose completions all scored the same carry no signal (A = 0). The engine and the
trainer share one set of weights; prefix caching is off so no KV block computed with old
weights is reused after an update. Sampling seeds derive from (seed, step), so a resumed run
draws the same samples.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.errors import InvalidRequest
from kvserve.train.common import frozen, init_distributed, pad_rows, plot_curves, token_logprobs, trainable
from kvserve.train.export import export_hf
from kvserve.train.loop import LoopConfig, run_loop
from kvserve.train.tasks import TASKS, ArithmeticTask, accuracy, heldout_split, thought

__all__ = ["TASKS", "ArithmeticTask", "GRPOConfig", "group_advantages", "grpo"]


@dataclass
class GRPOConfig:
    model: str                       # HF-format directory (usually the SFT output); also the KL reference
    out: str
    task: str = "arithmetic"
    max_operand: int = 9
    group_size: int = 8              # completions sampled per prompt
    prompts_per_step: int = 4
    max_steps: int = 50
    max_tokens: int = 8              # longest completion
    temperature: float = 1.0
    scale_rewards: bool = True       # divide advantages by the group's std
    kl_coef: float = 0.0             # β_KL; 0 = no reference model
    lr: float = 2e-4
    warmup_steps: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_prompts: int = 32           # mean reward on this many fixed problems, before and after training,
    eval_samples: int = 16           # ... sampled this many times each (seeded, at --temperature)
    seed: int = 0
    checkpoint_every: int = 50
    resume: bool = False
    stop_after_steps: int | None = None
    reward_model: str | None = None  # directory from `kvserve train reward`: its score is the reward
    heldout: bool = False            # train only on problems outside the eval set
    terms: int = 3                   # numbers per problem (task "think")


def group_advantages(rewards: torch.Tensor, scale: bool = True) -> torch.Tensor:
    """rewards [P, G] -> advantages [P, G]: reward minus group mean (optionally / group std)."""
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (rewards.std(dim=1, keepdim=True) + 1e-4)
    return adv


def completion_logprobs(model, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each completion given its prompt [N, L] and the completion mask [N, L]."""
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids)]
    ids = pad_rows(seqs, pad_id)
    logp = token_logprobs(model, ids[:, :-1], ids[:, 1:])
    pos = torch.arange(ids.shape[1] - 1)
    starts = torch.tensor([len(p) - 1 for p in prompt_ids])
    ends = torch.tensor([len(s) - 1 for s in seqs])
    mask = (pos[None] >= starts[:, None]) & (pos[None] < ends[:, None])
    return logp, mask.float()


class Scorer:
    """Rewards for (problem, completion) pairs: the task's check, or a reward model's score."""

    def __init__(self, task, reward_model: str | None):
        from kvserve.train.reward import load_reward_model

        self.task = task
        self.rm = load_reward_model(reward_model) if reward_model else None

    def __call__(self, problems: list[tuple[str, str]], texts: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rewards optimised, task rewards), both [P, G]."""
        task = torch.tensor([[self.task.reward(t, a) for t in group] for (_, a), group in zip(problems, texts)])
        if self.rm is None:
            return task, task
        flat = [(q, t) for (q, _), group in zip(problems, texts) for t in group]
        scores = self.rm.score([q for q, _ in flat], [t for _, t in flat]).float()
        return scores.view(task.shape), task


def evaluate(llm, tok, scorer: Scorer, problems: list[tuple[str, str]], params, max_tokens: int) -> dict:
    """Mean reward, task reward and accuracy of `params`' samples; accuracy of the greedy reply; and
    the fraction of sampled replies that worked something out inside <think> (thinking tasks)."""
    from kvserve import SamplingParams

    prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True)}
               for q, _ in problems]
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts = [[c.text for c in o.outputs] for o in outs]
    rewards, task = scorer(problems, texts)
    flat = task.reshape(-1).tolist()
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    g = [scorer.task.reward(o.outputs[0].text, a) for o, (_, a) in zip(greedy, problems)]
    return {"reward": float(rewards.mean()), "task_reward": sum(flat) / max(len(flat), 1), "accuracy": accuracy(flat),
            "greedy_accuracy": accuracy(g), "thinking": sum(thought(t) for ts in texts for t in ts) / max(len(flat), 1)}


def grpo(cfg: GRPOConfig) -> dict:
    from kvserve import LLM, SamplingParams
    from kvserve.model.loader import load_model

    if cfg.task not in TASKS:
        raise InvalidRequest(f"unknown task {cfg.task!r}; choose one of {', '.join(TASKS)}", param="task")
    if cfg.group_size < 2:
        raise InvalidRequest("group size must be at least 2: advantages compare siblings", param="group_size")
    info = init_distributed()
    torch.manual_seed(cfg.seed)
    task = TASKS[cfg.task](max_operand=cfg.max_operand, **({"terms": cfg.terms} if cfg.task == "think" else {}))
    problems = task.problems()
    scorer = Scorer(task, cfg.reward_model)
    lm = load_model(str(cfg.model), weight_format="fp32")
    tok, model = lm.tokenizer, trainable(lm.model)
    reference = frozen(copy.deepcopy(model)) if cfg.kl_coef > 0 else None
    llm = LLM(model, tokenizer=tok, kv_cache_memory="64MiB", enable_prefix_caching=False,
              max_num_seqs=cfg.prompts_per_step * cfg.group_size)
    pad_id = tok.eos_token_id or 0
    rest, eval_set = heldout_split(problems, cfg.eval_prompts, cfg.seed)
    if cfg.heldout:
        problems = rest
        if not problems:
            raise InvalidRequest("every problem is in the eval set; lower --eval-prompts", param="eval_prompts")
    eval_params = [SamplingParams(n=cfg.eval_samples, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                  seed=cfg.seed + 7919 * i) for i in range(len(eval_set))]
    before = evaluate(llm, tok, scorer, eval_set, eval_params, cfg.max_tokens)

    def step_fn(step: int) -> dict:
        rng = random.Random(cfg.seed * 1000003 + step)
        batch = [rng.choice(problems) for _ in range(cfg.prompts_per_step)]
        share = len(batch) // info.world_size
        batch = batch[info.rank * share:(info.rank + 1) * share]
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q, _ in batch]
        params = [SamplingParams(n=cfg.group_size, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                 seed=cfg.seed * 1000003 + step * 1009 + i) for i in range(len(batch))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rewards, task_rewards = scorer(batch, [[c.text for c in o.outputs] for o in outs])
        adv = group_advantages(rewards, cfg.scale_rewards).reshape(-1)
        p_ids = [p for p in prompts for _ in range(cfg.group_size)]
        c_ids = [list(c.token_ids) or [pad_id] for o in outs for c in o.outputs]
        logp, mask = completion_logprobs(model, p_ids, c_ids, pad_id)
        ratio = torch.exp(logp - logp.detach())
        per_seq = lambda x: (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        loss = -(adv * per_seq(ratio)).mean()
        metrics = {}
        if reference is not None:
            with torch.no_grad():
                ref_logp, _ = completion_logprobs(reference, p_ids, c_ids, pad_id)
            d = ref_logp - logp
            kl = per_seq(torch.exp(d) - d - 1).mean()
            loss = loss + cfg.kl_coef * kl
            metrics["kl"] = kl.item()
        loss.backward()
        return {"loss": loss.item(), "reward": float(rewards.mean()), "reward_std": float(rewards.std()),
                "task_reward": float(task_rewards.mean()), "accuracy": accuracy(task_rewards.reshape(-1).tolist()),
                "tokens": int(mask.sum()), **metrics}

    loop = LoopConfig.for_stage(cfg, cfg.max_steps, "grpo", min_lr_ratio=1.0)   # a constant LR after warmup
    log = run_loop(model, loop, step_fn, dict, lambda state: None, info, cfg)
    after = evaluate(llm, tok, scorer, eval_set, eval_params, cfg.max_tokens)
    if info.is_main:
        export_hf(model, cfg.model, cfg.out, tok.eos_token_ids)
        plot_curves(log.history, Path(cfg.out) / "curves.png", ("reward", "kl", "loss"), "grpo")
    return {"out": cfg.out, "history": log.history, "model": model,
            "eval_reward_before": before["reward"], "eval_reward_after": after["reward"],
            "eval_accuracy_before": before["accuracy"], "eval_accuracy_after": after["accuracy"],
            "eval_task_reward_before": before["task_reward"], "eval_task_reward_after": after["task_reward"],
            "eval_greedy_accuracy_before": before["greedy_accuracy"], "eval_greedy_accuracy_after": after["greedy_accuracy"],
            "eval_thinking_before": before["thinking"], "eval_thinking_after": after["thinking"]}
