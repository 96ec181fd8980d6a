"""The cost of PII detection is linear in the text (issue 49, findings 2 and 6): hostile texts that
made the old patterns quadratic complete, and the stream redactor never rescans more than its
bounded hold-back window per piece (counted in characters, not timed)."""

from __future__ import annotations

import pytest

from kvserve.safety import pii

HOSTILE = {
    "secret run": "key: sk-" + "a" * 8000,
    "e-mail-ish": "a." * 4000,
    "at signs": "a@" * 4000,
    "domain run": "x@" + "a." * 4000 + "1",
    "digits": "1" * 8000,
    "digit groups": "1 " * 4000,
}


@pytest.fixture
def scanned(monkeypatch):
    """The length of every text the stream redactor hands to `pii.find`."""
    sizes: list[int] = []
    real = pii.find

    def counting(text, kinds=pii.KINDS):
        sizes.append(len(text))
        return real(text, kinds)

    monkeypatch.setattr(pii, "find", counting)
    return sizes


@pytest.mark.parametrize("name", HOSTILE)
def test_stream_redactor_work_per_piece_is_bounded(name, scanned):
    text = HOSTILE[name]
    r, out = pii.StreamRedactor(), []
    for i in range(0, len(text), 3):
        out.append(r.feed(text[i:i + 3]))
        assert len(r.pending) <= pii.HOLD_MAX + 3
    out.append(r.finish())
    assert max(scanned) <= pii.HOLD + pii.HOLD_MAX + 3          # never the whole tail
    sent = "".join(out)
    if name == "secret run":            # masked once, the rest of the run dropped, nothing of it leaks
        assert sent == "key: [SECRET]"
    else:
        assert sent == pii.redact(text)


def test_stream_redactor_masks_a_long_match_when_the_window_is_full():
    """An address or key longer than the hold-back window still never goes out in clear."""
    for text in ("write to " + "b" * 64 + "@" + "s" * 63 + "." + "t" * 63 + "." + "u" * 63 + ".example.com now",
                 "token=" + "Z" * 1000 + " done", "ghp_" + "q" * 700 + ", ok"):
        r, out = pii.StreamRedactor(), []
        for i in range(0, len(text), 5):
            out.append(r.feed(text[i:i + 5]))
        sent = "".join(out) + r.finish()
        assert "[EMAIL]" in sent or "[SECRET]" in sent, sent[:80]
        assert "qqqqqqqqqq" not in sent and "ZZZZZZZZZZ" not in sent and "ssssssssss" not in sent and "uuuuuuuuuu" not in sent


@pytest.mark.parametrize("unit", ["a", "a@", "a@b.", "1 ", "x" * 63 + "@", "token=", "+1 2-3.4 ", "GB82 "])
def test_a_megabyte_of_hostile_input_is_scanned_in_bounded_windows(unit, monkeypatch):
    """`pii_input` over a 1 MB message: every regex call sees at most WINDOW + OVERLAP characters
    (the GIL changes hands between them) and the whole scan completes (it took minutes before)."""
    text = unit * (1_000_000 // len(unit))
    calls: list[int] = []
    real = pii._find_window

    def window(t, pos, endpos, kinds):
        calls.append(endpos - pos)
        return real(t, pos, endpos, kinds)

    monkeypatch.setattr(pii, "_find_window", window)
    pii.find(text)
    assert len(calls) == -(-len(text) // pii.WINDOW) and max(calls) <= pii.WINDOW


def test_windows_find_what_one_scan_finds():
    """Matches across a window boundary are found once and whole."""
    for shift in range(0, 40, 7):
        text = "x" * (pii.WINDOW - 20 + shift) + " jane.doe@example.org sk-" + "k" * 30 + " +44 20 7946 0958 end"
        kinds = [(m.kind, text[m.start:m.end]) for m in pii.find(text)]
        assert kinds == [("email", "jane.doe@example.org"), ("secret", "sk-" + "k" * 30),
                         ("phone", "+44 20 7946 0958")], (shift, kinds)
    long_secret = "y" * (pii.WINDOW - 10) + " sk-" + "s" * 20000 + " tail"
    [m] = pii.find(long_secret)
    assert long_secret[m.end:] == " tail"
