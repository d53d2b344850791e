"""Where a slow rank spends the time its peers do not: its sampled stacks set against theirs.

The agent samples the training thread of the slow rank and of some of its peers from outside the processes,
over the same seconds (py-spy's collapsed stacks: one line per distinct stack, `frame;frame;... count`,
outermost first). Peers run the same code, so a function that takes a share of the slow rank's samples and
little of theirs is where its extra time goes: a sleep in a forward hook, a blocking read in a data path, a
lock, a loop. Shares, not counts, are compared (the processes need not be sampled equally often).

Pure logic over text: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_EXCESS = 0.05  # a frame must hold at least 5 % more of the slow rank's samples than of any peer's
_NOISE = ("threading.py", "<frozen ", "runpy.py")
# A straggler waits less than its peers in collectives (they wait for it): time there is never its excess, and
# a busy machine moves a few percent of samples in or out of them at random.
_COLLECTIVE = ("distributed_c10d.py", "c10d_logger.py", "probe/collectives.py")


@dataclass
class Where:
    frame: str  # the innermost frame that holds the excess, "function (file:line)"
    path: list[str]  # outermost first, down to that frame
    share: float  # of the slow rank's samples
    peer_share: float  # the largest share among its peers
    samples: int

    def line(self) -> str:
        tail = " <- ".join(reversed(self.path[-4:]))
        return (
            f"{tail}: {self.share * 100:.0f}% of its sampled time, {self.peer_share * 100:.0f}% of its "
            f"peers' ({self.samples} samples)"
        )


def parse_collapsed(text: str, thread: str = "MainThread") -> tuple[dict[tuple[str, ...], int], int]:
    """{stack (outermost first): samples} of one thread, and the thread's total samples."""
    stacks: dict[tuple[str, ...], int] = {}
    total = 0
    for line in text.splitlines():
        head, _, count = line.rpartition(" ")
        if not head or not count.isdigit():
            continue
        frames = head.split(";")
        if frames and frames[0].startswith("thread ("):
            if thread not in frames[0]:
                continue
            frames = frames[1:]
        n = int(count)
        total += n
        key = tuple(f for f in frames if f and not any(s in f for s in _NOISE))
        stacks[key] = stacks.get(key, 0) + n
    return stacks, total


def _shares(stacks: dict[tuple[str, ...], int], total: int) -> dict[tuple[str, ...], float]:
    """For every stack prefix (a frame with its callers), the share of samples whose stack passes through it."""
    out: dict[tuple[str, ...], float] = {}
    if total <= 0:
        return out
    for stack, n in stacks.items():
        for depth in range(1, len(stack) + 1):
            prefix = stack[:depth]
            out[prefix] = out.get(prefix, 0.0) + n / total
    return out


def _frame_shares(stacks: dict[tuple[str, ...], int], total: int) -> dict[str, float]:
    """Share of samples that have a frame anywhere in their stack (callers may differ between ranks)."""
    out: dict[str, float] = {}
    if total <= 0:
        return out
    for stack, n in stacks.items():
        for frame in set(stack):
            out[frame] = out.get(frame, 0.0) + n / total
    return out


def where_time_goes(slow: str, peers: list[str]) -> Where | None:
    """The frame of the slow rank that carries its excess: the stack prefix whose share of its samples exceeds
    every peer's share of that frame the most, then followed down through callees that keep most of that
    excess (the function that sleeps or works, not only its callers). None when no frame exceeds its peers'
    share by MIN_EXCESS or nothing was sampled."""
    stacks, total = parse_collapsed(slow)
    if total <= 0:
        return None
    peer_frames = []
    for text in peers:
        p_stacks, p_total = parse_collapsed(text)
        if p_total > 0:
            peer_frames.append(_frame_shares(p_stacks, p_total))
    if not peer_frames:
        return None
    shares = _shares(stacks, total)
    excess = {
        prefix: share - max(f.get(prefix[-1], 0.0) for f in peer_frames)
        for prefix, share in shares.items()
        if not any(c in frame for frame in prefix for c in _COLLECTIVE)
    }
    best = max(excess, key=lambda k: (excess[k], -len(k)), default=None)
    if best is None or excess[best] < MIN_EXCESS:
        return None
    while True:
        children = [k for k in excess if len(k) == len(best) + 1 and k[:-1] == best]
        child = max(children, key=lambda k: excess[k], default=None)
        if child is None or excess[child] < 0.7 * excess[best]:
            break
        best = child
    share = shares[best]
    return Where(frame=best[-1], path=list(best), share=share, peer_share=share - excess[best], samples=total)
