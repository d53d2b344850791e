"""Host time of each piece of the probe's per-step CUDA work, on a real training step (one GPU, 1-rank DDP).

On a small model the training thread, not the GPU, sets the step time, so every microsecond the probe spends
there is a microsecond of step time. This times, in one process: the whole non-finite check per step (arming
at backward, the end-of-backward launch, judging), and each of its parts by wrapping them (the gradient walk
+ launch `_submit_counts`, the raw kernel launch `enqueue`, the result copy and event `DeviceResults.submit`);
then the bare CUDA calls they are made of, in a loop (an event record, a query, a small device-to-pinned
copy, `current_stream`), and the same step with the check off and on (interleaved blocks; medians).

    python3 -m benchmarks gpu host-costs --workload a --steps 300
"""

from __future__ import annotations

import argparse
import statistics
import time
import types


def _timed(owner, name: str, acc: dict) -> None:
    """Replace owner.name with a wrapper that adds its wall time to acc[name]."""
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, name, wrapper)


def _loop_us(fn, n: int = 2000) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="a")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=6)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from benchmarks.gpu import overhead as go
    from benchmarks.gpu import workload as gw
    from trainscout.probe import device_results, nonfinite_cuda
    from trainscout.probe.nonfinite import NonFiniteCheck

    model, ddp, opt, wargs = go.one_rank_ddp(args.workload)
    seq, batch = wargs.seq, wargs.batch
    device = torch.device("cuda", 0)
    step_no = {"n": 0}
    nf = NonFiniteCheck(lambda *r: None, lambda: step_no["n"])
    autograd = types.SimpleNamespace(backward=torch.autograd.backward)
    nf.patch_autograd(autograd)
    nf.hook_params(model.parameters(), {id(p): n for n, p in model.named_parameters()})
    gen = torch.Generator(device=device).manual_seed(0)
    acc: dict[str, float] = {}

    def step(checked: bool) -> None:
        data = torch.randint(0, gw.VOCAB, (batch, seq + 1), device=device, generator=gen)
        go.checked_step(gw.loss_of(ddp, data), opt, nf, autograd, step_no, checked)

    for _ in range(30):  # warm-up, the kernel compiled
        step(True)
    torch.cuda.synchronize()
    _timed(nf, "_submit_counts", acc)
    _timed(nf, "_grad_ptrs", acc)
    _timed(nonfinite_cuda, "enqueue", acc)
    _timed(nf._results, "submit", acc)
    _timed(nf._results, "take", acc)
    _timed(nf, "check_step", acc)
    spent0, n0 = nf.spent_s, nf.device_checks
    for _ in range(args.steps):
        step(True)
    torch.cuda.synchronize()
    n = nf.device_checks - n0
    lines = [
        f"### Host time of the non-finite check per step, workload {args.workload}, 1-rank DDP, {n} checks",
        "",
        "| part | us per step |",
        "| --- | --- |",
        f"| whole check (`spent_s`: arm + end-of-backward + judging) | {(nf.spent_s - spent0) / n * 1e6:.1f} |",
    ]
    for name in ("_submit_counts", "_grad_ptrs", "enqueue", "take", "submit", "check_step"):
        lines.append(f"| {name} | {acc.get(name, 0.0) / n * 1e6:.1f} |")

    slot = device_results._Slot(device, 64, torch.float32)
    ev = torch.cuda.Event()
    tev = torch.cuda.Event(enable_timing=True)
    host, dev = slot.host[:55], slot.device[:55]
    params = nf._device_params
    layout = nf._layout

    def walk():  # the loop the map()s replaced
        ptrs = [1]
        for p, nbytes in zip(params, layout.nbytes[1:]):
            g = p.grad
            if g is None or not g.is_contiguous() or g.nbytes != nbytes:
                raise AssertionError("a gradient is missing")
            ptrs.append(g.data_ptr())

    data = torch.randint(0, gw.VOCAB, (batch, seq + 1), device=device, generator=gen)
    gw.loss_of(ddp, data).backward()
    real_walk = nf._grad_ptrs  # the timed wrapper: unwrap for the bare loop
    assert real_walk(layout) is not None
    lines += ["", "| bare call | us per call |", "| --- | --- |"]
    for label, fn in (
        ("event.record()", ev.record),
        ("timing event.record()", tev.record),
        ("event.query()", ev.query),
        ("copy_ 55 floats device->pinned, non_blocking", lambda: host.copy_(dev, non_blocking=True)),
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        (f"gradient walk, Python loop ({len(params)} parameters)", walk),
        ("gradient walk, map()s (_grad_ptrs)", lambda: real_walk(layout)),
    ):
        lines.append(f"| {label} | {_loop_us(fn):.2f} |")
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    times: dict[bool, list[float]] = {False: [], True: []}
    for b in range(args.blocks):
        for checked in (False, True) if b % 2 == 0 else (True, False):
            for _ in range(5):
                step(checked)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(40):
                step(checked)
            torch.cuda.synchronize()
            times[checked].append((time.perf_counter() - t0) / 40 * 1e3)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    lines += [
        "",
        f"step ms, check off / on, median of {args.blocks} blocks of 40 steps: {off:.3f} / {on:.3f} "
        f"({on / off - 1:+.2%}); blocks off {[round(t, 3) for t in times[False]]}, on {[round(t, 3) for t in times[True]]}",
    ]
    print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
