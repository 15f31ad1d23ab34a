"""`PDRouter`: SGLang's mini load balancer (``sglang.srt.disaggregation.mini_lb``) as a library
class: several decode servers, each linked to the same prefill servers, and every request sent to
one decode server and one prefill server.

Each request goes to the decode server with the fewest outstanding requests (submitted there and
not yet ended) and to the prefill server with the fewest prompts outstanding (ordered and not yet
answered with a first token, over every decode server); ties go round robin, so equal loads take
turns. The prefill choice is passed to the decode server (``DecodeServer.submit(...,
prefill=index)``), which orders the prompt there and pulls its KV from there. `step` steps every
decode server; `run` serves requests to completion. The counters say where each request went.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvjax.disaggregation.decode import DecodeServer
from kvjax.serve.serving_req import ServingReq

__all__ = ["PDRouter"]


def _least_loaded(loads: Sequence[int], start: int) -> int:
    """The index of the smallest load; among equal ones the first at or after ``start`` (round robin)."""
    n = len(loads)
    order = [(start + i) % n for i in range(n)]
    return min(order, key=lambda i: loads[i])


class PDRouter:
    """Routes requests over ``decode`` servers sharing the same prefill servers (see the module
    docstring).

    Counters: ``decode_requests[d]`` / ``prefill_requests[p]``: requests routed to decode server
    ``d`` / prefill server ``p``; ``route``: request id -> ``(d, p)``; ``finished`` / ``failed``:
    the requests that ended (``failed``: with ``abort_reason``)."""

    def __init__(self, decode: Sequence[DecodeServer]) -> None:
        if not decode:
            raise ValueError("a router needs at least one decode server")
        addresses = [tuple(p.address for p in server.peers) for server in decode]
        if any(a != addresses[0] for a in addresses):
            raise ValueError(
                f"every decode server must be linked to the same prefill servers, in the same order: {addresses}"
            )
        self.decode = list(decode)
        self.prefill_addresses = list(addresses[0])
        self.decode_requests = [0] * len(self.decode)
        self.prefill_requests = [0] * len(self.prefill_addresses)
        self.route: dict[Any, tuple[int, int]] = {}
        self.finished: list[ServingReq] = []
        self.failed: list[ServingReq] = []
        self._next_decode = 0
        self._next_prefill = 0

    # --- load -------------------------------------------------------------------------------------

    def decode_load(self) -> list[int]:
        """Outstanding requests per decode server (submitted, not ended)."""
        return [len(server.rooms) for server in self.decode]

    def prefill_load(self) -> list[int]:
        """Prompts outstanding per prefill server: ordered, not yet answered with a first token."""
        load = [0] * len(self.prefill_addresses)
        for server in self.decode:
            for room in server.rooms.values():
                if room.state == "prefilling":
                    load[server.peers.index(room.peer)] += 1
        return load

    # --- requests ---------------------------------------------------------------------------------

    def pick(self) -> tuple[int, int]:
        """The ``(decode, prefill)`` pair the next request goes to (advancing the round robin)."""
        d = _least_loaded(self.decode_load(), self._next_decode)
        p = _least_loaded(self.prefill_load(), self._next_prefill)
        self._next_decode = (d + 1) % len(self.decode)
        self._next_prefill = (p + 1) % len(self.prefill_addresses)
        return d, p

    def submit(self, reqs: Iterable[ServingReq]) -> None:
        """Send each request to the decode and prefill servers `pick` chooses."""
        for req in reqs:
            if req.rid in self.route:
                raise ValueError(f"request {req.rid!r} was routed already; request ids must be unique")
            d, p = self.pick()
            self.decode[d].submit([req], prefill=p)
            self.route[req.rid] = (d, p)
            self.decode_requests[d] += 1
            self.prefill_requests[p] += 1

    @property
    def idle(self) -> bool:
        return all(server.idle for server in self.decode)

    def step(self) -> list[ServingReq]:
        """Step every decode server; the requests that ended (finished, or failed with
        ``abort_reason``)."""
        done: list[ServingReq] = []
        for server in self.decode:
            if not server.idle:
                done += server.step()
        for req in done:
            (self.failed if req.abort_reason is not None else self.finished).append(req)
        return done

    def run(self, reqs: Iterable[ServingReq] = ()) -> list[ServingReq]:
        """Submit ``reqs`` and step until every decode server is idle; the requests in ending order."""
        self.submit(reqs)
        done: list[ServingReq] = []
        while not self.idle:
            done += self.step()
        return done

    def counters(self) -> dict[str, Any]:
        """Per server: requests routed; per decode server also tokens pulled and reused, failures."""
        return dict(
            decode=[
                dict(
                    name=server.name,
                    requests=self.decode_requests[d],
                    pulled_tokens=server.pulled_tokens,
                    reused_tokens=server.reused_tokens,
                    failed=len(server.failed),
                )
                for d, server in enumerate(self.decode)
            ],
            prefill=[
                dict(address=address, requests=self.prefill_requests[p])
                for p, address in enumerate(self.prefill_addresses)
            ],
        )

    def leak_free(self) -> bool:
        return all(server.leak_free() for server in self.decode)

    def close(self) -> None:
        for server in self.decode:
            server.close()
