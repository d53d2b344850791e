"""trainscout bootstrap: put on PYTHONPATH by `trainscout run`, so it runs at start-up of every rank.

It first runs the sitecustomize this one shadows (distributions ship their own), then starts the probe
when the process is a training rank of a trainscout run. It never raises: a broken probe must not stop
training.
"""

import os
import sys


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.machinery
    import importlib.util

    paths = [p for p in sys.path if p and os.path.abspath(p) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None or not spec.origin:
        return
    if os.path.dirname(os.path.abspath(spec.origin)) == here:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    _run_shadowed_sitecustomize()
except Exception as exc:  # the user's own sitecustomize failing is theirs to see, not ours to hide
    print(f"trainscout: the original sitecustomize failed: {exc!r}", file=sys.stderr)


def _package_on_path() -> None:
    """trainscout importable where the rank's own environment lacks it (TRAINSCOUT_PKG_PATH: where run found it)."""
    pkg = os.environ.get("TRAINSCOUT_PKG_PATH")
    if pkg and pkg not in sys.path:
        sys.path.append(pkg)


def _ranks_from_scheduler() -> None:
    """srun tasks that are the ranks themselves: RANK, WORLD_SIZE, ... from SLURM's variables where absent,
    so that torch's env:// rendezvous and the probe need no change to the script."""
    if os.environ.get("TRAINSCOUT_RANKS_FROM") != "slurm" or os.environ.get("RANK") is not None:
        return
    _package_on_path()
    from trainscout.runner.launchers import slurm_rank_environment

    os.environ.update(slurm_rank_environment(os.environ))


if os.environ.get("TRAINSCOUT_RUN_ID"):
    try:
        _ranks_from_scheduler()
    except Exception as exc:
        print(f"trainscout: cannot read this task's rank from SLURM's variables: {exc!r}", file=sys.stderr)
    # the Flight Recorder sees every collective (C++ ones too); it must be on before torch loads
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "256")


def _integrate(probe) -> None:
    try:  # framework integrations: what each process group is for (topology)
        from trainscout.integrations import install_in_probe

        install_in_probe(probe)
    except Exception as exc:
        print(f"trainscout: framework integrations disabled in this rank: {exc!r}", file=sys.stderr)


if os.environ.get("TRAINSCOUT_RUN_ID") and os.environ.get("RANK") is not None:
    try:
        _package_on_path()
        from trainscout.probe.probe import start

        _probe = start()
    except Exception as exc:
        _probe = None
        print(f"trainscout: probe disabled in this rank: {exc!r}", file=sys.stderr)
    if _probe is not None:
        _integrate(_probe)
elif os.environ.get("TRAINSCOUT_RUN_ID") and not os.environ.get("TRAINSCOUT_PROBE_PID"):
    # no RANK: a process that may join the job in its own init_process_group call (torch.multiprocessing.spawn)
    try:
        _package_on_path()
        from trainscout.probe.late_attach import attach_at_init

        def _start_late(rank, world_size):
            from trainscout.probe.probe import start

            probe = start(rank=rank, world_size=world_size)
            if probe is not None:
                _integrate(probe)

        attach_at_init(_start_late)
    except Exception as exc:
        print(f"trainscout: probe disabled in this process: {exc!r}", file=sys.stderr)
