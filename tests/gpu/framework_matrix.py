"""The GPU framework matrix: DDP, FSDP2, DeepSpeed ZeRO-3, Megatron-Core and TorchTitan under `trainscout run`.

Every case launches an unmodified job on 2 GPUs (NCCL) with torchrun, injects a hang into rank 1 at step
10 and records what trainscout said: with two ranks a hang is detected and the lagging rank is listed,
but no strict majority can blame it (`status: inconclusive`). The cases run side by side (each job is
small) and each has its own time limit, so one that fails to install or start costs only itself.
Results go to OUT/matrix.json and OUT/matrix.txt (docs/compatibility.md records them).

    python tests/gpu/framework_matrix.py OUT [case ...]
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EX = REPO / "examples"
HANG_RANK, HANG_STEP, STEPS = 1, 10, 40
CASE_TIMEOUT_S = float(os.environ.get("MATRIX_CASE_TIMEOUT_S", "200"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _titan_assets(root: Path) -> Path:
    """A tiny tokenizer and text set where TorchTitan's debug model looks for them (tests/assets/...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(400)]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(50, 300))) for _ in range(600)]
    tok_dir = root / "tests" / "assets" / "tokenizer"
    data_dir = root / "tests" / "assets" / "c4_test"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", bos, eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    with open(data_dir / "data.json", "w") as fh:
        for t in texts:
            fh.write(json.dumps({"text": t}) + "\n")
    return root


def cases(out: Path) -> dict[str, dict]:
    py = sys.executable
    steps = ("--steps", str(STEPS))
    titan_root = out / "titan"
    return {
        "ddp": {"launch": [str(EX / "ddp_train.py"), *steps]},
        "fsdp2": {"launch": [str(EX / "hsdp_train.py"), "--replicate", "1", *steps]},
        "deepspeed_zero3": {"launch": [str(EX / "deepspeed_train.py"), "--zero-stage", "3", *steps]},
        "megatron_core": {"launch": [str(EX / "megatron_gpt_train.py"), *steps]},
        "torchtitan": {"launch": ["-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel",
                                  "--training.steps", str(STEPS)],
                       "cwd": titan_root, "prepare": lambda: _titan_assets(titan_root)},
        # TorchTitan 0.2.x: job-config CLI, whose defaults are the llama3 debug model on tests/assets
        "torchtitan_0_2": {"launch": ["-m", "torchtitan.train", "--training.steps", str(STEPS)],
                           "cwd": titan_root, "prepare": lambda: _titan_assets(titan_root)},
    } | {"_py": py}


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
        out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:
        out["torch_error"] = repr(exc)
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("deepspeed", "megatron-core", "torchtitan", "datasets", "tokenizers"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def _verdict(findings: list[dict]) -> tuple[bool, str]:
    hangs = [f for f in findings if f["kind"] == "hang"]
    if not hangs:
        return False, "no hang finding"
    f = hangs[0]
    if f.get("status") == "attributed":
        return f["culprit_ranks"] == [HANG_RANK], f"attributed to {f['culprit_ranks']}"
    lagging = f.get("evidence", {}).get("lagging_ranks")
    return lagging == [HANG_RANK], f"detected, inconclusive with 2 ranks; lagging ranks {lagging}"


def main(argv: list[str]) -> int:
    out = Path(argv[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    table = cases(out)
    py = table.pop("_py")
    wanted = argv[1:] or list(table)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    running = {}
    results = {"versions": _versions(), "cases": {}}
    for name in wanted:
        case = table[name]
        try:
            if "prepare" in case:
                case["prepare"]()
        except Exception as exc:
            results["cases"][name] = {"ok": False, "verdict": f"preparing failed: {exc!r}"}
            continue
        log = open(out / f"{name}.log", "w")
        cmd = [py, "-m", "trainscout", "run", "--run-dir", str(out / "runs"), "--run-id", name, "--console",
               "plain", "--abort-on", "hang", "--inject", f"hang:rank={HANG_RANK}:step={HANG_STEP}", "--",
               py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
               *case["launch"]]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(case.get("cwd", REPO)),
                                start_new_session=True)
        running[name] = (proc, log, time.monotonic())
    while running:
        time.sleep(1)
        for name, (proc, log, t0) in list(running.items()):
            timed_out = time.monotonic() - t0 > CASE_TIMEOUT_S
            if proc.poll() is None and not timed_out:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.close()
            del running[name]
            run_dir = out / "runs" / name
            findings = []
            if (run_dir / "findings.jsonl").exists():
                findings = [json.loads(line) for line in (run_dir / "findings.jsonl").read_text().splitlines() if line]
            topo = {}
            if (run_dir / "topology.json").exists():
                topo = json.loads((run_dir / "topology.json").read_text())
            ok, verdict = _verdict(findings)
            text = (out / f"{name}.log").read_text(errors="replace")
            results["cases"][name] = {
                "ok": ok and not timed_out, "verdict": verdict + (" (timed out)" if timed_out else ""),
                "seconds": round(time.monotonic() - t0, 1), "exit_code": proc.returncode,
                "findings": [{k: f.get(k) for k in ("kind", "status", "culprit_ranks", "summary")} for f in findings],
                "topology": topo.get("line", ""), "fault_fired": "trainscout-fault:" in text,
                "tail": text[-2500:],
            }
    (out / "matrix.json").write_text(json.dumps(results, indent=1))
    lines = [json.dumps(results["versions"])]
    for name in wanted:
        r = results["cases"].get(name, {})
        lines.append(f"{name}: {'OK' if r.get('ok') else 'FAILED'}: {r.get('verdict')} "
                     f"({r.get('seconds')} s, exit {r.get('exit_code')}); {r.get('topology', '')}")
    (out / "matrix.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for name in wanted:
        r = results["cases"].get(name, {})
        if not r.get("ok"):
            print(f"--- {name} tail ---\n{r.get('tail', '')[-1500:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
