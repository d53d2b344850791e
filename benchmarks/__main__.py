"""`python -m benchmarks QUESTION [MODE] [OPTIONS]`: one entry point per question, run from the repository root.

`python -m benchmarks` lists the questions, `python -m benchmarks QUESTION --help` its modes (the first is the
default), `python -m benchmarks QUESTION MODE --help` a mode's options. `--quick` (before or among the
options) runs a mode at smoke-test size and leaves RESULTS.md alone.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# question -> mode -> (module, what it measures); the first mode of a question is its default
QUESTIONS: dict[str, dict[str, tuple[str, str]]] = {
    "latency": {
        "unscripted": (
            "benchmarks.latency.unscripted",
            "faults of every class, made in several ways: latency in steps and seconds, false blame",
        ),
        "faults": ("benchmarks.latency.faults", "hang, desync, crash, early exit: seconds to the confirmed finding"),
        "stragglers": ("benchmarks.latency.stragglers", "straggler latency per slowdown level and kind"),
        "peer": (
            "benchmarks.latency.peer",
            "faults made by an independent tool (lm-resiliency's injector) in a job enabling it: named? false blame",
        ),
    },
    "false-positives": {
        "clean": ("benchmarks.false_positives.clean", "healthy runs (plain, hog, six ranks, slow, pause): 0 findings"),
        "replay": (
            "benchmarks.false_positives.replay",
            "recorded runs' evidence.jsonl through today's straggler and numeric rules, offline",
        ),
        "straggler-replay": (
            "benchmarks.false_positives.straggler_replay",
            "older runs' straggler traces through today's straggler rule, offline",
        ),
    },
    "overhead": {
        "sliced": (
            "benchmarks.overhead.sliced",
            "headline step-time cost: both jobs alive, time-sliced; median of pair ratios, 95 % interval",
        ),
        "pairs": ("benchmarks.overhead.pairs", "sequential baseline/trainscout pairs in alternating order"),
        "checks": ("benchmarks.overhead.checks", "each numerical check's cost beside all checks off"),
        "probe": ("benchmarks.overhead.probe", "the probe's cost on the training thread, in-process A/B"),
        "profile": ("benchmarks.overhead.profile", "where the overhead goes: CPU per process, py-spy of one rank"),
    },
    "throughput": {
        "fingerprint": ("benchmarks.throughput.fingerprint", "CPU fingerprint GB/s a core against numpy and a copy"),
    },
    "scale": {
        "coordinator": (
            "benchmarks.scale",
            "the real coordinator fed by simulated node agents, 1k-100k ranks: pass time, RSS, digest bytes, a fault",
        ),
        "faults": (
            "benchmarks.scale_matrix",
            "hang, desync, crash, straggler, SDC at a random rank, and clean runs, per scale and layout: exact?",
        ),
        "node": (
            "benchmarks.scale_node",
            "a real 8-rank gloo node under trainscout: agent/coordinator/supervisor CPU and RSS, agent bytes/s",
        ),
    },
    "soak": {
        "run": (
            "benchmarks.soak",
            "one long job with every check on: RSS, descriptors, shared memory flat; 0 findings",
        ),
    },
    "gpu": {
        "overhead": ("benchmarks.gpu.overhead", "step time on H200s: baseline, trainscout, the peer, per workload"),
        "fingerprint": ("benchmarks.gpu.fingerprint", "GPU fingerprint TB/s beside torch.sum and the peer"),
        "host-costs": ("benchmarks.gpu.host_costs", "the non-finite check's host time per step, part by part"),
        "overlap": ("benchmarks.gpu.overlap", "design experiment: non-finite count at end of backward vs overlapped"),
        "bucket-norm": ("benchmarks.gpu.bucket_norm", "a gradient bucket's sampled norm: GPU time beside other reads"),
        "sampled-read": ("benchmarks.gpu.sampled_read", "the non-finite counting kernel's GPU time per sample rate"),
        "hpz": ("benchmarks.gpu.hpz", "ZeRO++ hpZ race: reproduced, named, fixed, timed (2 GPUs)"),
    },
}

# smoke-test sizes (placed before the user's options, which win); every one includes --no-record
QUICK: dict[tuple[str, str], list[str]] = {
    ("latency", "unscripted"): ["--runs", "1", "--cases", "output sign flip (hook)", "--no-record"],
    ("latency", "faults"): ["--runs", "1", "--faults", "crash", "--steps", "40", "--no-record"],
    ("latency", "stragglers"): ["--runs", "1", "--cases", "compute 2x", "--no-record"],
    ("latency", "peer"): ["--runs", "1", "--cases", "output: sign flip", "--no-record"],
    ("false-positives", "clean"): [
        *("--plain", "1", "--slow", "0", "--pause", "0", "--hog", "0", "--real", "0", "--steps", "60", "--no-record"),
    ],
    ("overhead", "sliced"): ["--pairs", "1", "--seconds", "6", "--warmup", "10", "--no-record"],
    ("overhead", "pairs"): ["--pairs", "1", "--steps", "40", "--warmup", "10", "--max-wait", "0", "--no-record"],
    ("overhead", "checks"): [
        *("--rounds", "1", "--steps", "40", "--warmup", "10", "--only", "state only", "--no-record"),
    ],
    ("overhead", "probe"): ["--blocks", "2", "--block-steps", "10", "--warmup", "10", "--no-record"],
    ("overhead", "profile"): ["--steps", "60", "--only-trainscout", "--no-record"],
    ("throughput", "fingerprint"): ["--sizes-mib", "1", "16", "--reps", "2", "--no-record"],
    ("soak", "run"): ["--minutes", "2", "--warmup-minutes", "0.5", "--every", "10", "--no-record"],
    ("scale", "node"): ["--seconds", "10", "--no-baseline", "--no-record"],
    ("scale", "faults"): [
        *("--scales", "64", "--step-s", "0.25", "--onset-s", "6", "--after-s", "8", "--procs", "1", "--no-record"),
    ],
}


def usage() -> str:
    lines = [__doc__.split("\n\n")[0], "", "questions (python -m benchmarks QUESTION --help for its modes):"]
    lines += [f"  {q:16s} {', '.join(modes)}" for q, modes in QUESTIONS.items()]
    return "\n".join(lines)


def question_usage(question: str) -> str:
    lines = [f"python -m benchmarks {question} [MODE] [OPTIONS]  (MODE --help: its options)", "", "modes:"]
    for i, (mode, (_, what)) in enumerate(QUESTIONS[question].items()):
        quick = " [--quick]" if (question, mode) in QUICK else ""
        lines.append(f"  {mode:17s}{'(default) ' if i == 0 else ''}{what}{quick}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    question, rest = argv[0], argv[1:]
    if question not in QUESTIONS:
        print(f"unknown question {question!r}\n\n{usage()}", file=sys.stderr)
        return 2
    modes = QUESTIONS[question]
    if rest and rest[0] in ("-h", "--help"):
        print(question_usage(question))
        return 0
    if rest and not rest[0].startswith("-"):
        mode, rest = rest[0], rest[1:]
        if mode not in modes:
            print(f"unknown mode {mode!r} of {question}\n\n{question_usage(question)}", file=sys.stderr)
            return 2
    else:
        mode = next(iter(modes))
    if "--quick" in rest:
        if (question, mode) not in QUICK:
            print(f"{question} {mode} has no --quick preset; give its size options instead", file=sys.stderr)
            return 2
        rest = QUICK[question, mode] + [a for a in rest if a != "--quick"]
    if importlib.util.find_spec("trainscout") is None:  # a GPU machine's checkout without an install
        sys.path.insert(0, str(REPO / "src"))
    # argv[0] is what argparse shows as the program and what RESULTS.md records as the command
    sys.argv = [f"benchmarks {question} {mode}", *rest]
    runpy.run_module(modes[mode][0], run_name="__main__", alter_sys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
