"""The in-rank probe: started by the bootstrap, it wires the channel, hooks and publisher thread.

It never raises into training code and never blocks it: the training thread only sets two header
fields per optimizer step; everything else happens on the publisher thread. It adds no collective.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import os
import signal
import sys
import time

from trainscout import config, log
from trainscout.channel.layout import (
    DESC_BYTES,
    ERROR_PG_INDEX,
    link_probe_request_path,
    replay_request_path,
    stack_path,
)
from trainscout.channel.writer import ChannelWriter
from trainscout.probe import compiled, exits
from trainscout.probe.activity import Activity
from trainscout.probe.checkpoints import CheckpointHooks
from trainscout.probe.collectives import CollectiveTap
from trainscout.probe.compiled import eager_hook
from trainscout.probe.gather_check import GatherCheck
from trainscout.probe.gpu_queue import GpuQueue
from trainscout.probe import hpz_fix
from trainscout.probe.hpz_check import HpzCheck
from trainscout.probe.import_hooks import hooks
from trainscout.probe.link_probe import LinkProbe
from trainscout.probe.parts import Flushes, Part
from trainscout.probe.grad_sync import GradSyncNorms
from trainscout.probe.local_evidence import LocalEvidence
from trainscout.probe.nonfinite import NonFiniteCheck
from trainscout.probe.publisher import Publisher
from trainscout.probe.replay import Replay
from trainscout.probe.requests import RequestFile
from trainscout.probe.state_check import StateCheck
from trainscout.probe.step_timing import StepTiming

_log = log.get("probe")
STACK_SIGNAL = signal.SIGRTMIN + 5  # the agent sends it to get a faulthandler stack dump

_probe = None


class Probe:
    def __init__(
        self,
        run_id: str,
        rank: int,
        local_rank: int,
        world_size: int,
        settings: config.Config | None = None,
        run_dir: str | None = None,
        inject: str = "",
        attempt: int = 0,
    ) -> None:
        cfg = settings or config.Config()
        self.attempt = attempt  # the launcher's restart attempt (torchrun --max-restarts)
        checks = cfg.checks
        self._log_level = cfg.run.log_level
        self.run_dir = run_dir
        self._inject = inject
        self.run_id = run_id
        self.rank = rank
        self.pid = os.getpid()
        self.step = 0
        self.errors = 0  # internal errors so far (each sent to the agent in order)
        self._primary_optimizer: int | None = None  # id() of the optimizer whose steps count
        self._open_optimizer_steps: list[int] = []  # until it is chosen: ids of optimizers inside their step
        self.writer = ChannelWriter(run_id, rank, local_rank, world_size, attempt)
        self.activity = Activity(self.writer.set)
        self.gpu_queue = GpuQueue(self.writer.set, lambda: self.timing.training_stream)
        self.injector = self._load_injector()
        self.tap = CollectiveTap(lambda: self.step, self.injector, self.report_error)
        self.publisher: Publisher | None = Publisher(  # None in a forked child
            self.writer,
            run_id,
            rank,
            self.tap,
            lambda: self.step,
            tick_s=cfg.probe.tick_s,
            buffer_entries=_env_number("TORCH_FR_BUFFER_SIZE", 256),
            on_tick=self._on_tick,  # the publisher thread starts in start(), once every part exists
        )
        # the one late binding: the tap and the publisher need each other (records of synchronous collectives)
        self.tap.record_sync = self.publisher.record_sync
        self.state_check = None
        if checks.state.enabled:
            self.state_check = StateCheck(
                run_id, rank, self.publisher.append_locked, budget=checks.state.budget, period=checks.state.period
            )
        self.timing = StepTiming(
            self.publisher.append_locked,
            on_device=self.publisher.set_device,
            other_thread_s=lambda: self.publisher.busy_now() if self.publisher is not None else 0.0,
        )
        self.publisher.on_late = self.timing.note_frozen  # a stopped process: its steps say for how long
        # the tap reports to the step's timing (collective time is waiting, not compute)
        self.tap.on_wait = self.timing.add_wait
        self.tap.on_begin, self.tap.on_end = self.timing.collective_begin, self.timing.collective_end
        self.tap.on_async_begin, self.tap.on_async_end = self.timing.async_wait_begin, self.timing.async_wait_end
        self.nonfinite = None
        self.evidence = None  # per-step loss and layer gradient norms, measured in the non-finite check's pass
        if checks.nonfinite.enabled:
            if cfg.probe.evidence:
                self.evidence = LocalEvidence(self.publisher.append_locked, run_id, rank)
                grad_sync = GradSyncNorms(self.publisher.role_of, self.report_error)
                self.evidence.grad_sync, self.tap.on_issue = grad_sync, grad_sync.observe
            self.nonfinite = NonFiniteCheck(
                self.publisher.append_locked,
                lambda: self.step,
                on_error=self.report_error,
                on_cpu=self.timing.exclude_cpu,
                budget=checks.nonfinite.budget,
                evidence=self.evidence,
            )
        self.gather_check = None
        if self.state_check is not None:
            self.gather_check = GatherCheck(
                self.publisher.append_locked,
                lambda: self.step,
                lambda name, group: self.state_check.register(name, group),
                period=checks.gather.period,
                before_check=self.injector.on_gathered if self.injector is not None else None,
            )
        self.hpz_fix: hpz_fix.HpzFix | None = None  # ZeRO++ hpZ: event-ordered secondary partition (probe/hpz_fix.py)
        self._hpz_fix_mode = checks.hpz.fix
        self.hpz_check = None
        if self.state_check is not None and checks.hpz.check:
            self.hpz_check = HpzCheck(
                self.publisher.append_locked,
                lambda: self.step,
                lambda name: self.state_check.register(name, None),
                period=checks.hpz.period,
                mode_of=self._hpz_mode,
                on_error=self.report_error,
            )
        self.param_names: dict[int, str] = {}
        self.model = None
        self.checkpoints = CheckpointHooks(
            run_id, rank, lambda: self.step, self.report_error, self.timing.add_checkpoint, self.activity
        )
        # At least 200 steps apart, and further when a replay costs more than 0.1 % of the steps between
        # (a replay synchronises with the GPU: ~14 ms on a 10 ms host-bound CUDA step). A replay budget of 0
        # means exactly every `every` steps (tests, short jobs).
        every, budget = checks.replay.every, checks.replay.budget
        self.replay = (
            Replay(self.publisher.append_locked, every, rank, budget, report=self.report_error) if every > 0 else None
        )
        self._side_group = None  # gloo group over the world with a bounded timeout: replay, link probes
        self._replica_groups: dict[tuple[int, ...], object] = {}  # replay's side groups over part of the job
        # Join contexts entered (uneven inputs): a rank out of data stops stepping and shadows its peers'
        # collectives, so work that every rank must do at the same step (replay, link probes) would wait for it
        self.joins = 0
        self._join_notice = None  # (work, group size) of the last "not joined yet" all-reduce in a Join context
        self._uneven = False  # a rank in this Join context has run out of data
        self.link_probe = None
        if checks.link_probe:
            self.link_probe = LinkProbe(self.publisher.append_locked, rank, self.report_error)
        # from `trainscout replay` or a confirmation the coordinator asked for: {"id", "step", "layers", "state"}
        self._replay_request: dict | None = None
        self._replay_requests = RequestFile(replay_request_path(run_id))
        self._link_requests = RequestFile(link_probe_request_path(run_id))

    def _load_injector(self):
        if not self._inject:
            return None
        from trainscout.faults.inject import FaultInjector

        return FaultInjector.from_env(self.rank, {"TRAINSCOUT_INJECT": self._inject}, attempt=self.attempt)

    def report_error(self, text: str) -> None:
        """An internal error (the check it came from is then off): each one goes to the agent as a ring record,
        in order, so that none overwrites another; the header keeps the last one for a reader of the header."""
        try:
            _log.warning("%s", text)
            self.errors += 1
            self.writer.set("error_text", text.encode(errors="replace")[:480])
            publisher = getattr(self, "publisher", None)  # errors can come while the parts are being made
            if publisher is not None:
                publisher.append_locked(
                    ERROR_PG_INDEX, self.errors, 0, 0, time.time_ns(), self.step, "error", text[:DESC_BYTES]
                )
        except Exception:
            pass

    def start(self) -> None:
        log.setup("probe", self.run_dir, rank=self.rank, step=lambda: self.step, level=self._log_level)
        exits.install(self.writer, self.pid)
        self._stack_file = open(stack_path(self.run_id, self.rank), "w")
        faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        h = hooks()
        h.on_import("torch.distributed.distributed_c10d", self._patch_c10d)
        h.on_import("torch.optim.optimizer", self._hook_optimizer)
        h.on_import(
            "torch.distributed._functional_collectives",
            self._guarded(self.tap.patch_functional, "functional collective tap"),
        )
        h.on_import("torch.nn.parallel.distributed", self._guarded(self._hook_ddp, "DDP hook"))
        # DDP's buffer broadcast (torch.distributed is whole by the time DDP's module is imported)
        h.on_import(
            "torch.nn.parallel.distributed",
            self._guarded(lambda _: self.tap.patch_coalesced(sys.modules["torch.distributed"]), "buffer-sync timing"),
        )
        h.on_import(
            "torch.distributed.fsdp._fully_shard._fully_shard",
            self._guarded(self._hook_fully_shard, "step timing (FSDP forward)"),
        )
        if self.gather_check is not None:
            h.on_import(
                "torch.distributed.fsdp._fully_shard._fully_shard",
                self._guarded(self.gather_check.wrap, "all-gather check"),
            )
        h.on_import("torch.autograd", self._guarded(self._patch_backward, "step timing and loss check"))
        h.on_import(
            "torch.distributed.algorithms.join",
            self._guarded(functools.partial(_watch_joins_of, self), "uneven-input watch"),
        )
        h.on_import("torch._dynamo", self._guarded(self.activity.watch_compiles, "compile marks"))
        h.on_import("torch._dynamo", self._guarded(compiled.on_dynamo_import, "hooks kept out of compiled code"))
        if self.nonfinite is not None:
            for module in (
                "torch.amp.grad_scaler",
                "torch.distributed.fsdp.sharded_grad_scaler",
                "deepspeed.runtime.fp16.loss_scaler",
            ):
                h.on_import(module, self._guarded(self.nonfinite.watch_loss_scaler, "loss-scaler hook"))
        h.on_import("torch.utils.data.dataloader", self._guarded(self.timing.wrap_dataloader, "data-loader timing"))
        h.on_import("torch.serialization", self._guarded(self.checkpoints.wrap_torch_save, "checkpoint hook"))
        h.on_import("torch.serialization", self._guarded(self.checkpoints.wrap_renames, "checkpoint hook"))
        h.on_import(
            "torch.distributed.checkpoint.state_dict_saver",
            self._guarded(self.checkpoints.wrap_dcp_save, "checkpoint hook"),
        )
        h.on_import("deepspeed.runtime.engine", self._guarded(self.checkpoints.wrap_deepspeed, "checkpoint hook"))
        try:
            self.hpz_fix = hpz_fix.install(h, self._hpz_fix_mode, on_message=self.report_error)
        except Exception as exc:
            self.report_error(f"hpZ fix not applied: {exc!r}")
        if self.hpz_check is not None:
            h.on_import("deepspeed.runtime.zero.parameter_offload", self._guarded(self.hpz_check.wrap, "hpZ check"))
        os.register_at_fork(after_in_child=self._forked_child)
        assert self.publisher is not None  # unset only in a forked child (above), which never starts
        self.publisher.start()
        atexit.register(self._write_costs)
        atexit.register(self._final_flush)

    def _final_flush(self) -> None:
        # Runs before the exit record (atexit is LIFO): publish the last collectives first.
        if self.publisher is None or os.getpid() != self.pid:
            return
        for part in self.parts():  # CUDA results still in flight
            if isinstance(part, Flushes) and part is not self.publisher:
                try:
                    part.flush()
                except Exception:
                    pass
        if self.evidence is not None:
            try:
                self.evidence.flush()  # after the non-finite check's: its last records may wait on reductions
            except Exception:
                pass
        try:
            self.publisher.poll_collectives(force=True)
        except Exception:
            pass

    def parts(self) -> list:
        """The checks and recorders this probe composed (those switched on)."""
        candidates = (
            self.state_check,
            self.nonfinite,
            self.timing,
            self.hpz_check,
            self.gather_check,
            self.replay,
            self.link_probe,
            self.publisher,
        )
        return [p for p in candidates if p is not None]

    def _on_tick(self) -> None:
        progress_ns = int(self.writer.header["progress_ns"])
        self.activity.look(progress_ns)
        self.gpu_queue.look(progress_ns, self.activity.blocked)
        self._read_requests()

    def _read_requests(self) -> None:
        if self.link_probe is not None and self._side_group is not None:
            try:
                self.link_probe.read_request(self._link_requests, self.step)
            except Exception as exc:
                self.report_error(f"link probe request unreadable: {exc!r}")
        if self.replay is not None:
            self._read_replay_request()

    def _read_replay_request(self) -> None:
        """Publisher thread: pick up a replay request the agent wrote (see coordinator `_replay_on_command`)."""
        doc = self._replay_requests.take(self.step, lambda text: self.report_error(f"on-command replay {text}"))
        if doc is not None:
            layers = [str(x) for x in doc.get("layers") or []] or [str(doc.get("layer") or "")]
            self._replay_request = {
                "id": int(doc["id"]),
                "step": int(doc["step"]),
                "layers": layers,
                "state": bool(doc.get("state")),
            }

    def costs(self) -> dict:
        """What the probe's own checks cost this rank (seconds on the training thread), for the run's summary."""
        out: dict = {"rank": self.rank, "steps": self.step, "step_wall_s": self.timing.total_wall_s}
        if self.tap.functional_recorded:
            out["functional_collectives_recorded"] = self.tap.functional_recorded
        for part in self.parts():
            figures = part.costs() if isinstance(part, Part) else None
            if figures:
                out[part.name] = figures
        return out

    def _write_costs(self) -> None:
        run_dir = self.run_dir
        if not run_dir or os.getpid() != self.pid:
            return
        try:
            import json

            from trainscout.sinks.probe_costs import report_path

            with open(report_path(run_dir, self.rank), "w") as fh:
                json.dump(self.costs(), fh)
        except Exception:
            pass  # a report, never a reason to fail at exit

    def _forked_child(self) -> None:
        # A forked child (DataLoader worker) shares the channel mapping but is not the rank.
        self.publisher = None
        try:
            faulthandler.unregister(STACK_SIGNAL)
        except Exception:
            pass

    def _patch_c10d(self, module) -> None:
        try:
            self.tap.patch(module)
            real_init = module.init_process_group
            probe = self

            def init_process_group(*args, **kwargs):
                result = real_init(*args, **kwargs)
                if probe.replay is not None or probe.link_probe is not None:
                    try:  # every rank creates it now, in the same order: group creation is collective
                        import datetime

                        # a bounded timeout: if replay or a link probe fails on one rank, the others'
                        # side-group calls error out (and disable it) instead of hanging training
                        probe._side_group = module.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
                    except Exception as exc:
                        probe.replay = probe.link_probe = None
                        probe.report_error(f"replay and link probes disabled (no side group): {exc!r}")
                if probe.injector is not None:
                    probe.injector.on_init_process_group()
                return result

            init_process_group.__wrapped__ = real_init  # type: ignore[attr-defined]
            init_process_group.__doc__ = real_init.__doc__
            module.init_process_group = init_process_group

            real_destroy = module.destroy_process_group

            def destroy_process_group(*args, **kwargs):
                probe._final_flush()  # after this the recorder of these groups is gone
                return real_destroy(*args, **kwargs)

            destroy_process_group.__wrapped__ = real_destroy  # type: ignore[attr-defined]
            destroy_process_group.__doc__ = real_destroy.__doc__
            module.destroy_process_group = destroy_process_group
        except Exception as exc:
            self.report_error(f"torch.distributed patching failed: {exc!r}")

    def _patch_backward(self, autograd_module) -> None:
        """One wrapper around backward for everything the probe does per backward pass: step timing (the end
        of backward) and the non-finite check (the loss; the local gradients at the end of the pass). One
        grad_fn pre-hook queues one engine callback that runs both, in that order: the callback runs before
        DDP's finalisation, which waits for the gradient all-reduce."""
        real_backward = autograd_module.backward
        timing, nonfinite = self.timing, self.nonfinite
        engine = autograd_module.Variable._execution_engine

        def ended() -> None:
            timing.backward_ended()
            if nonfinite is not None:
                nonfinite.cpu_backward_done()

        def started(grad_outputs):
            try:
                engine.queue_callback(ended)
            except Exception:
                pass
            return None

        def backward(tensors, *args, **kwargs):
            try:
                t = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
                fn = t.grad_fn
                if fn is not None and t.numel() == 1:
                    timing.backward_started()
                    timing.on_loss(t)
                    fn.register_prehook(started)  # before the CUDA check's own: timing's end event comes first
                    if nonfinite is not None:
                        nonfinite.on_loss(t)
            except Exception:
                pass  # fail open: timing and checks must never break backward
            result = real_backward(tensors, *args, **kwargs)
            try:
                timing.backward_returned()  # the gradient reduction's wait ends here (step timing)
            except Exception:
                pass
            return result

        backward.__wrapped__ = real_backward  # type: ignore[attr-defined]
        backward.__doc__ = real_backward.__doc__
        autograd_module.backward = backward

    def _hpz_mode(self) -> str:
        fix = self.hpz_fix
        if fix is None or fix.state != "installed" or fix.mode == "off":
            return "stall"  # DeepSpeed as shipped
        return fix.mode

    def _guarded(self, fn, what: str):
        def run(module) -> None:
            try:
                fn(module)
            except Exception as exc:
                self.report_error(f"{what} disabled: {exc!r}")

        return run

    def _uneven_now(self) -> bool:
        """Whether some rank of the Join context has run out of data, as this step's "not joined yet" all-reduce
        counted (the same count on every rank, so every rank decides alike). Unknown counts as yes: a CUDA count
        (read only by synchronising), or no such all-reduce this step."""
        if self._uneven:
            return True
        notice, self._join_notice = self._join_notice, None
        if notice is None:
            self._uneven = True
            return True
        work, size = notice
        work.wait()  # done already: DDP's reducer waits for it before backward ends
        count = work.result()[0]
        self._uneven = count.is_cuda or int(count.item()) < size
        return self._uneven

    def _hook_ddp(self, module) -> None:
        """Learn parameter names and the data-parallel group (replicas) from DDP's constructor."""
        cls = module.DistributedDataParallel
        real_init = cls.__init__
        probe = self

        def __init__(ddp, *args, **kwargs):
            real_init(ddp, *args, **kwargs)
            try:
                names = {id(p): n for n, p in ddp.module.named_parameters()}
                probe.param_names.update(names)
                pg_name = getattr(ddp.process_group, "group_name", None)
                if probe.state_check is not None:
                    probe.state_check.learn_model(ddp.module, pg_name)
                if probe.nonfinite is not None:
                    probe.nonfinite.hook_params(
                        ddp.module.parameters(),
                        names,
                        bucket_views=bool(getattr(ddp, "gradient_as_bucket_view", False)),
                    )
                probe.model = ddp.module
                probe._mark_training_forward(ddp)
                probe._attach_replay(ddp)
            except Exception as exc:
                probe.report_error(f"DDP introspection failed: {exc!r}")

        __init__.__wrapped__ = real_init  # type: ignore[attr-defined]
        cls.__init__ = __init__

    def _hook_fully_shard(self, module) -> None:
        """FSDP2: each unit `fully_shard` makes marks the step's first training forward (the root's comes first)."""
        real = module.fully_shard
        probe = self

        def fully_shard(mod, *args, **kwargs):
            result = real(mod, *args, **kwargs)
            try:
                probe._mark_training_forward(result if result is not None else mod)
            except Exception:
                pass  # fail open: sharding itself must not be affected
            return result

        # fully_shard carries attributes its own code uses (fully_shard.state(module)): keep them all
        module.fully_shard = functools.wraps(real)(fully_shard)

    def _mark_training_forward(self, model) -> None:
        """A forward pre-hook on the trained model: its first forward of a step in training mode with autograd
        on ends the time between steps (step_timing). Evaluation (autograd off or eval mode) does not."""
        import torch

        timing, pid, grad_enabled = self.timing, self.pid, torch.is_grad_enabled

        def training_forward(module, args) -> None:
            if module.training and grad_enabled() and os.getpid() == pid:
                timing.training_forward()

        model.register_forward_pre_hook(eager_hook(training_forward))
        # any forward of the model, evaluation included (often of DDP's inner module, bypassing the wrapper)
        getattr(model, "module", model).register_forward_pre_hook(eager_hook(self.activity.forward))

    def _attach_replay(self, ddp) -> None:
        if self.replay is None or self._side_group is None:
            return
        import torch.distributed as dist

        members = sorted(dist.get_process_group_ranks(ddp.process_group))
        group = self._side_group
        if members != list(range(dist.get_world_size())):
            group = self._replica_side_group(dist, members)
            if group is None:
                self.replay = None
                return
            self.replay.guard = self.tap.refusing
        broadcast = self.tap.originals.get("broadcast", dist.broadcast)  # unwrapped: no fault rewrites it
        self.replay.attach(ddp.module, group, min(members), broadcast)
        self.replay.arm_if_due(self.step + 1)
        if self.state_check is not None:
            self.state_check.replay_layers = [name for name, _ in self.replay.layers]

    def _replica_side_group(self, dist, members: list[int]):
        """A side group over the replicas of a DDP that spans part of the job (each pipeline stage's replicas),
        made by its members alone, or None where replay cannot run there: fewer than 3 replicas (no majority),
        or a tensor-parallel rank, whose layers' forward talks to tensor-parallel peers that replay other
        layers at other steps (and DTensor's collectives are issued where the tap cannot refuse them)."""
        if len(members) < 3 or self.publisher is None or self.publisher.has_role("tensor"):
            return None
        group = self._replica_groups.get(tuple(members))
        if group is None:
            import datetime

            try:
                group = dist.new_group(
                    members,
                    backend="gloo",
                    timeout=datetime.timedelta(seconds=60),
                    use_local_synchronization=True,  # only the members call it: other stages make their own
                )
            except Exception as exc:
                self.report_error(f"replay disabled (no side group over the replicas): {exc!r}")
                return None
            self._replica_groups[tuple(members)] = group
        return group  # marked the probe's own, not the job's (trainscout.integrations._mark_side_groups)

    def _hook_optimizer(self, module) -> None:
        try:
            module.register_optimizer_step_pre_hook(self._before_optimizer_step)
            module.register_optimizer_step_post_hook(self._after_optimizer_step)
        except Exception as exc:
            self.report_error(f"optimizer hook failed: {exc!r}")

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if os.getpid() != self.pid:
            return
        if self._primary_optimizer is None:
            self._close_optimizer_step(id(optimizer))  # still open: its last step raised before its post hook
            self._open_optimizer_steps.append(id(optimizer))
            if len(self._open_optimizer_steps) > 1:
                return  # stepped by another optimizer (a wrapper such as ZeroRedundancyOptimizer)
        if self._primary_optimizer in (None, id(optimizer)):
            self.timing.before_optimizer_step()

    def _close_optimizer_step(self, key: int) -> None:
        """Its step ended: it and any step opened inside it leave the open ones."""
        if key in self._open_optimizer_steps:
            del self._open_optimizer_steps[self._open_optimizer_steps.index(key) :]

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        # Several optimizers may step per iteration; the first one seen to finish a step that no other
        # optimizer's step encloses defines the step boundary. An optimizer stepped inside another's step
        # (ZeroRedundancyOptimizer's local optimizer, which updates only this rank's shard before the wrapper
        # broadcasts every shard) ends its step while the replicas still differ.
        if os.getpid() != self.pid:
            return
        if self._primary_optimizer is None:
            self._close_optimizer_step(id(optimizer))
            if self._open_optimizer_steps:
                return
            self._primary_optimizer = id(optimizer)
        elif id(optimizer) != self._primary_optimizer:
            return
        self.step += 1
        self.writer.set("step", self.step)
        self.writer.set("step_ns", time.monotonic_ns())
        self.timing.after_step(self.step)
        probe_cpu0, probe_wall0 = time.thread_time(), time.perf_counter()
        try:
            with self.tap.untimed():
                self._checks_after_step(optimizer)
        finally:  # the probe's own checks are not the rank's compute (straggler timing)
            self.timing.exclude_cpu(time.thread_time() - probe_cpu0)
            self.timing.exclude_wall(time.perf_counter() - probe_wall0)
        if self.injector is not None:  # injected extra compute is the rank's: counted
            self.injector.on_step_end(self.step, optimizer, self.param_names, self.model)

    def _checks_after_step(self, optimizer) -> None:
        if self.evidence is not None:
            self.evidence.step_ended(self.step)
        if self.nonfinite is not None:
            self.nonfinite.check_step(self.timing.last_wall_s)
        if self.evidence is not None:
            self.evidence.emit(self.step)
        if self.step == 1 and self.nonfinite is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.nonfinite.hook_params(params, self.param_names)
        if self.state_check is not None:
            try:
                self.state_check.after_step(optimizer, self.step, self.timing.last_wall_s)
            except Exception as exc:  # fail open
                self.state_check = None
                self.report_error(f"replicated-state check disabled: {exc!r}")
        request = self._replay_request
        on_command = request is not None and request["step"] == self.step
        command = request if on_command else None  # the request, when it is for this step
        if self.replay is not None:
            self.replay.slack_s = 0.0
        if command is not None and command["state"] and self.state_check is not None:
            t0 = time.perf_counter()
            try:  # a confirmation: the whole replicated state at this step, on every replica
                self.state_check.full_check(self.step)
            except Exception as exc:  # fail open
                self.report_error(f"whole-state check failed: {exc!r}")
            if self.replay is not None:  # a peer as slow again at the same work still meets the replay
                self.replay.slack_s = 2 * (time.perf_counter() - t0)
        layers = command["layers"] if command is not None else []
        several = len(layers) > 1
        if self.joins and self._uneven_now():  # a peer out of data never reaches this step (_watch_joins_of)
            if request is not None and self.step >= request["step"]:
                self._replay_request = None  # skipped by every replica alike, not missed
            return
        if self.replay is not None and (on_command or self.replay.due(self.step)):
            try:
                if several:
                    self.replay.run_layers(self.step, layers)
                else:
                    self.replay.run(self.step, on_command=on_command, step_s=self.timing.last_wall_s)
            except Exception as exc:  # fail open
                self.replay = None
                self.report_error(f"replay disabled: {exc!r}")
        if request is not None:
            if self.step >= request["step"]:
                self._replay_request = None
                if self.step > request["step"]:  # read too late: the other replicas replayed without us
                    self.report_error(
                        f"on-command replay at step {request['step']} missed (request read at step {self.step})"
                    )
            elif self.replay is not None and len(request["layers"]) > 1:
                self.replay.prepare_layers(request["layers"])
            elif self.replay is not None:
                self.replay.prepare(request["layers"][0])
        if self.replay is not None and self._replay_request is None:  # (one on command is armed by prepare)
            self.replay.arm_if_due(self.step + 1)
        if self.link_probe is not None and self.link_probe.due(self.step):
            try:
                self.link_probe.run(self.step, self._side_group)
            except Exception as exc:  # fail open
                self.link_probe = None
                self.report_error(f"link probe disabled: {exc!r}")


def _watch_joins_of(probe: Probe, module) -> None:
    """Count the Join contexts (torch.distributed.algorithms.join) a rank is in. Within one, ranks run out of
    data at different steps: one that has does no more optimizer steps while its peers go on, so a replay or
    link probe at a step number would have its peers wait for it in the side group (60 s, then replay off).
    Every rank enters and leaves the context together, so all skip the same steps."""
    cls = module.Join
    if getattr(cls, "_trainscout_watched", False):
        return
    enter, leave, notify = cls.__enter__, cls.__exit__, cls.notify_join_context

    def __enter__(self):
        probe.joins += 1
        probe._uneven = False
        return enter(self)

    def __exit__(self, *exc):
        try:
            return leave(self, *exc)
        finally:
            probe.joins -= 1

    def notify_join_context(joinable):
        work = notify(joinable)
        if work is not None:  # the first joinable's all-reduce of ones: its sum counts the ranks not yet out
            import torch.distributed as dist

            probe._join_notice = (work, dist.get_world_size(joinable.join_process_group))
        return work

    cls.__enter__, cls.__exit__ = __enter__, __exit__
    cls.notify_join_context = staticmethod(notify_join_context)
    cls._trainscout_watched = True


def _env_number(name: str, default):
    """os.environ[name] as the type of `default` (int or float); the default when unset or malformed."""
    try:
        return type(default)(os.environ.get(name, default))
    except ValueError:
        return default


def start(rank: int | None = None, world_size: int | None = None) -> Probe | None:
    """The rank's probe; rank and world size from the environment (RANK, WORLD_SIZE) unless given (a rank that
    joins the job in its own init_process_group call: probe/late_attach.py)."""
    global _probe
    if _probe is not None:
        return _probe
    if os.environ.get("TRAINSCOUT_PROBE_PID"):
        return None  # a spawned child of a rank (e.g. a DataLoader worker) inherits RANK: not a rank
    run_id = os.environ["TRAINSCOUT_RUN_ID"]
    joined = rank is not None  # in its own init_process_group call: no LOCAL_RANK either
    rank = rank if rank is not None else int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank if joined else 0))  # one node: its global rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    os.environ["TRAINSCOUT_PROBE_PID"] = str(os.getpid())
    settings, problems = config.from_environ()
    _probe = Probe(
        run_id,
        rank,
        local_rank,
        world_size,
        settings,
        run_dir=os.environ.get("TRAINSCOUT_RUN_DIR"),
        inject=os.environ.get("TRAINSCOUT_INJECT", ""),
        attempt=_env_number("TORCHELASTIC_RESTART_COUNT", 0),  # set by torchrun in every worker
    )
    for problem in problems:  # a hand-set value trainscout run did not check: its default serves
        _probe.report_error(problem)
    _probe.start()
    return _probe
