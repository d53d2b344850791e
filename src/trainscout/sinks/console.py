"""Terminal output of findings and of trainscout's own messages.

The coordinator hands every emitted Finding here so the engineer watching `trainscout run` sees it the
moment it is confirmed. On a terminal the output uses rich colours; anywhere else (a log file, CI, a
pipe into grep) it is plain text, one fact per line, so logs stay searchable.
"""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from trainscout import log
from trainscout.findings import Finding

_log = log.get("console")  # what the console shows, also in the run's trainscout.log

MAX_STACK_LINES = 25  # a captured stack is a hint, not the whole dump; the report keeps it in full
PREFIX = "trainscout:"


def _join(values: list) -> str:
    return ", ".join(str(v) for v in values)


def headline(f: Finding) -> str:
    """ "HANG at step 812: rank 13 (...) never entered ..." — the line a person reads first."""
    where = f" at step {f.step}" if f.step is not None else ""
    return f"{f.kind.upper()}{where}: {f.summary}"


def detail_lines(f: Finding, max_stack_lines: int = MAX_STACK_LINES, stacks: bool = True) -> list[str]:
    """The indented lines printed under a headline (shared with the markdown report)."""
    lines = []
    culprits = _join(f.culprit_ranks) if f.culprit_ranks else "none named"
    extra = []
    if f.hosts:
        extra.append(f"hosts {_join(f.hosts)}")
    if f.pids:
        extra.append(f"pids {_join(f.pids)}")
    if f.devices:
        extra.append(f"devices {_join(f.devices)}")
    lines.append(f"  culprit ranks: {culprits}" + (f" ({'; '.join(extra)})" if extra else ""))
    if f.pg is not None or f.collective_seq is not None or f.collective:
        parts = []
        if f.pg is not None:
            parts.append(f"pg {f.pg}")
        if f.collective or f.collective_seq is not None:
            name = f" {f.collective}" if f.collective else ""
            seq = f" #{f.collective_seq}" if f.collective_seq is not None else ""
            parts.append(f"collective{name}{seq}")
        lines.append("  " + ", ".join(parts))
    lines.append(f"  status: {f.status}, confidence {f.confidence:.2f}")
    if not stacks:
        return lines
    for rank, stack in sorted_stacks(f):
        stack_lines = stack.rstrip("\n").splitlines()
        lines.append(f"  stack of rank {rank}:")
        lines.extend(f"    {line}" for line in stack_lines[:max_stack_lines])
        if len(stack_lines) > max_stack_lines:
            lines.append(f"    ... ({len(stack_lines) - max_stack_lines} more lines in the report)")
    return lines


def sorted_stacks(f: Finding) -> list[tuple[str, str]]:
    """(rank, stack) pairs in numeric rank order ("2" before "10")."""
    return sorted(f.stacks.items(), key=lambda kv: (0, int(kv[0]), "") if kv[0].isdigit() else (1, 0, kv[0]))


class ConsoleSink:
    """Prints findings and tool messages to a stream (stdout by default)."""

    def __init__(self, stream: TextIO | None = None, rich: bool | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout
        if rich is None:
            try:
                rich = bool(self._stream.isatty())
            except Exception:  # streams without isatty (or a closed one) are not terminals
                rich = False
        self._console = None
        if rich:
            from rich.console import Console  # imported only when colour is actually wanted

            self._console = Console(file=self._stream, force_terminal=True, highlight=False, soft_wrap=True)
        self._lock = threading.Lock()  # the coordinator may report from more than one thread

    @property
    def is_rich(self) -> bool:
        return self._console is not None

    def finding(self, f: Finding) -> None:
        _log.info("finding: %s", headline(f))
        self._write([(headline(f), "bold red")] + [(line, "") for line in detail_lines(f)])

    def info(self, text: str) -> None:
        _log.info("%s", text)
        self._write([(f"{PREFIX} {text}", "cyan")])

    def warn(self, text: str) -> None:
        _log.warning("%s", text)
        self._write([(f"{PREFIX} warning: {text}", "yellow")])

    def _write(self, lines: list[tuple[str, str]]) -> None:
        with self._lock:
            try:
                if self._console is not None:
                    from rich.text import Text  # Text, not markup: summaries may contain "[...]"

                    for line, style in lines:
                        self._console.print(Text(line, style=style))  # "" is rich's "no style"
                else:
                    self._stream.write("".join(line + "\n" for line, _ in lines))
                self._stream.flush()
            except (OSError, ValueError):  # a closed terminal/pipe must not take the coordinator down
                pass
