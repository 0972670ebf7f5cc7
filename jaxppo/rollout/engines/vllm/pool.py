"""The vLLM servers of `rollout_engine="vllm-server"` seen from the trainer: HTTP requests
to each (JSON over the standard library's `urllib`, no vLLM in the trainer's process),
requests spread over the live servers and gathered in order, a server that fails dropped
and its requests sent to the others.

A failure is one of two kinds. `ServerDown`: the server could not be reached, refused the
connection, closed it, timed out or answered 5xx; the server is taken out of the pool and
what it was asked is asked of another. `ServerRefused`: the server answered 4xx (the
request itself is wrong for it: a setting it does not take, an adapter it does not have);
asking another server would fail the same way, so it is raised at once. A server taken out
is asked for its health before each weight push (`revive`); one that answers again takes
that push in full and rejoins.
"""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import json
import socket
import urllib.error
import urllib.request
import warnings
from typing import Callable, List, Optional, Sequence

__all__ = ["ServerDown", "ServerRefused", "Server", "ServerPool", "check_urls"]


class ServerDown(ConnectionError):
    """A vLLM server could not be reached, timed out or failed (5xx)."""


class ServerRefused(RuntimeError):
    """A vLLM server refused a request (4xx): the request is wrong for it."""


def _call(url: str, path: str, body=None, timeout: float = 60.0):
    """POST `body` as JSON to `url + path` (GET where `body` is None); the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read()
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:500]
        kind = ServerRefused if 400 <= error.code < 500 else ServerDown
        raise kind(f"{url}{path}: HTTP {error.code}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, http.client.HTTPException, socket.timeout, TimeoutError,
            OSError) as error:
        reason = getattr(error, "reason", error)
        raise ServerDown(f"{url}{path}: {type(reason).__name__}: {reason}") from None
    try:
        return json.loads(text) if text else None
    except ValueError:  # some routes answer plain text
        return text.decode(errors="replace")


class Server:
    """One vLLM server: its URL, whether it is still used, and why it stopped being used."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.failure: Optional[str] = None

    @property
    def alive(self) -> bool:
        return self.failure is None

    def call(self, path: str, body=None, timeout: Optional[float] = None):
        return _call(self.url, path, body, self.timeout if timeout is None else timeout)

    def __repr__(self):
        return f"Server({self.url!r}{'' if self.alive else ', down'})"


def check_urls(urls: Sequence[str], timeout: float = 10.0) -> None:
    """Refuse, before anything compiles, servers that are not there or not started for
    jaxppo: each must answer `/health`, have vLLM's weight-update routes (the server's
    development mode, `VLLM_SERVER_DEV_MODE=1`) and its tokens-in, tokens-out route
    (`--tokens-only` or `--enable-scale-out`). `jaxppo serve` starts one with all three."""
    problems = []
    for url in urls:
        server = Server(url, timeout)
        try:
            server.call("/health")
        except (ServerDown, ServerRefused) as error:
            problems.append(f"{url} is unreachable ({error})")
            continue
        try:
            server.call("/weight_info")
        except (ServerDown, ServerRefused):
            problems.append(f"{url} has no weight-update routes (/weight_info): start it with VLLM_SERVER_DEV_MODE=1 "
                            "and --weight-transfer-config '{\"backend\": \"jaxppo-files\"}'")
            continue
        try:
            server.call("/inference/v1/generate", {})
        except ServerRefused as error:
            if "HTTP 403" in str(error) or "HTTP 404" in str(error):  # else: there, and refused the empty request
                problems.append(f"{url} does not serve /inference/v1/generate (tokens in, tokens out): start it "
                                "with --tokens-only")
        except ServerDown as error:
            problems.append(f"{url} failed a request ({error})")
    if problems:
        raise ConnectionError("rollout_engine='vllm-server': " + "; ".join(problems)
                              + ". `jaxppo serve MODEL_DIR --port PORT` starts a vLLM server with what jaxppo needs")


class ServerPool:
    """The run's servers. `run(bodies, path)` sends each body to one live server (at most
    `per_server` in flight on each, so that vLLM batches them) and returns the answers in
    order; a server that fails (`ServerDown`) is dropped and its requests go to the others.
    `each(fn)` calls `fn(server)` on every live server (a weight push), dropping those that
    fail. With no live server left, RuntimeError naming each server's failure."""

    def __init__(self, urls: Sequence[str], timeout: float, per_server: int = 32,
                 warn: Optional[Callable[[str], None]] = None):
        self.servers = [Server(url, timeout) for url in urls]
        self.per_server = per_server
        self.warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=4))
        self.answered = collections.Counter()  # requests each server answered (by URL)

    @property
    def live(self) -> List[Server]:
        return [s for s in self.servers if s.alive]

    def _down(self, server: Server, error: Exception):
        if server.alive:
            server.failure = str(error)
            self.warn(f"jaxppo: vLLM server {server.url} dropped from the run ({error}); "
                      f"{len(self.live)} of {len(self.servers)} left")
        if not self.live:
            failures = "; ".join(f"{s.url}: {s.failure}" for s in self.servers)
            raise RuntimeError(f"every vLLM server of the run failed ({failures}). Nothing sampled in this iteration "
                               "was trained on; the run's last checkpoint is intact: start the servers again and "
                               "resume the run")

    def revive(self, timeout: float = 2.0) -> List[Server]:
        """The servers taken out that answer `/health` again (within `timeout` seconds):
        back in the pool, to be given the weights in full before they sample."""
        back = []
        for server in self.servers:
            if server.alive:
                continue
            try:
                server.call("/health", timeout=timeout)
            except (ServerDown, ServerRefused):
                continue
            self.warn(f"jaxppo: vLLM server {server.url} answers again (it was dropped: {server.failure}); "
                      "it rejoins the run with the next weight push")
            server.failure = None
            back.append(server)
        return back

    def each(self, fn: Callable[[Server], object]) -> list:
        """[fn(server)] for each server alive after the call."""
        out = []
        for server in self.live:
            try:
                out.append(fn(server))
            except ServerDown as error:
                self._down(server, error)
        return out

    def run(self, bodies: Sequence[dict], path: str) -> list:
        results: list = [None] * len(bodies)
        pending = collections.deque(range(len(bodies)))
        load = collections.Counter()
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.servers) * self.per_server)) as pool:
            running = {}
            while pending or running:
                while pending:  # each request to the least loaded live server with room
                    free = [s for s in self.live if load[s.url] < self.per_server]
                    if not free:
                        break
                    server = min(free, key=lambda s: load[s.url])
                    i = pending.popleft()
                    running[pool.submit(server.call, path, bodies[i])] = (i, server)
                    load[server.url] += 1
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    i, server = running.pop(future)
                    load[server.url] -= 1
                    try:
                        results[i] = (future.result(), server.url)
                        self.answered[server.url] += 1
                    except ServerDown as error:
                        pending.append(i)
                        self._down(server, error)
        return results
