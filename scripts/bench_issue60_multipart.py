"""Issue 60: the CPU a multipart body of N empty parts costs /v1/files' form reader.

    PYTHONPATH=src python scripts/bench_issue60_multipart.py 1200000          # this tree's reader
    PYTHONPATH=OLD/src python scripts/bench_issue60_multipart.py 20000 --old  # the stdlib MIME parser before

The new reader refuses the form at its 9th part; the time is mostly copying the body into the
parser (the server's streaming reader stops at the chunk holding the 9th part).
"""

from __future__ import annotations

import argparse
import time

from kvserve.errors import KVServeError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", type=int)
    ap.add_argument("--old", action="store_true", help="time the old files.parse_form(body, content_type)")
    args = ap.parse_args()
    b = "b" * 16
    body = f"--{b}\r\n\r\n\r\n".encode() * args.parts + f"--{b}--\r\n".encode()
    ct = f"multipart/form-data; boundary={b}"
    if args.old:
        from kvserve.server.api.files import parse_form as old

        def run():
            return old(body, ct)
    else:
        from kvserve.server.api.multipart import FormLimits, parse_form

        def run():
            return parse_form(body, ct, FormLimits(fields={"file": 1 << 26}))
    t = time.perf_counter()
    try:
        run()
        outcome = "parsed"
    except KVServeError as e:   # the new reader's 400
        outcome = f"{type(e).__name__}: {str(e)[:40]}"
    print(f"{'old' if args.old else 'new'} parts={args.parts} body={len(body) / 1e6:.1f} MB: "
          f"{time.perf_counter() - t:.3f} s ({outcome})")


if __name__ == "__main__":
    main()
