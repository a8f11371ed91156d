"""Requests to a build's server with bounded concurrency: transport errors (connection, timeout,
HTTP 5xx/429) are retried with exponential backoff; a reply, right or wrong, is never retried; an
item that still fails stops the eval with its id in the message. Items whose replies held
non-finite values are all collected, located and reported together (`finite`)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from moeshrink.evals import EvalError, finite
from moeshrink.evals.usage import Usage
from moeshrink.serve.endpoint import EndpointError
from moeshrink.serve.vllm_server import ServerClient

log = logging.getLogger(__name__)
RETRIED_STATUS = {408, 429, 500, 502, 503, 504}


class RequestPool:
    def __init__(self, server: ServerClient, concurrency: int, retries: int, timeout_s: float,
                 backoff_s: float = 1.0, label: str = "", usage: Usage | None = None):
        self.server = server
        self.usage = usage or Usage()
        self.concurrency = concurrency
        self.retries = retries
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.label = label
        self.retried = 0

    def post(self, item_id: str, path: str, body: dict) -> dict:
        last_error = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.retried += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, reply = self.server.request("POST", path, body, timeout=self.timeout_s)
            except EndpointError:
                raise
            except OSError as error:  # refused, reset, timed out
                last_error = f"{type(error).__name__}: {error}"
                log.warning("%s item %s: %s (attempt %d of %d)", self.label, item_id, last_error, attempt + 1,
                            self.retries + 1)
                continue
            if status == 200:
                self.usage.add(reply)
                return reply
            if finite.is_nonfinite_reply(status, reply):
                raise finite.NonFiniteReply(item_id, path, body)
            last_error = f"HTTP {status}: {str(reply)[:500]}"
            if status not in RETRIED_STATUS:
                break
            log.warning("%s item %s: %s (attempt %d of %d)", self.label, item_id, last_error, attempt + 1,
                        self.retries + 1)
        raise EvalError(f"{self.label}: item {item_id!r} failed after {attempt + 1} attempt(s) at {path}: "
                        f"{last_error}")

    def send(self, path: str) -> finite.Send:
        return lambda body: self.server.request("POST", path, body, timeout=self.timeout_s)

    def map(self, path: str, requests: Sequence[tuple[str, dict]], keep: Callable[[dict], Any] | None = None) -> list:
        """Replies in request order, or what `keep` takes from each (in the worker, as each arrives, so
        that large replies are never all held at once). The first failure cancels what has not started
        and is raised; items with non-finite values do not stop the others and are reported together
        at the end."""
        replies: list = [None] * len(requests)
        nonfinite: list[tuple[int, finite.NonFiniteReply]] = []

        def fetch(item_id: str, body: dict):
            reply = self.post(item_id, path, body)
            return keep(reply) if keep else reply

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = {pool.submit(fetch, item_id, body): index
                       for index, (item_id, body) in enumerate(requests)}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                failed = [f for f in done if f.exception() is not None
                          and not isinstance(f.exception(), finite.NonFiniteReply)]
                if failed:
                    for future in pending:
                        future.cancel()
                    raise failed[0].exception()
                nonfinite += [(futures[f], f.exception()) for f in done if f.exception() is not None]
        if nonfinite:
            raise finite.report(self.label, [error for _, error in sorted(nonfinite, key=lambda pair: pair[0])],
                                len(requests), self.send(path))
        for future, index in futures.items():
            replies[index] = future.result()
        return replies
