"""Tokens an eval sent and got back, from the `usage` of each reply, and its throughput over the time it
spoke to the server (while any other job that shared the server ran too)."""
from __future__ import annotations

import threading


class Usage:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = self.prompt_tokens = self.completion_tokens = 0

    def add(self, reply: object) -> None:
        usage = reply.get("usage") if isinstance(reply, dict) else None
        with self._lock:
            self.requests += 1
            if isinstance(usage, dict):
                self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
                self.completion_tokens += int(usage.get("completion_tokens") or 0)

    def figures(self, seconds: float) -> dict:
        per_s = (lambda n: round(n / seconds, 1)) if seconds > 0 else (lambda n: None)
        return {"seconds": round(seconds, 1), "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "prompt_tokens_per_s": per_s(self.prompt_tokens),
                "completion_tokens_per_s": per_s(self.completion_tokens),
                "method": "the usage field of every reply, over the wall time from the server's lease to the last "
                          "reply; other jobs on the same server ran meanwhile"}
