"""Users' traffic for the lab: clients sending short completions (each prompt different) to a URL, usually a
router, until stopped. The canary-analysis tests and ``bench/analysis.py`` need the same load."""

from __future__ import annotations

import threading
from collections import Counter

import httpx

REFUSED_BACKOFF = 0.05  # seconds a client waits after a refused connection (the router restarting)


class Traffic:
    """``threads`` clients, one request at a time each; ``codes`` counts the answers by HTTP status (an int) or by
    the name of the client error (a str): ``ConnectError`` is a request never sent (nothing listened)."""

    def __init__(self, url: str, threads: int, tokens: int, timeout: float = 30.0) -> None:
        self.url, self.tokens, self.timeout = url, tokens, timeout
        self.stop = threading.Event()
        self.codes: Counter[int | str] = Counter()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(threads)]

    def _client(self, index: int) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            n = 0
            while not self.stop.is_set():
                n += 1
                body = {"model": "m", "prompt": f"client {index} request {n}", "max_tokens": self.tokens}
                try:
                    code: int | str = client.post(f"{self.url}/v1/completions", json=body).status_code
                except httpx.HTTPError as exc:
                    code = type(exc).__name__
                    if isinstance(exc, httpx.ConnectError):  # never sent (nothing listens): retried, as clients do
                        self.stop.wait(REFUSED_BACKOFF)
                with self._lock:
                    self.codes[code] += 1

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(self.timeout)
