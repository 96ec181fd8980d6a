"""`python -m kvserve.server serve ...` / `python -m kvserve.server keys ...`."""

from kvserve.server.cli import main

main()
