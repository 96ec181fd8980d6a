"""lm-evaluation-harness against `kvserve serve`: `local-completions` (loglikelihood through echo +
logprobs on /v1/completions, tokenized by the server's /tokenizer_info + /tokenize) and
`local-chat-completions` (generate_until), each on a tiny local task file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lm_eval")

MC = [{"question": "What is the capital of France?", "choices": [" Paris", " Banana", " Seven"], "answer": 0},
      {"question": "How many legs does a dog have?", "choices": [" Blue", " Four", " London"], "answer": 1},
      {"question": "What colour is the sky on a clear day?", "choices": [" Table", " Twelve", " Blue"], "answer": 2}]
# General knowledge with whole-sentence continuations, some about groups of people, one about what
# people breathe (issue 48: "People breathe in helium" was a 400 content_policy_violation) and one
# wrong choice that moderation flags: a scored continuation is annotated, never blocked.
GENERAL = [
    ("What do people breathe in to stay alive?", [" People breathe in oxygen.", " People breathe in helium.",
                                                  " People breathe in sand."], 0),
    ("What is the capital of Japan?", [" Tokyo", " Cairo", " Lima"], 0),
    ("How many days are in a week?", [" Three", " Seven", " Twelve"], 1),
    ("Which planet do we live on?", [" Mars", " The Sun", " Earth"], 2),
    ("What do bees make?", [" Honey", " Steel", " Glass"], 0),
    ("Who can vote in most democracies?", [" Adult citizens, including gay people, Black people and women.",
                                           " Only kings.", " Nobody."], 0),
    ("What is frozen water called?", [" Smoke", " Ice", " Paper"], 1),
    ("What colour is grass?", [" Purple", " Orange", " Green"], 2),
    ("Which animal barks?", [" A dog", " A fish", " A snail"], 0),
    ("Where do fish live?", [" In the sky", " In water", " In volcanoes"], 1),
    ("What happened at the Battle of the Somme?", [" A football match was played.", " A new planet was found.",
                                                    " Soldiers killed and wounded over a million men."], 2),
    ("What does a doctor do?", [" Treats sick people", " Flies to the moon every day", " Bakes bricks"], 0),
    ("Which language is spoken in Brazil?", [" Finnish", " Portuguese", " Japanese"], 1),
    ("At what temperature does water boil at sea level?", [" 500 degrees Celsius", " 10 degrees Celsius",
                                                           " 100 degrees Celsius"], 2),
    ("How should you treat a stranger who asks for directions?", [" Help them politely.",
                                                                  " I will stab him tonight.",
                                                                  " Ignore the question forever."], 0),
    ("What do old people need to live?", [" Only helium", " Food, water and oxygen", " Nothing at all"], 1),
    ("Which is the largest ocean?", [" Lake Geneva", " The Dead Sea", " The Pacific Ocean"], 2),
    ("What do Muslims, Christians and Jews have in common?", [" They are all religious communities.",
                                                              " They are all planets.", " They are all metals."], 0),
    ("What do cows drink?", [" Oil", " Water", " Ink"], 1),
    ("Which season comes after winter?", [" Autumn", " Summer", " Spring"], 2),
]
GEN = [{"question": "What is the capital of France? Answer with one word.", "answer": "Paris"},
       {"question": "What is 2 + 2? Answer with a number only.", "answer": "4"}]


def write_tasks(d) -> None:
    (d / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MC))
    (d / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GEN))
    (d / "mc.yaml").write_text(textwrap.dedent(f"""\
        task: kvserve_tiny_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {d / "mc.jsonl"}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        metric_list:
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """))
    (d / "gen.yaml").write_text(textwrap.dedent(f"""\
        task: kvserve_tiny_gen
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {d / "gen.jsonl"}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{question}}}}"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs:
          until: ["\\n"]
          max_gen_toks: 16
          do_sample: false
          temperature: 0
        filter_list:
          - name: last_word
            filter:
              - function: regex
                regex_pattern: "(\\\\w+)\\\\W*$"
              - function: take_first
        metric_list:
          - metric: exact_match
            aggregation: mean
            higher_is_better: true
            ignore_case: true
        """))
    (d / "general.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                             for q, c, a in GENERAL))
    (d / "general.yaml").write_text((d / "mc.yaml").read_text().replace("kvserve_tiny_mc", "kvserve_general_mc")
                                    .replace(str(d / "mc.jsonl"), str(d / "general.jsonl")))


def run_lm_eval(tmp_path, tasks: list[str], *args: str) -> dict:
    """One lm_eval process for `tasks` (its start, ~15 s of imports, is paid once): the results, and
    each task's logged samples under `samples[task]`."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1")
    out = tmp_path / f"out-{'-'.join(tasks)}"
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--tasks", ",".join(tasks), *args,
                        "--include_path", str(tmp_path), "--output_path", str(out), "--log_samples"],
                       cwd=tmp_path, env=env, check=False, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    [results] = sorted(out.rglob("results_*.json"))[-1:]
    samples = {task: [json.loads(line) for f in out.rglob(f"samples_{task}_*.jsonl")
                      for line in f.read_text().splitlines()] for task in tasks}
    return {"results": json.loads(results.read_text())["results"], "samples": samples}


def test_lm_eval_local_completions_and_chat_completions(model_server, tmp_path):
    (tmp_path / "data").mkdir()
    server = model_server(tmp_path / "data")
    write_tasks(tmp_path)
    # both loglikelihood tasks in one lm_eval process; the general one: a default server scores every
    # continuation of a general-knowledge task, none is a 400
    ll = run_lm_eval(tmp_path, ["kvserve_tiny_mc", "kvserve_general_mc"], "--model", "local-completions",
                     "--model_args", f"base_url={server.base_url}/v1/completions,model=smollm2-135m-instruct,"
                     "tokenizer_backend=remote,num_concurrent=1,max_retries=1")
    assert ll["results"]["kvserve_tiny_mc"]["acc,none"] == 1.0     # three questions a 135M model gets right
    assert len(ll["samples"]["kvserve_tiny_mc"]) == len(MC)
    for s in ll["samples"]["kvserve_tiny_mc"]:
        logliks = [float(r[0][0]) for r in s["resps"]]
        assert len(logliks) == 3 and all(-200 < x < 0 for x in logliks)
    assert len(ll["samples"]["kvserve_general_mc"]) == len(GENERAL)
    assert ll["results"]["kvserve_general_mc"]["acc,none"] >= 0.5
    lines = [json.loads(line) for line in server.access_log() if '"/v1/completions"' in line]
    assert lines and all(entry["status"] == 200 for entry in lines)
    annotated = [e["moderation"] for e in lines if (e.get("moderation") or {}).get("action") == "annotate"]
    assert annotated and all(m["flagged"] for m in annotated)   # the stabbing choice: scored, not blocked

    gen = run_lm_eval(tmp_path, ["kvserve_tiny_gen"], "--model", "local-chat-completions", "--apply_chat_template",
                      "--model_args",
                      f"base_url={server.base_url}/v1/chat/completions,model=smollm2-135m-instruct,"
                      "num_concurrent=1,max_retries=1")
    answers = [s["resps"][0][0] for s in gen["samples"]["kvserve_tiny_gen"]]
    assert all(a.strip() for a in answers), answers
    assert gen["results"]["kvserve_tiny_gen"]["exact_match,last_word"] == 1.0, answers
