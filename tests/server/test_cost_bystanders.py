"""Issue 49's bound for every hostile kind (hostile.py's `ALL_KINDS`, one or more per finding): sent back to
back, each request gets a 4xx or completes, and a bystander (a two-token chat, /health) stays
within 2x of its unloaded latency while they run. The embeddings kinds' own check, with six
requests at once and the encoder's lookups, is test_cost_embeddings.py.

No time is asserted as a number: each kind's loaded medians are compared with the unloaded ones
measured just before and just after it (the slower of the two; "before" is the previous check's
"after" on the same server, a third fewer probes than measuring it again). A shared 2-core machine drifts within
seconds, so a kind gets up to three attempts and passes on the first within bounds: a stall of the
kind the issue found (a chat waiting 54 s instead of 0.04 s; a token scanned at cubic cost) fails
them all. The server is the default deployment (the engine in the server's process), with output
and input PII redaction on, so the redactor and the input scan are on the hostile paths.

In `make test` (issue 60): a ratio of latencies over ~17 kinds takes 4-7 minutes. Its
pii_heavy_input kind failed on a quiet machine until issue 60 (a chat 3.4-5x slower while 0.5 MB
chats were turned away: each tokenized all 275k tokens, 1 s of a core, before its 400); such a
chat is now refused on its length alone (generation/context.py's bound). The engine's two kernel
threads still stall when one loses its core to another process (worked on in /work/wt/threads),
which a busy shared machine shows as a noisy ratio: hence the three attempts.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hostile import ALL_KINDS, PROBE_QUESTIONS, bystander_check, bystander_ms
from servers import make_keys

pytestmark = pytest.mark.serial     # latency ratios: `make test` runs these alone, after the parallel pass

ADMIN = "bystander-admin-key"
COVERED_ELSEWHERE = {"big_embeddings"}     # test_cost_embeddings.py: six at once, with cache lookups
KINDS = [name for name, _ in ALL_KINDS if name not in COVERED_ELSEWHERE]
QUESTIONS = PROBE_QUESTIONS[:7]
ATTEMPTS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_server):
    data_dir = tmp_path_factory.mktemp("cost-bystanders")
    keys = make_keys(data_dir, "hostile", "bystander")
    moderation = data_dir / "moderation.json"
    moderation.write_text(json.dumps({"pii_input": "redact", "pii_output": "redact"}))
    srv = model_server(data_dir, "--max-model-len", "512", "--moderation-config", str(moderation),
                       "--admin-key", ADMIN, "--quota", "responses:items=20", "--quota", "arena:items=5")
    srv.hostile = {"Authorization": f"Bearer {keys['hostile']}"}
    srv.bystander = {"Authorization": f"Bearer {keys['bystander']}"}
    bystander_ms(srv.base_url, srv.bystander, QUESTIONS)      # the probes' prompts cached, first uses behind us
    srv.unloaded = bystander_ms(srv.base_url, srv.bystander, QUESTIONS)
    return srv


@pytest.mark.parametrize("kind", KINDS)
def test_a_bystander_stays_within_2x_while_the_kind_runs(server, kind):
    with httpx.Client() as c:              # once alone: the kind's own first-use costs (a grammar, a template)
        first = dict(ALL_KINDS)[kind](c, server.base_url, server.hostile)
    assert first.status_code < 500, first.text[:300]
    checks = []
    for _ in range(ATTEMPTS):
        # the unloaded medians before: the last ones measured on this server (the fixture's, or the
        # previous check's `after`, a kind's first request in between); its own `after` follows
        check = bystander_check(server.base_url, server.bystander, kind, QUESTIONS, before=server.unloaded)
        server.unloaded = check.after
        print(check)
        assert check.statuses, check
        assert all(s.isdigit() and int(s) < 500 for s in check.statuses), check   # a 4xx or done, never a timeout
        checks.append(check)
        if check.ok():
            break
    assert checks[-1].ok(), "\n".join(map(str, checks))
    assert httpx.get(server.base_url + "/health", timeout=60).status_code == 200
