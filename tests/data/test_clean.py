"""`kvserve data clean`: planted near-duplicates, quality rules, PII, WARC/HTML input, language filter,
and the output read by `kvserve train tokenizer`."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import Counter

from warcio.statusandheaders import StatusAndHeaders
from warcio.warcwriter import WARCWriter
from webcorpus import planted_corpus, write_jsonl

from kvserve.data.clean import CleanJob, clean
from kvserve.data.quality import CleanConfig, quality_failure, scrub_pii


def test_planted_near_duplicates_are_removed_and_unique_documents_kept(tmp_path):
    rows, group = planted_corpus(2000, dup_fraction=0.1, seed=3)
    src = write_jsonl(rows, tmp_path / "crawl.jsonl")
    report = clean(CleanJob(inputs=[str(src)], out=str(tmp_path / "out"), workers=2, progress=False))
    kept = [json.loads(line)["source"] for line in (tmp_path / "out" / "part-00000.jsonl").open()]
    per_group = Counter(group[s] for s in kept)
    sizes = Counter(group.values())
    planted = sum(n - 1 for n in sizes.values())
    left = sum(n - 1 for n in per_group.values())
    lost_unique = sum(1 for g in sizes if per_group[g] == 0)
    assert planted >= 200
    assert (planted - left) / planted >= 0.95, (planted, left)
    assert lost_unique / len(sizes) <= 0.01, lost_unique
    assert report["documents_in"] == len(rows) and report["kept"] == len(kept)
    assert report["kept"] + sum(report["dropped"].values()) == report["documents_in"]
    assert report["docs_per_s"] > 0 and json.loads((tmp_path / "out" / "report.json").read_text())["kept"] == len(kept)


def test_quality_rules_name_what_failed():
    cfg = CleanConfig(min_words=20)
    good = ("The river runs to the sea, and that is where the boats have gone with the tide. " * 1 +
            "Fishermen mend their nets on the shore while children play with shells in the warm sand. "
            "In the evening the lamps of the harbour are lit one by one along the old stone wall.")
    assert quality_failure(good, cfg, "en") is None
    assert quality_failure("too few words here", cfg, "en") == "too_short"
    assert quality_failure("\n".join(["Buy cheap watches now and save"] * 10), cfg, "en") == "repeated_lines"
    assert quality_failure(" ".join(["#tag"] * 30), cfg, "en") in ("symbol_ratio", "repeated_ngrams")
    assert quality_failure("1234 5678 9012 " * 10, cfg, "en") == "digit_ratio"
    assert quality_failure(" ".join(f"word{i} thing{i} item{i}" for i in range(10)), cfg, "en") == "stop_words"
    assert quality_failure("- " + "\n- ".join(f"the item number {i} with a tag" for i in range(20)), cfg,
                           "en") == "bullet_lines"


def test_pii_is_scrubbed():
    text, found = scrub_pii("Mail jane.doe@example.com or call +1 415-555-0134; server 192.168.10.7; "
                            "card 4111 1111 1111 1111.")
    assert "jane.doe" not in text and "<EMAIL>" in text
    assert "555-0134" not in text and "<PHONE>" in text
    assert "192.168.10.7" not in text and "<IP_ADDRESS>" in text
    assert "4111" not in text and "<CARD_NUMBER>" in text
    assert found == {"email": 1, "phone": 1, "ip_address": 1, "card_number": 1}


ARTICLE_EN = ("The old lighthouse stood at the end of the harbour for more than two hundred years. Every night "
              "the keeper climbed the narrow stairs to light the lamp, and ships that passed the rocks were "
              "guided safely home. When the storm of the winter came, the keeper stayed with the light for "
              "three days without sleep. The town still remembers him, and each year the children bring "
              "flowers to the door of the tower. Write to keeper@lighthouse.example for the visiting hours.")
ARTICLE_DE = ("Der alte Leuchtturm stand mehr als zweihundert Jahre am Ende des Hafens. Jede Nacht stieg der "
              "Wärter die schmale Treppe hinauf, um die Lampe anzuzünden, und die Schiffe, die an den Felsen "
              "vorbeifuhren, fanden sicher nach Hause. Als der Sturm des Winters kam, blieb der Wärter drei "
              "Tage ohne Schlaf bei dem Licht. Die Stadt erinnert sich noch heute an ihn.")


def _page(title: str, body: str) -> bytes:
    nav = "".join(f"<li><a href='/p{i}'>Menu item {i}</a></li>" for i in range(12))
    return (f"<html><head><title>{title}</title></head><body><nav><ul>{nav}</ul></nav>"
            f"<article><h1>{title}</h1><p>{body}</p><p>{body}</p></article>"
            "<footer>Copyright 2024 Example Corp. All rights reserved. Cookie settings.</footer>"
            "</body></html>").encode()


def _warc(path, pages: list[tuple[str, bytes]]) -> None:
    with path.open("wb") as f:
        writer = WARCWriter(f, gzip=True)
        for url, html in pages:
            headers = StatusAndHeaders("200 OK", [("Content-Type", "text/html; charset=utf-8")],
                                       protocol="HTTP/1.0")
            writer.write_record(writer.create_warc_record(url, "response", payload=io.BytesIO(html),
                                                          http_headers=headers))


def test_cli_cleans_a_warc_and_html_and_the_tokenizer_reads_the_output(tmp_path):
    _warc(tmp_path / "crawl.warc.gz", [("https://a.example/en", _page("Lighthouse", ARTICLE_EN)),
                                       ("https://b.example/de", _page("Leuchtturm", ARTICLE_DE)),
                                       ("https://c.example/en-copy", _page("Lighthouse", ARTICLE_EN))])
    (tmp_path / "page.html").write_bytes(_page("Deals", "Click here for the best deals of the year, save today."))
    out = tmp_path / "clean"
    cmd = [sys.executable, "-m", "kvserve.cli", "data", "clean", str(tmp_path / "crawl.warc.gz"),
           str(tmp_path / "page.html"), "--out", str(out), "--lang", "en", "--min-words", "20", "--workers", "2",
           "--no-progress"]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["documents_in"] == 4 and report["kept"] == 1
    assert report["dropped"] == {"exact_duplicate": 1, "language": 1, "too_short": 1}
    assert report["pii_scrubbed"] == {"email": 1}
    [doc] = [json.loads(line) for line in (out / "part-00000.jsonl").open()]
    assert doc["source"] == "https://a.example/en"
    assert "Menu item" not in doc["text"] and "Copyright" not in doc["text"]     # boilerplate gone
    assert "lighthouse stood" in doc["text"] and "<EMAIL>" in doc["text"]

    bad = subprocess.run([sys.executable, "-m", "kvserve.cli", "data", "clean", str(tmp_path / "nope.warc"),
                          "--out", str(out)], check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "junk.warc.gz").write_bytes(b"not gzip at all\n" * 10)
    for args, says in ((["--lang", "english"], "unknown language"), (["--workers", "1"], "not a readable WARC")):
        bad = subprocess.run([sys.executable, "-m", "kvserve.cli", "data", "clean", str(tmp_path / "junk.warc.gz"),
                              "--out", str(tmp_path / "junk"), *args], check=False, capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 1 and says in bad.stderr and "Traceback" not in bad.stderr, bad.stderr

    tok = subprocess.run([sys.executable, "-m", "kvserve.cli", "train", "tokenizer", "--corpus", str(out),
                          "--vocab-size", "300", "--out", str(tmp_path / "tok")], check=False, capture_output=True,
                         text=True, timeout=300)
    assert tok.returncode == 0, tok.stderr
    assert json.loads(tok.stdout)["vocab_size"] <= 300
