"""A DDP job with one rank slowed, as an independent tool or the script itself would do it:

- "eval": rank 0 evaluates and logs between steps every 10 steps (the script's choice, not a fault);
- "forward": rank 0 is held up as long, as often, inside its training forward;
- "optimizer": rank 2's optimizer step is wrapped, and the wrapper sleeps 30 ms before the real step, from
  step 30 on;
- "long-save": at step 20 rank 0 alone saves a checkpoint to slow storage (writes taking LONG_S in all) while
  the others wait in a barrier (a script's choice, not a hang);
- "long-eval": at step 20 rank 0 alone evaluates for LONG_S while the others wait in a barrier (likewise);
- "long-compile": at step 20 rank 0 alone compiles a new graph (torch.compile, a backend taking LONG_S) while the
  others wait in a barrier (a rank meeting a new shape first);
- "long-prep": at step 20 rank 0 alone tokenizes text in plain Python for LONG_S while the others wait in a
  barrier (Hugging Face's `main_process_first`: no forward, save or compilation; likewise not a hang);
- "stuck-save": rank 0's save at step 20 never ends (storage gone): a hang, once it outlasts the stall timeout;
- "buffer-hang": the model holds a BatchNorm (DDP broadcasts its buffers from rank 0 before every forward) and
  rank 2 sleeps for good after its step 20: rank 0 waits in that broadcast, ranks 1 and 3 got their copy and
  wait in the gradient all-reduce, rank 2 entered neither;
- "skip-step": rank 2 skips its optimizer step at step 30 (the job's own bug): its replica's state differs from
  then on, and its optimizer steps are one behind its peers';
- "repeat-step": rank 1 steps its optimizer twice at step 30: the same, one ahead;
- "round-robin": from step 30 each rank in turn is held up 30 ms inside its training forward (rank r at the steps
  where step % world == r: work the script hands round, no rank's fault);
- "gpu-hang": after its step 20 rank 2 queues a kernel that never ends on its stream (CUDA only), then goes on:
  it blocks on its GPU inside the next gradient all-reduce, which its peers entered too;
- "tail-hang": rank 2 sleeps for good after its last step, while the others end cleanly (a thread it joins, a
  lock, a teardown that never returns): the job never ends;
- "tail-work": rank 0 writes its final artefacts for TAIL_S after its last step while the others end (a script's
  choice, not a hang);
- "none": nothing.
Used by tests/integration/test_main_rank_side_work.py, test_slow_optimizer_step.py,
test_uneven_optimizer_steps.py and
tests/gpu/job_runs.py (test_side_work_cuda.py, test_uneven_steps_cuda.py, test_hang_vote_cuda.py: ranks sharing one GPU,
over gloo).

    torchrun --nproc-per-node 4 slow_rank_job.py MODE STEPS LOG_PREFIX [cpu|cuda]
"""

import io
import json
import sys
import time

import torch
import torch.distributed as dist

mode, steps, log_prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3]
device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
if mode == "buffer-hang":
    net.append(torch.nn.BatchNorm1d(8))
net = net.to(device)
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
held = {"step": 0}


def held_up(module, args):  # "forward" mode: rank 0 slowed inside its training forward
    if module.training and held["step"] % 10 == 0 and held["step"] > 0:
        time.sleep(0.3)


def in_turn(module, args):  # "round-robin" mode: every rank in turn
    if module.training and held["step"] >= 30 and held["step"] % dist.get_world_size() == rank:
        time.sleep(0.03)


if mode == "forward" and rank == 0:
    net[2].register_forward_pre_hook(held_up)
if mode == "round-robin":
    net[2].register_forward_pre_hook(in_turn)
if mode == "optimizer" and rank == 2:
    real_step = opt.step

    def slow_step(*args, **kwargs):
        if held["step"] >= 30:
            time.sleep(0.03)
        return real_step(*args, **kwargs)

    opt.step = slow_step
LONG_S = 6.0
TAIL_S = 14.0  # past the stall timeout of the test that runs it


class SlowStorage(io.RawIOBase):
    """A file whose first write takes `seconds` (a slow or stuck network filesystem)."""

    def __init__(self, path, seconds):
        self.fh, self.seconds = open(path, "wb"), seconds

    def writable(self):
        return True

    def write(self, b):
        time.sleep(self.seconds)
        self.seconds = 0.0
        return self.fh.write(b)


def rank_0_alone(log):
    """long-save / long-eval / long-compile / long-prep / stuck-save: rank 0 works alone, its peers wait in a
    barrier."""
    if rank == 0 and mode in ("long-save", "stuck-save"):
        seconds = LONG_S if mode == "long-save" else 3600.0
        torch.save(model.module.state_dict(), SlowStorage(f"{log_prefix}.ckpt", seconds))
    if rank == 0 and mode == "long-compile":

        def slow_backend(graph, example_inputs):
            time.sleep(LONG_S)
            return graph.forward

        torch.compile(model.module, backend=slow_backend)(torch.randn(4, 64, device=device))
    if rank == 0 and mode == "long-prep":
        words, vocab, t0 = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"] * 20, {}, time.perf_counter()
        while time.perf_counter() - t0 < LONG_S:
            texts = [" ".join(words[(i * 7 + k) % len(words)] for k in range(50)) for i in range(100)]
            json.dumps([[vocab.setdefault(w, len(vocab)) for w in t.upper().split()] for t in texts])
    if rank == 0 and mode == "long-eval":
        model.eval()
        with torch.no_grad():
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < LONG_S:
                for (x,) in evaluation:
                    model(x.to(device))
        model.train()
    dist.barrier()


evaluation = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 64)), batch_size=8)


def evaluate(log):
    model.eval()
    with torch.no_grad():
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        while time.perf_counter() - t0 < 0.15:
            for (x,) in evaluation:
                total += model(x.to(device)).sum()
        score = float(total)  # an evaluation reads its result back
    model.train()
    time.sleep(0.15)  # the log write
    log.write(f"evaluated {score:.3f}\n")
    log.flush()


torch.manual_seed(100 + rank)
with open(f"{log_prefix}.{rank}", "w") as log:
    for step in range(1, steps + 1):
        held["step"] = step
        x, y = torch.randn(32, 64, device=device), torch.randint(0, 8, (32,), device=device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if not (mode == "skip-step" and rank == 2 and step == 30):
            opt.step()
        if mode == "repeat-step" and rank == 1 and step == 30:
            opt.step()
        opt.zero_grad()
        if mode == "eval" and rank == 0 and step % 10 == 0:
            evaluate(log)
        if mode in ("long-save", "long-eval", "long-compile", "long-prep", "stuck-save") and step == 20:
            rank_0_alone(log)
        if mode == "gpu-hang" and rank == 2 and step == 20:
            torch.cuda._sleep(int(120e9))  # about a minute: a test that misses it fails instead of hanging
        if mode == "buffer-hang" and rank == 2 and step == 20:
            while True:
                time.sleep(3600)
        time.sleep(0.01)
if mode == "tail-hang" and rank == 2:
    while True:
        time.sleep(3600)
if mode == "tail-work" and rank == 0:
    with open(f"{log_prefix}.final", "wb") as out:
        end = time.time() + TAIL_S
        while time.time() < end:
            out.write(bytes(1 << 20))
            out.flush()
            time.sleep(0.05)
dist.destroy_process_group()
