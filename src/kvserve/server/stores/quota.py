"""Per-owner quotas of the stores a key can write: how many items an owner keeps, how many bytes
they take, and how long one lives (where OpenAI has an expiry: stored responses, 30 days).

The limits are configuration (`QuotaLimits`, one per store in `ServerSettings.quotas`, set with
`kvserve serve --quota STORE:items=N,bytes=SIZE,ttl=DURATION`); the rule is `OwnerQuota`, held
once by the store that enforces it. A store calls `admit` inside the transaction of each write
that adds an item, before the write:

    self.quota = OwnerQuota("files", limits, what="files", size_column="bytes")     # __init__
    with self.db.transaction() as conn:
        self.quota.admit(self.db, conn, owner, nbytes)                               # 413 past it
        conn.execute("INSERT INTO files ...")

and adds `self.quota.alive()` to its reads (`AND created_at >= ?` with the expiry's cutoff), so
an expired item is gone for its owner at once and its row is deleted by the owner's next write.
The table needs `owner` and `created_at` columns (and `id` when a write may replace an item).
`admit` locks the owner (SQLite: the transaction's file lock; PostgreSQL: an advisory lock on the
owner), so servers writing for one owner at once cannot overshoot the quota together.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.errors import InvalidRequest, KVServeError

if TYPE_CHECKING:
    from kvserve.server.stores.database import Connection, Database


class QuotaExceeded(KVServeError, status=413, code="storage_quota_exceeded"):
    """An owner's items in a store would exceed their quota (HTTP 413)."""


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class QuotaLimits:
    """One store's per-owner caps; None is no cap (no expiry)."""

    max_items: int | None = None
    max_bytes: int | None = None
    ttl_s: float | None = None
    max_active: int | None = None      # batches: running at once per owner
    max_lines: int | None = None       # batches: lines not yet answered, per owner

    @classmethod
    def parse(cls, text: str, base: QuotaLimits | None = None) -> QuotaLimits:
        """`items=1000,bytes=64MiB,ttl=30d` over `base` (a field left out keeps its value;
        `none` removes a cap)."""
        fields = dict(vars(base or cls()))
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            value = value.strip().lower()
            try:
                if value == "none":
                    parsed = None
                elif name in ("items", "active", "lines"):
                    parsed = int(value)
                elif name == "bytes":
                    m = re.fullmatch(r"(\d+)\s*([kmg]i?b|b)?", value)
                    parsed = int(m[1]) * _UNITS[m[2] or ""]   # type: ignore[index]
                elif name == "ttl":
                    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd])?", value)
                    parsed = float(m[1]) * _SECONDS[m[2] or "s"]   # type: ignore[index]
                else:
                    raise ValueError(name)
            except (ValueError, TypeError):
                raise InvalidRequest(f"quota {text!r}: expected items=N, bytes=SIZE (e.g. 64MiB), "
                                     "ttl=DURATION (e.g. 30d) and for batches active=N, lines=N, each optional "
                                     "or `none`.", param="quota") from None
            fields[{"items": "max_items", "bytes": "max_bytes", "ttl": "ttl_s", "active": "max_active",
                    "lines": "max_lines"}[name]] = parsed
        return cls(**fields)


DEFAULT_QUOTAS = {   # per owner; a store a key can write adds its line (and takes `settings.quota(name)`)
    "responses": QuotaLimits(max_items=10_000, max_bytes=100 << 20, ttl_s=30 * 86400),   # OpenAI: 30 days
    "conversations": QuotaLimits(max_items=2_000, max_bytes=64 << 20),
    "arena": QuotaLimits(max_items=100, max_bytes=4 << 20, ttl_s=86400),   # open (unvoted) battles
    # batches kept (a finished one is purged `ttl` after it ends), running at once, lines unanswered
    "batches": QuotaLimits(max_items=1000, ttl_s=30 * 86400, max_active=20, max_lines=100_000,
                           max_bytes=1 << 30),   # bytes: of the lines waiting
}


def quota_options(specs: list[str]) -> dict[str, str]:
    """`--quota STORE:items=N,bytes=SIZE,ttl=DURATION` options as `ServerSettings.quotas`, checked."""
    out: dict[str, str] = {}
    for spec in specs:
        store, _, limits = spec.partition(":")
        if store not in DEFAULT_QUOTAS:
            raise InvalidRequest(f"--quota {spec}: the store is one of {', '.join(DEFAULT_QUOTAS)}.", param="quota")
        QuotaLimits.parse(limits)
        out[store] = limits
    return out


class OwnerQuota:
    """A store's quota rule over its table (see the module's docstring). `text_columns`: the
    columns whose bytes count (as the database stores them); `size_column`: an integer column
    that holds an item's bytes instead; `counted`: an SQL condition on the rows the quota covers
    (the arena's open battles), empty for all."""

    def __init__(self, table: str, limits: QuotaLimits, *, what: str, param: str | None = None,
                 text_columns: tuple[str, ...] = (), size_column: str | None = None, counted: str = ""):
        self.table, self.limits, self.what, self.param = table, limits, what, param
        self.text_columns, self.size_column = text_columns, size_column
        self._where = counted
        self.counted = f" AND ({counted})" if counted else ""

    def cutoff(self) -> float:
        """Items created before this time have expired (0: nothing expires)."""
        return time.time() - self.limits.ttl_s if self.limits.ttl_s is not None else 0.0

    def alive(self) -> tuple[str, tuple[float]]:
        """(SQL, args) to add to a read's WHERE so expired items are not seen."""
        if self.limits.ttl_s is None:
            return "", ()
        if self._where:   # only the rows the quota covers expire
            return f" AND (NOT ({self._where}) OR created_at >= ?)", (self.cutoff(),)
        return " AND created_at >= ?", (self.cutoff(),)

    def _size(self, db: Database) -> str:
        parts = [db.octets(c) for c in self.text_columns] + ([self.size_column] if self.size_column else [])
        return " + ".join(parts) or "0"

    def admit(self, db: Database, conn: Connection, owner: str, adding_bytes: int, *,
              replacing: str | None = None) -> None:
        """In the write's transaction, before it: the owner locked, their expired items deleted,
        and a 413 when one more item of `adding_bytes` (in place of item `replacing`, if theirs)
        would pass the item or byte cap."""
        lim = self.limits
        if lim.max_items is None and lim.max_bytes is None and lim.ttl_s is None:
            return
        db.lock_owner(conn, self.table, owner)
        if lim.ttl_s is not None:
            conn.execute(f"DELETE FROM {self.table} WHERE owner = ? AND created_at < ?{self.counted}",
                         (owner, self.cutoff()))
        row = conn.execute(f"SELECT COUNT(*) AS n, COALESCE(SUM({self._size(db)}), 0) AS b FROM {self.table} "
                           f"WHERE owner = ? AND id <> ?{self.counted}", (owner, replacing or "")).fetchone()
        items, used = int(row["n"]), int(row["b"])
        if lim.max_items is not None and items + 1 > lim.max_items:
            raise QuotaExceeded(f"You have {items} {self.what}, the maximum per key; delete some (or let them "
                                "expire) first.", param=self.param)
        if lim.max_bytes is not None and used + adding_bytes > lim.max_bytes:
            raise QuotaExceeded(f"Your {self.what} would take {used + adding_bytes} bytes; the quota per key is "
                                f"{lim.max_bytes}. Delete some first.", param=self.param)
