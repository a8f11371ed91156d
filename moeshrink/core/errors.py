"""The one base of every error this project raises on purpose: bad input, a failed stage, a broken
server. The CLI prints these as one line; anything else is a bug and keeps its traceback."""
from __future__ import annotations


class MoeshrinkError(Exception):
    pass
