"""Checkpoint certificates: when a rank saves a checkpoint, write next to it what trainscout knew.

`torch.save`, `torch.distributed.checkpoint.save` and DeepSpeed's `save_checkpoint` are wrapped; after a
successful save the wrapper writes a JSON certificate: certified (every check up to that step agreed
and the rotations completed clean), suspect (an integrity finding is unresolved) or unverified (not
enough checking done yet). The trust state comes from the coordinator through the node agent (a small
file in shared memory). `trainscout checkpoints DIR` lists certificates and re-judges them against
findings made after the save.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from trainscout.channel.layout import trust_path
from trainscout.markers import BUSY_CHECKPOINT

CERT_SUFFIX = ".trainscout-cert.json"
DIR_CERT_NAME = "trainscout-cert.json"
MAX_FOLLOWED = 16  # recent checkpoints whose certificate follows a rename
CERT_INDEX = "certificates.jsonl"  # in the run folder: where each certificate of the run was written


def read_trust(run_id: str) -> dict:
    """The coordinator's trust state as the agent wrote it; {} when absent or unreadable."""
    try:
        with open(trust_path(run_id)) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}  # another JSON shape says nothing about trust


def certificate(run_id: str, rank: int, step: int, target: str, how: str) -> dict:
    trust = read_trust(run_id)
    verified = trust.get("verified_step", -1)
    # only the shapes the coordinator writes can certify: a step that is not an integer, or a "clean" that is
    # not true, leaves the checkpoint unverified
    verified_ok = isinstance(verified, int) and not isinstance(verified, bool) and verified >= 0
    if not trust:
        status, reason = "unverified", "no trust state from the coordinator yet"
    elif trust.get("suspect_since") is not None:
        status = "suspect"
        reason = f"integrity finding at step {trust['suspect_since']} not resolved"
    elif verified_ok and trust.get("replay_rotation_clean", True) is True:
        status, reason = "certified", "every check agreed; state and replay rotations completed clean"
    else:
        status, reason = "unverified", "rotations not yet complete"
    return {
        "schema": 1,
        "checkpoint": os.path.abspath(target),
        "saved_by": how,
        "rank": rank,
        "step": step,
        "saved_at": time.time(),
        "run_id": run_id,
        "run_dir": os.environ.get("TRAINSCOUT_RUN_DIR", ""),
        "status": status,
        "reason": reason,
        "trust": trust,
    }


def write_certificate(cert: dict, target: str) -> str | None:
    path = os.path.join(target, DIR_CERT_NAME) if os.path.isdir(target) else target + CERT_SUFFIX
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(cert, fh, indent=1)
        os.replace(tmp, path)
        return path
    except OSError:
        return None


def record_certificate(run_dir: str, cert_path: str, cert: dict) -> None:
    """Tell the run where a certificate was written (the coordinator's verdict names the checkpoint to restart
    from): one short line appended to the run folder's index, in one write."""
    if not run_dir:
        return
    line = json.dumps({"certificate": cert_path, "checkpoint": cert["checkpoint"], "step": cert["step"]}) + "\n"
    fd = os.open(os.path.join(run_dir, CERT_INDEX), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class CheckpointHooks:
    def __init__(self, run_id: str, rank: int, get_step, on_error, on_duration=None, activity=None) -> None:
        self.on_duration = on_duration  # (wall s, cpu s) spent saving, for the step timings
        self.activity = activity  # marks the rank busy writing while a save runs (the hang vote's exception)
        self.run_id = run_id
        self.rank = rank
        self.get_step = get_step
        self.on_error = on_error
        self.written: list[str] = []
        # checkpoint path -> its certificate, for the newest few: a job that saves to a temporary name and
        # renames it into place (so no reader sees half a file) has its certificate follow the rename
        self._certified: dict[str, tuple[str, dict]] = {}
        self._real_rename: dict[str, Callable] = {}

    def _after_save(self, target, how: str) -> None:
        try:
            if isinstance(target, (str, os.PathLike)):
                cert = certificate(self.run_id, self.rank, self.get_step(), os.fspath(target), how)
                path = write_certificate(cert, os.fspath(target))
                if path:
                    self.written.append(path)
                    record_certificate(cert["run_dir"], path, cert)
                    self._certified[os.path.abspath(os.fspath(target))] = (path, cert)
                    while len(self._certified) > MAX_FOLLOWED:
                        self._certified.pop(next(iter(self._certified)))
        except Exception as exc:
            self.on_error(f"checkpoint certificate not written: {exc!r}")

    def wrap_renames(self, module=None) -> None:
        """Wrap os.replace and os.rename (pathlib and shutil.move use them) so a certified checkpoint renamed
        into place takes its certificate along; any other rename costs one dictionary lookup."""
        for name in ("replace", "rename"):
            real = getattr(os, name)
            if getattr(real, "__trainscout__", False):
                continue
            self._real_rename[name] = real

            def renamed(src, dst, *args, _real=real, **kwargs):
                result = _real(src, dst, *args, **kwargs)
                if self._certified and isinstance(src, (str, os.PathLike)) and isinstance(dst, (str, os.PathLike)):
                    self._follow(os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst)))
                return result

            renamed.__wrapped__ = real  # type: ignore[attr-defined]
            renamed.__trainscout__ = True  # type: ignore[attr-defined]
            renamed.__doc__ = real.__doc__
            setattr(os, name, renamed)

    def _follow(self, src: str, dst: str) -> None:
        entry = self._certified.pop(src, None)
        if entry is None:
            return
        try:
            old_cert, cert = entry
            cert = {**cert, "checkpoint": dst}
            if os.path.isdir(dst):  # the certificate moved inside the folder: only its content changes
                new_cert = os.path.join(dst, DIR_CERT_NAME)
            else:
                new_cert = dst + CERT_SUFFIX
            path = write_certificate(cert, dst)
            if path is None:
                return
            if not os.path.isdir(dst) and old_cert != new_cert:
                try:
                    os.unlink(old_cert)
                except OSError:
                    pass
            self.written.append(path)
            record_certificate(cert["run_dir"], path, cert)
            self._certified[dst] = (path, cert)
        except Exception as exc:
            self.on_error(f"checkpoint certificate not moved with its checkpoint: {exc!r}")

    def _timed(self, real, *args, **kwargs):
        """Call a saver and report its wall and CPU time (checkpoint-write stall timings)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        marked = self.activity is not None and self.activity.enter(BUSY_CHECKPOINT)
        try:
            return real(*args, **kwargs)
        finally:
            if marked and self.activity is not None:
                self.activity.leave()
            if self.on_duration is not None:
                self.on_duration(time.perf_counter() - t0, time.thread_time() - c0)

    def wrap_torch_save(self, module) -> None:
        real = module.save
        hooks = self

        def save(obj, f, *args, **kwargs):
            result = hooks._timed(real, obj, f, *args, **kwargs)
            hooks._after_save(f, "torch.save")
            return result

        save.__wrapped__ = real  # type: ignore[attr-defined]
        save.__doc__ = real.__doc__
        module.save = save

    def wrap_dcp_save(self, module) -> None:
        real = getattr(module, "save", None)
        if real is None:
            return
        hooks = self

        def dcp_save(*args, **kwargs):
            result = hooks._timed(real, *args, **kwargs)
            target = kwargs.get("checkpoint_id")
            if target is None and len(args) > 1:
                target = args[1]
            if hooks.rank == 0 and target is not None:
                hooks._after_save(target, "torch.distributed.checkpoint.save")
            return result

        dcp_save.__wrapped__ = real  # type: ignore[attr-defined]
        dcp_save.__doc__ = real.__doc__
        module.save = dcp_save

    def wrap_deepspeed(self, module) -> None:
        cls = getattr(module, "DeepSpeedEngine", None)
        if cls is None:
            return
        real = cls.save_checkpoint
        hooks = self

        def save_checkpoint(engine, save_dir, tag=None, *args, **kwargs):
            result = real(engine, save_dir, tag, *args, **kwargs)
            if hooks.rank == 0:
                hooks._after_save(
                    os.path.join(save_dir, str(tag if tag is not None else engine.global_steps)),
                    "deepspeed save_checkpoint",
                )
            return result

        save_checkpoint.__wrapped__ = real  # type: ignore[attr-defined]
        cls.save_checkpoint = save_checkpoint
