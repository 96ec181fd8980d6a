"""Everything the server keeps beyond one request.

One module of rules per store, each a `sql.SQLStore` that runs unchanged on SQLite (the default:
the data dir's kvserve.db) or PostgreSQL (--database-url), the two differing only in connection
handling (the `Database` seam of database.py, on SQLite in sql.py or postgres.py): keys.py (API
keys and the usage ledger), conversations.py (the web page's saved chats), responses.py (stored
Responses), arena.py (battles and votes), moderation_policies.py (policies per key or tier),
files.py (the Files API's files) and batches.py (batches and their lines' progress).
Beside them, what several servers share through Redis (--redis-url) and can rebuild:
redis_state.py (rate-limit buckets, the key-lookup cache, live counters; counters.py is the
in-memory default) and redis_cache.py (the semantic cache's entries). factory.py opens the set a
server uses (`open_backends`).

A new store is a module here: its rules, its SQL written once with `?` placeholders, its tables
as DDL steps (sql.py spells `$time`, `$bigint`, `$id`, `$seq` per database), and one line in
`open_backends`.
"""
