"""Link probe: time point-to-point exchanges between pairs of ranks, on command, to find a slow endpoint.

A slow transport on one rank makes every member of its process groups wait equally long inside a ring
collective, so durations at the collective boundary cannot say who is slow. When the coordinator sees a
group's collectives slow down on every member while compute stays the same, it schedules a link probe
at a step a few seconds ahead (like an on-command replay). At that step every probed rank exchanges a
buffer with each partner of a round-robin schedule over the side group (the job's own groups carry no
extra traffic) and records the best of a few timed exchanges per partner. A rank whose exchanges are slow with
every partner is the slow endpoint; a slow pair alone is a slow link. The side group runs on the same
hosts and network interfaces as the job (gloo, TCP), so it sees a slow link or host network stack; a
slow GPU interconnect (NVLink, InfiniBand under NCCL) is outside what it measures.
"""

from __future__ import annotations

import time

from trainscout.probe.requests import RequestFile
from trainscout.probe.side_group import JOIN_S, SIDE_BYTES_S, wait_within
from trainscout.probe.step_timing import STEP_PG_INDEX

EXCHANGE_BYTES = 256 * 1024
REPEATS = 5
# A partner may reach a round late by its own earlier rounds' exchanges (each at most this long, on a link slow
# enough to be worth finding); past that, it is not coming (its step count is off its peers', or it is stopped):
# every wait is bounded, as replay's are, so the job is held seconds and not the side group's minute.
ROUND_S = 2.0


def round_robin(members: list[int]) -> list[dict[int, int]]:
    """Rounds of disjoint pairs covering every pair once (circle method); rank -> partner per round."""
    ranks = sorted(members)
    if len(ranks) % 2:
        ranks.append(-1)  # a bye: whoever meets it sits the round out
    n = len(ranks)
    rounds = []
    for _ in range(n - 1):
        pairs = {}
        for i in range(n // 2):
            a, b = ranks[i], ranks[n - 1 - i]
            if a >= 0 and b >= 0:
                pairs[a], pairs[b] = b, a
        rounds.append(pairs)
        ranks = [ranks[0], ranks[-1], *ranks[1:-1]]
    return rounds


class LinkProbe:
    name = "link_probe"  # its figures' key in the rank's cost report

    def __init__(self, append, rank: int, on_error) -> None:
        self.append = append
        self.rank = rank
        self.on_error = on_error
        self.request: dict | None = None  # {"id", "step", "members"} from the coordinator
        self.spent_s = 0.0
        self.count = 0

    def costs(self) -> dict | None:
        return {"seconds": self.spent_s, "count": self.count} if self.count else None

    def read_request(self, requests: RequestFile, current_step: int) -> None:
        """Publisher thread: pick up a request the agent wrote, if this rank is probed."""
        doc = requests.take(current_step, lambda text: self.on_error(f"link probe {text}"))
        try:
            members = [int(r) for r in doc.get("members", [])] if doc is not None else []
        except (TypeError, ValueError, OverflowError):  # a member list of another shape: no partners to pair
            self.on_error("link probe request with unreadable members")
            return
        if doc is not None and self.rank in members:
            self.request = {"id": int(doc["id"]), "step": int(doc["step"]), "members": members}

    def due(self, step: int) -> bool:
        request = self.request
        if request is None:
            return False
        if step > request["step"]:  # read too late: the partners exchanged without us
            self.request = None
            self.on_error(f"link probe at step {request['step']} missed (at step {step})")
            return False
        return step == request["step"]

    def run(self, step: int, group) -> None:
        """Exchange with each partner in turn over the side group, every wait bounded (ROUND_S, JOIN_S)."""
        import torch
        import torch.distributed as dist

        request, self.request = self.request, None
        assert request is not None  # run only when due(): only this thread unsets it
        t_start = time.perf_counter()
        buf = torch.zeros(EXCHANGE_BYTES // 4, dtype=torch.float32)
        got = torch.empty_like(buf)
        hello, hello_in = torch.zeros(1), torch.zeros(1)
        seconds: dict[int, float] = {}
        transfer_s = JOIN_S + 2 * EXCHANGE_BYTES / SIDE_BYTES_S
        for index, pairs in enumerate(round_robin(request["members"])):
            peer = pairs.get(self.rank)
            if peer is None:
                continue
            # An untimed handshake first: the partner may reach this round later (it was still computing,
            # or finishing its previous round); waiting for it is not the link's time.
            _exchange(dist, self.rank, peer, hello, hello_in, group, JOIN_S + index * ROUND_S)
            times = []
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                _exchange(dist, self.rank, peer, buf, got, group, transfer_s)
                times.append(time.perf_counter() - t0)
            seconds[peer] = min(times)  # the best of a few: scheduling noise only ever adds time
        items = sorted(seconds.items())
        for i in range(0, max(len(items), 1), 8):  # a record's text holds ~10 partners
            desc = ",".join(f"{peer}={int(s * 1e6)}" for peer, s in items[i : i + 8])
            self.append(STEP_PG_INDEX, request["id"], 0, 0, time.time_ns(), step, "link", desc)
        self.spent_s += time.perf_counter() - t_start
        self.count += 1


def _exchange(dist, rank: int, peer: int, out, into, group, limit_s: float) -> None:
    """Send `out` to the peer and receive `into` from it, each waited for at most `limit_s` (then it raises, and
    the link probe turns itself off). The lower rank sends first, so the pair never waits on itself. Looked up at
    call time: whatever sits under torch.distributed's isend/irecv (a slow transport) is what gets measured."""
    if rank < peer:
        wait_within(dist.isend(out, dst=peer, group=group), limit_s, "the link probe")
        wait_within(dist.irecv(into, src=peer, group=group), limit_s, "the link probe")
    else:
        wait_within(dist.irecv(into, src=peer, group=group), limit_s, "the link probe")
        wait_within(dist.isend(out, dst=peer, group=group), limit_s, "the link probe")
