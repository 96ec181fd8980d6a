"""model/loader.py release_freed_heap: what the C heap holds once freed goes back to the system
(the model runner calls it after a long step: a prefill's activations)."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import torch
    from kvserve.model.loader import release_freed_heap

    def anon_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon")) / 1024

    big = torch.ones(16 << 18)      # 16 MB, mapped; freed, it raises glibc's mmap threshold to 16 MB
    del big
    before = anon_mb()
    held = [torch.ones(8 << 18) for _ in range(3)]    # 3 x 8 MB from the heap: a prefill's activations
    del held
    freed = anon_mb() - before
    release_freed_heap(min_free=1 << 30)     # less than 1 GB free: left as it is
    gated = anon_mb() - before
    release_freed_heap()
    print(freed, gated, anon_mb() - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc/self/status")
def test_freed_activations_leave_the_heap():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    freed, gated, trimmed = map(float, out.stdout.split()[-3:])
    assert freed >= 16, out.stdout     # glibc kept them (else this test shows nothing)
    assert gated >= 16, out.stdout
    assert trimmed < 4, out.stdout
