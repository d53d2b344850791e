"""Every setting of trainscout, declared once: its type, default, accepted values and one line of doc.

A setting comes from a command-line flag, an environment variable or a `trainscout.toml` file, in that order
of precedence, else its default. `trainscout run` resolves and validates them all before anything starts (a
bad value stops it with one line naming the setting and what it accepts), then hands the effective values to
its own processes (ranks, agent, coordinator) as the same environment variables; those read them back with
`from_environ`. Modules receive their settings; none reads the environment itself. `trainscout config`
prints the effective values and where each came from; docs/configuration.md is generated from this
declaration (`trainscout config --markdown`) and a test keeps the two equal.

Variables trainscout passes between its own processes (run id, run folder, secret, ...) are listed in
INTERNAL: set by `trainscout run`, not settings.

No torch, no I/O beyond reading the TOML file.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

TOML_FILE = "trainscout.toml"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting's value is not one it accepts; the message names the setting and what it accepts."""


def setting(
    default: Any,
    env: str,
    doc: str,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: tuple[str, ...] = (),
    flag: str = "",
    low_open: bool = False,
) -> Any:
    """A declared setting: a dataclass field whose metadata says how it is set and checked."""
    return field(
        default=default,
        metadata={
            "env": env,
            "doc": doc,
            "low": low,
            "high": high,
            "choices": choices,
            "flag": flag,
            "low_open": low_open,
        },
    )


@dataclass(frozen=True)
class Run:
    hang_timeout: float = setting(
        5.0,
        "TRAINSCOUT_HANG_TIMEOUT",
        low=0,
        low_open=True,
        flag="--hang-timeout",
        doc="seconds with no progress on any rank before a hang is judged",
    )
    stall_timeout: float = setting(
        300.0,
        "TRAINSCOUT_STALL_TIMEOUT",
        low=0,
        low_open=True,
        flag="--stall-timeout",
        doc="seconds a job-wide pause may last before a stall is reported (three times that before the first step)",
    )
    abort_on: str = setting(
        "",
        "TRAINSCOUT_ABORT_ON",
        flag="--abort-on",
        doc="comma-separated finding kinds that stop the training job (e.g. hang,desync)",
    )
    monitor_nice: int = setting(
        0,
        "TRAINSCOUT_MONITOR_NICE",
        low=0,
        high=19,
        flag="--monitor-nice",
        doc="CPU niceness added to the agent and the coordinator (0-19)",
    )
    stack_method: str = setting(
        "py-spy",
        "TRAINSCOUT_STACK_METHOD",
        choices=("py-spy", "faulthandler"),
        flag="--stack-method",
        doc="how stacks are taken from outside a stuck rank (falls back to faulthandler)",
    )
    console: str = setting(
        "auto",
        "TRAINSCOUT_CONSOLE",
        choices=("auto", "rich", "plain"),
        flag="--console",
        doc="finding output style (auto: rich on a terminal, plain lines otherwise)",
    )
    log_level: str = setting(
        "INFO",
        "TRAINSCOUT_LOG_LEVEL",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        flag="--log-level",
        doc="least severe line written to runs/<id>/trainscout.log (every process, with its rank and step)",
    )
    metrics_port: int = setting(
        0,
        "TRAINSCOUT_METRICS_PORT",
        low=0,
        high=65535,
        flag="--metrics-port",
        doc="serve Prometheus metrics on this TCP port of the coordinator (0: off; needs trainscout[metrics])",
    )
    metrics_addr: str = setting(
        "127.0.0.1",
        "TRAINSCOUT_METRICS_ADDR",
        flag="--metrics-addr",
        doc="address the metrics endpoint binds (0.0.0.0: every interface, for a Prometheus on another host)",
    )
    metrics_max_ranks: int = setting(
        512,
        "TRAINSCOUT_METRICS_MAX_RANKS",
        low=0,
        doc="ranks given per-rank metric series: all up to this many, else this many of the slowest",
    )
    notify: str = setting(
        "",
        "TRAINSCOUT_NOTIFY",
        flag="--notify",
        doc="comma-separated http(s) URLs each finding is POSTed to as JSON with a chat `text` line",
    )
    on_finding: str = setting(
        "",
        "TRAINSCOUT_ON_FINDING",
        flag="--on-finding",
        doc="shell command run once per finding naming a culprit, in the background, one at a time; "
        "TRAINSCOUT_VERDICT holds the path of verdict.json (output: on_finding.log)",
    )
    exit_status: str = setting(
        "verdict",
        "TRAINSCOUT_EXIT_STATUS",
        choices=("verdict", "launcher"),
        flag="--exit-status",
        doc="what `trainscout run` exits with: verdict (0 job succeeded, 3 job failed and a culprit named, "
        "4 job failed and nobody named) or launcher (the launcher's own exit code)",
    )
    tool_restarts: int = setting(
        10,
        "TRAINSCOUT_TOOL_RESTARTS",
        low=0,
        high=1000,
        doc="times a dead agent or coordinator is restarted, each (0: never; monitoring then ends with it)",
    )


@dataclass(frozen=True)
class Probe:
    tick_s: float = setting(
        0.5,
        "TRAINSCOUT_PROBE_TICK_S",
        low=0.01,
        high=60,
        doc="seconds between the probe thread's heartbeats and Flight Recorder polls",
    )
    evidence: bool = setting(
        True, "TRAINSCOUT_EVIDENCE", doc="each step's local loss and layer gradient norms (needs the non-finite check)"
    )


@dataclass(frozen=True)
class StateCheck:
    enabled: bool = setting(
        True, "TRAINSCOUT_STATE_CHECK", doc="fingerprint replicated parameters and optimizer state in a rotation"
    )
    budget: float = setting(
        0.005,
        "TRAINSCOUT_STATE_BUDGET",
        low=0,
        low_open=True,
        high=1,
        doc="share of step time the rotation may take (it adapts its stride)",
    )
    period: int = setting(
        0,
        "TRAINSCOUT_STATE_PERIOD",
        low=0,
        high=4096,  # the coordinator keeps this many compared steps: a longer rotation would never be verified
        doc="a fixed rotation of this many slots hashed every step instead of the budget (0: off)",
    )


@dataclass(frozen=True)
class NonFiniteCheck:
    enabled: bool = setting(
        True,
        "TRAINSCOUT_NONFINITE_CHECK",
        doc="test each rank's loss and local gradients for NaN/Inf before any reduction",
    )
    budget: float = setting(
        0.001,
        "TRAINSCOUT_NONFINITE_BUDGET",
        low=0,
        low_open=True,
        doc="share of step time the gradient test may take: on CUDA, with 256 MiB of gradients or more, large "
        "gradients are read in a sample of 1 sector in up to 64 when a whole read would take more; on CPU "
        "with per-step evidence off, it runs every `stride` steps (>= 1: every element, every step)",
    )


@dataclass(frozen=True)
class Replay:
    every: int = setting(
        200,
        "TRAINSCOUT_REPLAY_EVERY",
        low=0,
        doc="steps between scheduled replays of one layer, at least (0: replay off)",
    )
    budget: float = setting(
        0.001,
        "TRAINSCOUT_REPLAY_BUDGET",
        low=0,
        doc="share of step time replay may take, which stretches its interval (0: a replay "
        "exactly every `every` steps)",
    )


@dataclass(frozen=True)
class Gather:
    period: int = setting(
        4, "TRAINSCOUT_GATHER_PERIOD", low=1, doc="FSDP2 all-gather check: groups of units checked in turn (made odd)"
    )


@dataclass(frozen=True)
class Hpz:
    check: bool = setting(
        True, "TRAINSCOUT_HPZ_CHECK", doc="ZeRO++ hpZ: compare the weights a module used in backward with its forward's"
    )
    period: int = setting(4, "TRAINSCOUT_HPZ_PERIOD", low=1, doc="hpZ check: one module in this many per step")
    fix: str = setting(
        "event",
        "TRAINSCOUT_HPZ_FIX",
        choices=("event", "off", "unsafe"),
        doc="hpZ secondary-partition ordering: event (CUDA event, no host stall), off "
        "(DeepSpeed as shipped), unsafe (no ordering: benchmarks only)",
    )


@dataclass(frozen=True)
class Checks:
    state: StateCheck = field(default_factory=StateCheck)
    nonfinite: NonFiniteCheck = field(default_factory=NonFiniteCheck)
    replay: Replay = field(default_factory=Replay)
    gather: Gather = field(default_factory=Gather)
    hpz: Hpz = field(default_factory=Hpz)
    link_probe: bool = setting(
        True,
        "TRAINSCOUT_LINK_PROBE",
        doc="time exchanges between ranks when a group's collectives slow on every member",
    )


@dataclass(frozen=True)
class Stragglers:
    gpu: bool = setting(
        True,
        "TRAINSCOUT_GPU_STRAGGLERS",
        doc="judge CUDA jobs' compute by GPU-side time (off: their compute is not judged)",
    )


@dataclass(frozen=True)
class Fingerprint:
    threads: int = setting(
        1,
        "TRAINSCOUT_FINGERPRINT_THREADS",
        low=1,
        doc="threads hashing CPU tensors inside a rank (every core is the job's)",
    )
    native: bool = setting(
        True,
        "TRAINSCOUT_FINGERPRINT_NATIVE",
        doc="hash CPU tensors with the C extension where it is built (off: numpy)",
    )


@dataclass(frozen=True)
class Config:
    run: Run = field(default_factory=Run)
    probe: Probe = field(default_factory=Probe)
    checks: Checks = field(default_factory=Checks)
    stragglers: Stragglers = field(default_factory=Stragglers)
    fingerprint: Fingerprint = field(default_factory=Fingerprint)


RUN = Run()  # the defaults, for signatures that need one (the declaration above is the only place they are written)

# Set by `trainscout run` for its own processes, or by a user for one purpose named here: not settings.
INTERNAL: dict[str, str] = {
    "TRAINSCOUT_RUN_ID": "the run's id (names its shared-memory channels), for the ranks' probes",
    "TRAINSCOUT_RUN_DIR": "the run's folder, where ranks write their cost reports",
    "TRAINSCOUT_SECRET": "hex job secret: keys the agent <-> coordinator CURVE encryption and signs its frames; "
    "set it yourself, the same on every node, for a multi-node run",
    "TRAINSCOUT_PKG_PATH": "where the bootstrap finds trainscout inside a rank",
    "TRAINSCOUT_PROBE_PID": "marks a rank's children (DataLoader workers) so they start no probe of their own",
    "TRAINSCOUT_INJECT": "faults to inject (`--inject`), for the ranks",
    "TRAINSCOUT_RANKS_FROM": "`slurm`: srun tasks are the ranks; the bootstrap sets RANK, WORLD_SIZE, LOCAL_RANK, "
    "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from SLURM's variables where unset (docs/launchers.md)",
    "TRAINSCOUT_VERDICT": "for the `--on-finding` command: the path of the run's verdict.json",
    "TRAINSCOUT_FAULT_LOG": "benchmarks: a file each injected fault appends a line to when it fires",
    "TRAINSCOUT_NO_NATIVE": "build time: do not build the C fingerprint",
    "TRAINSCOUT_NATIVE_OPTIONAL": "tests: a missing C fingerprint is no failure",
}


@dataclass(frozen=True)
class Setting:
    path: str  # dotted, e.g. "checks.state.budget"
    env: str
    type: type
    default: Any
    doc: str
    low: float | None
    high: float | None
    choices: tuple[str, ...]
    flag: str
    low_open: bool

    def accepts(self) -> str:
        if self.type is bool:
            return "true or false (1/0, yes/no, on/off)"
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.type is str:
            return "text"
        kind = "an integer" if self.type is int else "a number"
        low = "" if self.low is None else (f" > {self.low:g}" if self.low_open else f" >= {self.low:g}")
        high = "" if self.high is None else f" <= {self.high:g}"
        return kind + (low + ("," if low and high else "") + high if low or high else "")

    def parse(self, value: Any, where: str) -> Any:
        """The value as this setting's type, or ConfigError naming the setting, where it came from and what it
        accepts."""

        def bad() -> ConfigError:
            return ConfigError(f"{self.path} ({where}) = {value!r}: expected {self.accepts()}")

        if self.type is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise bad()
        if self.type is str:
            text = str(value).strip()
            if self.choices and text not in self.choices:
                raise bad()
            return text
        try:
            if isinstance(value, bool):
                raise ValueError
            number = self.type(str(value).strip()) if not isinstance(value, (int, float)) else self.type(value)
        except (TypeError, ValueError):
            raise bad() from None
        if self.type is int and isinstance(value, float) and not value.is_integer():
            raise bad()
        if isinstance(number, float) and not math.isfinite(number):
            raise bad()
        if self.low is not None and (number < self.low or (self.low_open and number == self.low)):
            raise bad()
        if self.high is not None and number > self.high:
            raise bad()
        return number


def settings(cls: type = Config, prefix: str = "") -> Iterator[Setting]:
    """Every declared setting, depth first, in declaration order."""
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        sub = _resolve(cls, f)
        if sub is not None:
            yield from settings(sub, path + ".")
            continue
        m = f.metadata
        yield Setting(
            path,
            m["env"],
            type(f.default),
            f.default,
            m["doc"],
            m["low"],
            m["high"],
            m["choices"],
            m["flag"],
            m["low_open"],
        )


def _resolve(cls: type, f: dataclasses.Field) -> Any:
    """The section class of a nested field (built by its default factory), or None for a setting."""
    if f.default_factory is not dataclasses.MISSING:  # nested sections are built by their factory
        made = f.default_factory()
        return type(made) if dataclasses.is_dataclass(made) else None
    return None


SETTINGS: dict[str, Setting] = {s.path: s for s in settings()}
BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS.values()}


def load(
    flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None, toml_path: str | None = None
) -> tuple[Config, dict[str, str]]:
    """(the effective configuration, setting path -> where its value came from: flag | env | toml | default).
    Raises ConfigError on the first bad value, an unknown setting in the TOML file or an unreadable file."""
    environ = os.environ if environ is None else environ
    flags = dict(flags or {})
    file_values: dict[str, Any] = {}
    path = toml_path if toml_path is not None else (TOML_FILE if os.path.exists(TOML_FILE) else None)
    if path is not None:
        file_values = _read_toml(path)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in flags:
        if name not in SETTINGS:
            raise ConfigError(f"unknown setting {name!r}")
    for s in SETTINGS.values():
        if flags.get(s.path) is not None:
            values[s.path], sources[s.path] = s.parse(flags[s.path], s.flag or "flag"), "flag"
        elif s.env in environ:
            values[s.path], sources[s.path] = s.parse(environ[s.env], s.env), "env"
        elif s.path in file_values:
            values[s.path], sources[s.path] = s.parse(file_values[s.path], path or TOML_FILE), "toml"
        else:
            values[s.path], sources[s.path] = s.default, "default"
    return build(values), sources


def from_environ(environ: Mapping[str, str] | None = None) -> tuple[Config, list[str]]:
    """Inside trainscout's own processes: the configuration `trainscout run` exported, and the problems with
    any value set by hand that is not accepted (that setting then keeps its default: a rank must never fail
    over its monitor's settings)."""
    environ = os.environ if environ is None else environ
    values, problems = {}, []
    for s in SETTINGS.values():
        if s.env in environ:
            try:
                values[s.path] = s.parse(environ[s.env], s.env)
            except ConfigError as exc:
                problems.append(f"{exc}; using {s.default!r}")
    return build(values), problems


def build(values: Mapping[str, Any]) -> Config:
    """A Config from dotted paths to values (the rest default)."""

    def make(cls: type, prefix: str) -> Any:
        kwargs = {}
        for f in dataclasses.fields(cls):
            path = f"{prefix}{f.name}"
            sub = _resolve(cls, f)
            if sub is not None:
                kwargs[f.name] = make(sub, path + ".")
            elif path in values:
                kwargs[f.name] = values[path]
        return cls(**kwargs)

    return make(Config, "")


def to_environ(cfg: Config) -> dict[str, str]:
    """Every setting as the environment variable its processes read back (bools as 1/0)."""
    out = {}
    for s in SETTINGS.values():
        value = value_of(cfg, s.path)
        out[s.env] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def value_of(cfg: Config, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _read_toml(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}

    def walk(table: Mapping[str, Any], prefix: str) -> None:
        for key, value in table.items():
            path_ = f"{prefix}{key}"
            if isinstance(value, Mapping):
                walk(value, path_ + ".")
            elif path_ in SETTINGS:
                flat[path_] = value
            else:
                raise ConfigError(f"{path}: unknown setting {path_!r} (settings: trainscout config)")

    walk(doc, "")
    return flat


def describe(cfg: Config, sources: Mapping[str, str]) -> list[tuple[str, str, str, str, str]]:
    """(setting, value, source, environment variable, doc) for `trainscout config`."""
    return [
        (s.path, repr(value_of(cfg, s.path)), sources.get(s.path, "default"), s.env, s.doc) for s in SETTINGS.values()
    ]


def markdown() -> str:
    """docs/configuration.md, from the declaration."""
    lines = [
        "# Configuration",
        "",
        "Generated from `src/trainscout/config.py` by `trainscout config --markdown`; a test keeps it equal.",
        "",
        "Each setting comes from a command-line flag of `trainscout run`, an environment variable or a "
        f"`{TOML_FILE}` file in the working directory (or `--config FILE`), in that order of precedence, "
        "else its default. `trainscout run` checks every value before anything starts; `trainscout config` "
        "prints the effective values and where each came from. In the TOML file a setting is written by its "
        "path, e.g. `[checks.state]` then `budget = 0.002`.",
        "",
        "| setting | default | accepts | environment variable | flag | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS.values():
        lines.append(
            f"| `{s.path}` | `{s.default!r}` | {s.accepts()} | `{s.env}` | {f'`{s.flag}`' if s.flag else ''} "
            f"| {s.doc} |"
        )
    lines += [
        "",
        "Variables trainscout passes between its own processes (not settings):",
        "",
        "| variable | what |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {what} |" for name, what in INTERNAL.items()]
    return "\n".join(lines) + "\n"
