"""Layout of the per-rank shared-memory channel in /dev/shm, named by run id and global rank.

One file = a header record followed by a fixed-size ring of fixed-size collective records, both numpy
structured arrays over one mmap. The probe (in the rank process) is the only writer; the node agent
reads. Each header field has exactly one writing thread, so a single 8-byte aligned store is what a
reader sees (no tearing on the platforms torch supports). Ring slots carry a seqlock word: the writer
makes it odd before filling a slot and even after, and a reader keeps a slot only if it read the same
even value before and after copying it.
"""

from __future__ import annotations

import os

import numpy as np

MAGIC = 0x5453434F55540005  # "TSCOUT" + layout version 5
RING_SLOTS = 4096
DESC_BYTES = 120
ERROR_PG_INDEX = -6  # ring records with this pg index are the probe's internal errors, in order
TEXT_BYTES = 480
SHM_DIR = "/dev/shm"

HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u8"),
        ("pid", "<i8"),
        ("rank", "<i8"),
        ("local_rank", "<i8"),
        ("world_size", "<i8"),
        ("start_wall_ns", "<i8"),
        ("attempt", "<i8"),  # the launcher's restart attempt (TORCHELASTIC_RESTART_COUNT; 0: the first)
        # written by the publisher thread
        ("heartbeat_ns", "<i8"),  # CLOCK_MONOTONIC, shared by all processes of one host
        ("collectives", "<i8"),  # total collectives seen
        ("progress_ns", "<i8"),  # monotonic time the collective count last changed
        ("ring_head", "<i8"),  # records ever written; slot = (n - 1) % RING_SLOTS
        ("pg_table_version", "<i8"),  # bumped when the sidecar pg table file changes
        ("fr_available", "<i8"),
        ("disabled_checks", "<i8"),  # bitmask of checks that failed and were turned off (fail open)
        ("dropped", "<i8"),  # records the Flight Recorder overwrote before the probe read them
        ("sig_mismatch", "<i8"),  # Python-path signatures that differed from the Flight Recorder's (self-check)
        ("moving_ns", "<i8"),  # last time the training thread was seen working between collectives (activity.py)
        ("gpu_pending_ns", "<i8"),  # when an event behind the training stream's queued work was recorded, still
        # not completed (gpu_queue.py; 0: none pending)
        # written by the training thread (optimizer step hook)
        ("step", "<i8"),
        ("step_ns", "<i8"),
        # the rank's own work between collectives (probe/activity.py): what, and since when (monotonic ns)
        ("busy", "<i8"),
        ("busy_ns", "<i8"),
        # written once, at exit, by whichever thread sees it
        ("exit_state", "<i8"),  # 0 running, 1 exit recorded
        ("exit_code", "<i8"),
        ("exit_signal", "<i8"),
        ("exit_ns", "<i8"),
        ("exit_how", "S16"),
        ("exit_text", f"S{TEXT_BYTES}"),
        ("error_text", f"S{TEXT_BYTES}"),  # last internal probe error (it then disabled that check)
    ],
    align=True,
)

RECORD_DTYPE = np.dtype(
    [
        ("lock", "<u8"),
        ("pg_index", "<i8"),
        ("seq", "<i8"),
        ("entry_hash", "<u8"),
        ("rolling_hash", "<u8"),  # collectives: flags (protocol.NATIVE, DETAIL); the agent chains the hashes
        ("wall_ns", "<i8"),
        ("step", "<i8"),
        ("op", "S24"),
        ("desc", f"S{DESC_BYTES}"),
    ],
    align=True,
)

HEADER_BYTES = (HEADER_DTYPE.itemsize + 63) // 64 * 64
TOTAL_BYTES = HEADER_BYTES + RING_SLOTS * RECORD_DTYPE.itemsize


def channel_prefix(run_id: str) -> str:
    return f"trainscout-{run_id}-"


def channel_path(run_id: str, rank: int) -> str:
    return os.path.join(SHM_DIR, f"{channel_prefix(run_id)}{rank}.ch")


def pg_table_path(run_id: str, rank: int) -> str:
    """Sidecar JSON with the rank's process groups (name, desc, members); rarely rewritten."""
    return os.path.join(SHM_DIR, f"{channel_prefix(run_id)}{rank}.pgs.json")


def tensor_table_path(run_id: str, rank: int) -> str:
    """Sidecar JSON naming the tensors whose fingerprints the ring carries, and their replica group."""
    return os.path.join(SHM_DIR, f"{channel_prefix(run_id)}{rank}.tensors.json")


def evidence_table_path(run_id: str, rank: int) -> str:
    """Sidecar JSON naming the layers whose gradient norms the rank's evidence records carry."""
    return os.path.join(SHM_DIR, f"{channel_prefix(run_id)}{rank}.evidence.json")


def link_probe_request_path(run_id: str) -> str:
    """Node-wide JSON the agent writes when the coordinator schedules a link probe (communication stragglers)."""
    return os.path.join(SHM_DIR, f"{channel_prefix(run_id)}linkprobe.json")


def replay_request_path(run_id: str) -> str:
    """Node-wide JSON the agent writes when the coordinator schedules an on-command replay."""
    return os.path.join(SHM_DIR, f"{channel_prefix(run_id)}replay.json")


def trust_path(run_id: str) -> str:
    """Node-wide JSON the agent writes from the coordinator's trust state (for checkpoint certificates)."""
    return os.path.join(SHM_DIR, f"{channel_prefix(run_id)}trust.json")


def stack_path(run_id: str, rank: int) -> str:
    """Where the probe's faulthandler writes a stack dump when the agent signals it."""
    return os.path.join(SHM_DIR, f"{channel_prefix(run_id)}{rank}.stack")


def list_channels(run_id: str) -> dict[int, str]:
    prefix = channel_prefix(run_id)
    found: dict[int, str] = {}
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return found
    for name in names:
        if name.startswith(prefix) and name.endswith(".ch"):
            try:
                found[int(name[len(prefix) : -3])] = os.path.join(SHM_DIR, name)
            except ValueError:
                continue
    return found


def claim_run_id(run_id: str) -> int | None:
    """Claim a run id on this host for this process, atomically: None once claimed (or where there is no
    shared memory to guard), else the pid of the live process that holds it. Two runs started in the same
    second both found no live ranks under the id and shared one set of channels; the claim file (created
    with O_EXCL) lets only one of them start. It is a run file, so the run's clean-up removes it."""
    path = os.path.join(SHM_DIR, channel_prefix(run_id) + "claim")
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _claim_holder(path)
            if holder is not None and holder != os.getpid():
                return holder
            try:  # a claim left by a process that is gone (killed before its clean-up)
                os.unlink(path)
            except OSError:
                pass
            continue
        except OSError:
            return None
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
        return None
    return None


def release_run_id(run_id: str) -> None:
    """Give up this process's claim on a run id (the run's clean-up usually removed it already)."""
    path = os.path.join(SHM_DIR, channel_prefix(run_id) + "claim")
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return
    if text in ("", str(os.getpid())):  # ours, or ours cut short before its pid was written
        try:
            os.unlink(path)
        except OSError:
            pass


def _claim_holder(path: str) -> int | None:
    """The pid in a claim file if that process is alive; None for a stale or unreadable claim."""
    try:
        with open(path) as fh:
            pid = int(fh.read().strip() or "0")
    except (OSError, ValueError):
        return None  # (a claim being written this instant reads empty: the next try sees its pid)
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass  # alive, another user's
    return pid


def remove_run_files(run_id: str) -> int:
    """Delete every shared-memory file of a run; returns how many were removed."""
    prefix = channel_prefix(run_id)
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed
