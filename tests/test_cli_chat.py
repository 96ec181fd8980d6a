"""`kvserve chat` as a user drives it: history, /system, /reset, /exit, and Ctrl-C that stops an
answer but not the program."""

import os
import re
import signal
import subprocess
import sys
import time


def _start(max_tokens: int = 48) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A terminal's Ctrl-C: SIGINT as a user's shell delivers it. Under a test runner started in the
    # background (`cmd &` ignores SIGINT, and the ignore is inherited), Python would not turn SIGINT
    # into KeyboardInterrupt at all, so the child gets the default disposition back first.
    return subprocess.Popen([sys.executable, "-m", "kvserve.cli", "chat", "--temperature", "0",
                             "--max-tokens", str(max_tokens), "--stats"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509


def test_chat_commands_and_history():
    p = _start()
    script = ("/system You are a terse assistant.\n"
              "My name is Alice. Reply with one word: ok.\n"
              "What is my name?\n"
              "/reset\n"
              "/exit\n")
    _out, err = p.communicate(script, timeout=600)
    assert p.returncode == 0, err
    assert "(system prompt set)" in err
    assert "(conversation cleared)" in err
    assert "Traceback" not in err
    # Each turn's prompt holds the whole conversation so far; the second turn reuses the first
    # turn's KV blocks through the prefix cache.
    turns = [(int(a), int(b)) for a, b in re.findall(r"\[prompt (\d+) tokens \((\d+) cached\)", err)]
    assert len(turns) == 2, err
    assert turns[1][0] > turns[0][0] + 5
    assert turns[1][1] >= 16


def test_ctrl_c_stops_the_answer_not_the_program():
    # Room for a long answer: at ~200 tokens/s a 48-token answer could end before Ctrl-C lands.
    p = _start(max_tokens=1500)
    p.stdin.write("Write a very long story about a dragon.\n")
    p.stdin.flush()
    # Wait until the answer has started streaming, then press Ctrl-C.
    buf = ""
    deadline = time.monotonic() + 300
    while len(buf) < 20 and time.monotonic() < deadline:
        buf += p.stdout.read(1)
    p.send_signal(signal.SIGINT)
    p.stdin.write("What is 2+2?\n/exit\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=300)
    out = buf + out
    assert p.returncode == 0, err
    assert "[stopped]" in out
    after = out.split("[stopped]", 1)[1]
    assert len(after.strip(" >\n")) > 5            # the next question was still answered
    assert err.count("[prompt ") == 2


def test_chat_context_drops_oldest_turns_through_the_server_builder():
    import gguf

    from kvserve.cli import _fit
    from kvserve.model.registry import resolve
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf.GGUFReader(resolve(None).path))
    history = []
    for i in range(6):
        history += [{"role": "user", "content": f"question {i} " + "word " * 30},
                    {"role": "assistant", "content": f"answer {i} " + "word " * 30}]
    history.append({"role": "user", "content": "the last question"})
    ids = _fit(tok, "Be brief.", history, max_model_len=256, max_tokens=32)
    text = tok.decode(ids, skip_special_tokens=False)
    assert len(ids) + 32 <= 256 and "Be brief." in text and text.rstrip().endswith("assistant")
    assert history[-1]["content"] == "the last question" and len(history) < 13   # the oldest turns are gone
    assert "question 0" not in text and history[0]["content"] in text
