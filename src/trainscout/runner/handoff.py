"""Handing a localized fault over to whoever acts on it: verdict.json, the `--on-finding` command, the exit status.

The coordinator calls `Handoff.on_finding` for every finding it emits. A finding that names culprits
rewrites `runs/<id>/verdict.json` and queues one run of the user's `--on-finding` command. The command runs
through the shell in a background thread, one at a time, so detection never waits for it; its output goes to
`runs/<id>/on_finding.log`, and it finds the verdict through the environment (TRAINSCOUT_VERDICT).

`exit_status` turns the launcher's exit code and the run's findings into `trainscout run`'s exit status, the
one a scheduler reads (README, "Exit status").
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from trainscout.findings import Finding
from trainscout.sinks import verdict
from trainscout.sinks.jsonl import read_objects

ON_FINDING_LOG = "on_finding.log"
HOOK_TIMEOUT_S = 600.0  # a command still running after this long is killed: the next finding must get its turn
HOOK_QUEUE = 16  # findings waiting for the command beyond this are dropped (and logged)
ABORT_MARK = "aborting"  # file in the run folder: the job is being stopped on purpose (--abort-on)

# trainscout run's exit status (documented in README and `trainscout run --help`)
EXIT_OK = 0  # the job succeeded
EXIT_USAGE = 2  # bad command line or setting; nothing was started
EXIT_LOCALIZED = 3  # the job failed or was stopped, and a culprit was named (verdict.json)
EXIT_UNEXPLAINED = 4  # the job failed and nobody was named

EXIT_HELP = """\
exit status (--exit-status verdict, the default):
  0  the job succeeded (findings it survived, e.g. a straggler, are in the report and verdict.json)
  2  bad command line or setting: nothing was started
  3  the job failed or was stopped (--abort-on) and trainscout named a culprit: see runs/<id>/verdict.json
  4  the job failed and trainscout named nobody
  130 / 143  trainscout was interrupted (SIGINT / SIGTERM) and named nobody
  with --exit-status launcher: the launcher's own exit code
"""


def exit_status(launcher_code: int, findings: list[Finding], interrupted_by: int = 0, mode: str = "verdict") -> int:
    """`trainscout run`'s exit status from the launcher's code and the findings (see EXIT_HELP)."""
    if mode == "launcher":
        return launcher_code
    if launcher_code == 0:
        return EXIT_OK
    if any(verdict.names_culprits(f) for f in findings):
        return EXIT_LOCALIZED
    if interrupted_by:
        return 128 + interrupted_by
    return EXIT_UNEXPLAINED


def exit_meaning(status: int) -> str:
    return {
        EXIT_OK: "the job succeeded",
        EXIT_LOCALIZED: "fault localized, see verdict.json",
        EXIT_UNEXPLAINED: "the job failed and nobody was named",
        130: "interrupted",
        143: "terminated",
    }.get(status, "the launcher's exit code")


class CommandRunner:
    """Runs a shell command per request, one at a time, in a background thread; never blocks the caller."""

    def __init__(self, command: str, log_path: str, env: dict[str, str]) -> None:
        self.command = command
        self.log_path = log_path
        self.env = env
        self.started = 0
        self.dropped = 0
        self._queue: queue.Queue[dict[str, str]] = queue.Queue(maxsize=HOOK_QUEUE)
        self._thread = threading.Thread(target=self._work, name="on-finding", daemon=True)
        self._thread.start()

    def submit(self, extra_env: dict[str, str]) -> bool:
        try:
            self._queue.put_nowait(extra_env)
            return True
        except queue.Full:
            self.dropped += 1
            self._log(f"# too many findings waiting: one run of the command skipped ({extra_env})\n")
            return False

    def drain(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for queued and running commands to finish; True when they all did."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0:
                return True
            time.sleep(0.05)
        return self._queue.unfinished_tasks == 0

    def _log(self, text: str) -> None:
        with open(self.log_path, "a") as fh:
            fh.write(text)

    def _work(self) -> None:
        while True:
            extra = self._queue.get()
            try:
                self._run_one(extra)
            except OSError as exc:
                self._log(f"# could not run the command: {exc}\n")
            finally:
                self._queue.task_done()

    def _run_one(self, extra: dict[str, str]) -> None:
        self.started += 1
        with open(self.log_path, "a") as log:
            log.write(f"# {time.strftime('%H:%M:%S')} run {self.started}: {self.command}\n")
            log.flush()
            proc = subprocess.Popen(
                self.command,
                shell=True,
                env={**self.env, **extra},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C meant for the job does not reach it
            )
            try:
                code = proc.wait(timeout=HOOK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
            log.write(f"# run {self.started} ended with exit code {code}\n")


class Handoff:
    """verdict.json and the --on-finding command, fed with the coordinator's findings."""

    def __init__(
        self,
        run_dir: str,
        run_id: str,
        on_finding: str = "",
        env: dict[str, str] | None = None,
        checkpoint: Callable[[str], dict | None] = verdict.trusted_checkpoint,
    ) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.path = os.path.join(run_dir, verdict.VERDICT_FILE)
        self._checkpoint = checkpoint
        self.runner = (
            CommandRunner(on_finding, os.path.join(run_dir, ON_FINDING_LOG), dict(os.environ if env is None else env))
            if on_finding
            else None
        )

    def on_finding(self, finding: Finding, findings: list[Finding]) -> bool:
        """After `finding` was emitted (it is the last of `findings`): True when it was handed over."""
        if not verdict.names_culprits(finding):
            return False
        try:
            verdict.write(self.path, verdict.build(self.run_id, findings, self._checkpoint(self.run_dir)))
        except OSError:
            return False  # a full or vanished disk must not stop detection; findings.jsonl has the finding
        if self.runner is not None:
            self.runner.submit(
                {
                    "TRAINSCOUT_VERDICT": self.path,
                    "TRAINSCOUT_FINDING_KIND": finding.kind,
                    "TRAINSCOUT_RUN_DIR": self.run_dir,
                }
            )
        return True

    def mark_abort(self) -> None:
        """The job is about to be stopped on purpose: the supervisor then keeps its teardown noise off the terminal."""
        try:
            with open(os.path.join(self.run_dir, ABORT_MARK), "w") as fh:
                fh.write(f"{time.time()}\n")
        except OSError:
            pass

    def finish(self, timeout_s: float = 5.0) -> None:
        if self.runner is not None:
            self.runner.drain(timeout_s)


def attempt_lines(events: list[dict]) -> list[str]:
    """summary.md lines on the launcher's restart attempts (torchrun --max-restarts), from events.jsonl:
    when each began and how many findings the run had when it ended."""
    lines = []
    for e in events:
        try:
            line = _attempt_line(e)
        except (TypeError, ValueError, OverflowError, OSError):  # an event of another shape: nothing to say
            continue
        if line:
            lines.append(line)
    return lines


def _attempt_line(e: dict) -> str | None:
    if e.get("kind") == "attempt_end":
        return f"attempt {e.get('attempt')} ended; findings of the run so far: {e.get('findings')}"
    if e.get("kind") == "attempt":
        when = time.strftime("%H:%M:%S", time.localtime(float(e.get("t", 0.0))))
        return f"attempt {e.get('attempt')} began at {when} (elastic restart); its ranks judged afresh"
    if e.get("kind") == "repeat":
        return (
            f"attempt {e.get('attempt')}: {e.get('finding_kind')} of rank(s) {e.get('culprits')} again, as named "
            f"in attempt {e.get('first_attempt')} (not a new fault)"
        )
    return None


def attempt_lines_of(events_path: str) -> list[str]:
    return attempt_lines(read_objects(events_path))  # a torn or foreign line is skipped, not the whole log
