"""The gates: checks a request passes before it may cost the engine anything, in this order.

    auth.py        the outer ASGI layer: request id, the API key, the key's request bucket
                   (ratelimit.py), the access-log record (records.py) written once the response is done
    limits.py      the body: size, read timeout, JSON depth, valid Unicode (every route that reads one)
    (protocol.py)  the body's model and the server's caps (400 with `param`)
    moderation.py  input moderation (400 `content_policy_violation`); per key and tier policies
    admission.py   the degradation ladder (max_tokens cap, cheaper model), then a slot in the
                   gateway's priority queue (503 when full); taken by the generation's Lease
    ratelimit.py   the key's token bucket (tokens per minute), reserved by the Lease

Each gate is a plain call that returns or raises a `kvserve.errors` exception. A new gate is a
module here, called from the place in that order where it belongs (the middleware for every
route, `generation/plan.py`'s `build_plan` for generation).
"""
