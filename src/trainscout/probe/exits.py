"""Records how a rank ends (exception, sys.exit, os._exit, a terminating signal) in its channel header.

A SIGKILL or a segfault leaves no record: the agent then sees the pid vanish and the launcher's report
supplies the signal. The first recorded cause wins, so atexit does not overwrite an exception.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import traceback

_TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def install(writer, owner_pid: int) -> None:
    def mine() -> bool:
        return os.getpid() == owner_pid  # forked children share the mapping: they must not write

    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if mine() and not issubclass(exc_type, SystemExit):
            writer.record_exit("exception", 1, None, _describe(exc))
        previous_hook(exc_type, exc, tb)

    sys.excepthook = excepthook

    real_exit = sys.exit

    def exit_(code=0):
        if mine():
            handling = sys.exc_info()[1]
            if code not in (0, None) and isinstance(handling, Exception):
                # `except Exception: print the traceback; sys.exit(1)` (torch.multiprocessing.spawn's workers,
                # many scripts' main): the exception is the cause, not the exit call
                writer.record_exit("exception", code if isinstance(code, int) else 1, None, _describe(handling))
            else:
                _record_code(writer, code)
        real_exit(code)

    sys.exit = exit_

    real_os_exit = os._exit

    def os_exit(code):
        if mine():
            writer.record_exit("exit", int(code), None, "os._exit")
        real_os_exit(code)

    os._exit = os_exit

    def at_exit():
        if mine():
            writer.record_exit("exit", 0, None, "interpreter exit")

    atexit.register(at_exit)

    for sig in _TERMINATING:
        try:
            previous = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if previous in (signal.SIG_IGN, None):
            continue
        signal.signal(sig, _make_handler(writer, sig, previous, mine))


def _describe(exc: BaseException) -> str:
    """'RuntimeError: boom at train.py:41' (where it was raised)."""
    tb = exc.__traceback__
    last = traceback.extract_tb(tb)[-1:] if tb is not None else []
    where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _record_code(writer, code) -> None:
    if code is None:
        writer.record_exit("exit", 0, None, "sys.exit()")
    elif isinstance(code, int):
        writer.record_exit("exit", code, None, f"sys.exit({code})")
    else:
        writer.record_exit("exit", 1, None, f"sys.exit({code!r})")


def _make_handler(writer, sig, previous, mine):
    def handler(signum, frame):
        if mine():
            writer.record_exit("signal", None, signum, f"received {signal.Signals(signum).name}")
        if callable(previous):
            return previous(signum, frame)
        # default action: restore it and deliver the signal again, so the exit status stays honest
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler
