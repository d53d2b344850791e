"""Text form of injected faults: what `trainscout demo`, the tests and the benchmarks ask a rank to do wrong.

Faults travel to unmodified training scripts through one environment variable (TRAINSCOUT_INJECT), so they
must be plain text that a user can type on a command line: ``hang:rank=2:step=20;slow:rank=all:ms=80``.
This module only parses and validates that text; firing the faults is inject.py's job. Parsing is strict
(unknown kinds, keys or values are errors naming the bad token) because a silently ignored typo would make a
demo or a benchmark look like a detector failure.

No torch here: this module is imported in every process at interpreter start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

ENV_VAR = "TRAINSCOUT_INJECT"

DEFAULT_STEP = 10

# kind -> {param: default}; the defaults are filled in so an injector never has to guess.
_KIND_PARAMS: dict[str, dict[str, Any]] = {
    "hang": {},
    "gil": {},
    "crash": {"how": "kill"},
    "exit": {"code": 0},
    "desync": {"what": "shape"},
    "slow": {"ms": 50.0},
    "pause": {"seconds": 10.0},
    "corrupt": {"target": "param", "tensor": "", "how": "bitflip", "frac": 0.0, "factor": 1000.0, "key": ""},
    "nan": {"where": "param", "tensor": ""},
    "perturb": {"layer": "", "eps": 1e-3},
    "straggle": {"factor": 0.3, "every": 1},
    "dataslow": {"ms": 200.0},
    "ckptslow": {"ms": 500.0},
    "commslow": {"ms": 20.0},
    "gpuslow": {"ms": 20.0},
    "delay": {"ms": 100.0, "every": 1, "layer": "", "how": "sleep"},
    "starve": {"hogs": 2},
    "gradnoise": {"scale": 100.0, "count": 1, "layer": "", "how": "tensor", "op": "noise", "param": -1},
    "outflip": {"factor": -1.0, "layer": "", "how": "hook"},
}
KINDS: tuple[str, ...] = tuple(_KIND_PARAMS)

CRASH_HOWS = ("kill", "segv", "term", "int", "exception")
DESYNC_WHATS = ("shape", "dtype", "op", "reduce", "pg")
CORRUPT_TARGETS = ("param", "state", "gathered")
CORRUPT_HOWS = ("bitflip", "sign", "scale", "pct1", "pct100", "expflip", "signflip")
NAN_WHERES = ("param", "grad")
DELAY_HOWS = ("sleep", "busy", "read", "lock", "gpu", "data")
GRADNOISE_HOWS = ("tensor", "activation")
GRADNOISE_OPS = ("noise", "zero", "stale", "expflip")
OUTFLIP_HOWS = ("hook", "patch")

_COMMON_KEYS = ("rank", "step", "attempt")


@dataclass(frozen=True)
class FaultSpec:
    """One fault: which ranks (None = every rank) do what, from which optimizer step on."""

    kind: str
    ranks: tuple[int, ...] | None
    step: int
    params: dict = field(default_factory=dict)
    attempt: int | None = None  # only in this restart attempt of the job (torchrun --max-restarts); None: every one

    def applies_to(self, rank: int, attempt: int = 0) -> bool:
        return (self.ranks is None or rank in self.ranks) and (self.attempt is None or self.attempt == attempt)

    def to_text(self) -> str:
        """The spec in the form parse_faults reads (round-trips), e.g. for logs and child environments.

        The text form names one rank per token, so a spec built in code for several ranks becomes several
        ``;``-joined tokens. Parameters at their default are left out: parsing fills them in again, and an
        empty default (``tensor=``) is no valid key=value.
        """
        defaults = _KIND_PARAMS.get(self.kind, {})
        tail = (
            [f"step={self.step}"]
            + ([f"attempt={self.attempt}"] if self.attempt is not None else [])
            + [f"{k}={format_value(v)}" for k, v in self.params.items() if k not in defaults or v != defaults[k]]
        )
        ranks = ["all"] if self.ranks is None else [str(r) for r in self.ranks]
        return ";".join(":".join([self.kind, f"rank={r}", *tail]) for r in ranks)


def format_value(value: Any) -> str:
    # Floats like 50.0 print as "50" so to_text stays what a human would have typed.
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _parse_int(key: str, text: str, token: str, minimum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"fault spec {token!r}: {key}={text!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"fault spec {token!r}: {key}={value} must be >= {minimum}")
    return value


def _parse_exit_code(text: str, token: str) -> int:
    code = _parse_int("code", text, token, minimum=0)
    if code > 255:  # a process exit status is one byte; 256 would silently read as 0
        raise ValueError(f"fault spec {token!r}: code={code} must be <= 255")
    return code


def _parse_nonneg_float(key: str, text: str, token: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"fault spec {token!r}: {key}={text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):  # also rejects nan
        raise ValueError(f"fault spec {token!r}: {key}={text!r} must be a finite number >= 0")
    return value


def _parse_positive_float(key: str, text: str, token: str) -> float:
    value = _parse_nonneg_float(key, text, token)
    if value == 0:
        raise ValueError(f"fault spec {token!r}: {key}={text!r} must be > 0")
    return value


def _parse_fraction(key: str, text: str, token: str) -> float:
    value = _parse_nonneg_float(key, text, token)
    if value > 1:
        raise ValueError(f"fault spec {token!r}: {key}={text!r} must be between 0 and 1")
    return value


def _parse_factor(key: str, text: str, token: str) -> float:
    """A finite multiplier of either sign; 1 is refused: it would change nothing and read as a missed fault."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"fault spec {token!r}: {key}={text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"fault spec {token!r}: {key}={text!r} must be a finite number")
    if value == 1:
        raise ValueError(f"fault spec {token!r}: {key}={text!r} changes nothing; give another factor")
    return value


def _parse_text(key: str, text: str, token: str) -> str:
    return text


def _parse_choice(choices: tuple[str, ...]) -> Callable[[str, str, str], str]:
    def parse(key: str, text: str, token: str) -> str:
        if text not in choices:
            raise ValueError(f"fault spec {token!r}: {key}={text!r} is not one of {', '.join(choices)}")
        return text

    return parse


_PARAM_PARSERS: dict[tuple[str, str], Callable[[str, str, str], Any]] = {
    ("crash", "how"): _parse_choice(CRASH_HOWS),
    ("exit", "code"): lambda key, text, token: _parse_exit_code(text, token),
    ("desync", "what"): _parse_choice(DESYNC_WHATS),
    ("slow", "ms"): _parse_nonneg_float,
    ("pause", "seconds"): _parse_nonneg_float,
    ("corrupt", "target"): _parse_choice(CORRUPT_TARGETS),
    ("corrupt", "how"): _parse_choice(CORRUPT_HOWS),
    ("corrupt", "tensor"): _parse_text,
    ("corrupt", "frac"): _parse_fraction,
    ("corrupt", "factor"): _parse_factor,
    ("corrupt", "key"): _parse_text,
    ("nan", "where"): _parse_choice(NAN_WHERES),
    ("nan", "tensor"): _parse_text,
    ("perturb", "layer"): _parse_text,
    ("perturb", "eps"): _parse_nonneg_float,
    ("straggle", "factor"): _parse_nonneg_float,
    ("straggle", "every"): lambda key, text, token: _parse_int(key, text, token, minimum=1),
    ("dataslow", "ms"): _parse_nonneg_float,
    ("ckptslow", "ms"): _parse_nonneg_float,
    ("commslow", "ms"): _parse_nonneg_float,
    ("gpuslow", "ms"): _parse_nonneg_float,
    ("delay", "ms"): _parse_nonneg_float,
    ("delay", "every"): lambda key, text, token: _parse_int(key, text, token, minimum=1),
    ("delay", "layer"): _parse_text,
    ("delay", "how"): _parse_choice(DELAY_HOWS),
    ("starve", "hogs"): lambda key, text, token: _parse_int(key, text, token, minimum=1),
    ("gradnoise", "scale"): _parse_positive_float,
    ("gradnoise", "count"): lambda key, text, token: _parse_int(key, text, token, minimum=1),
    ("gradnoise", "layer"): _parse_text,
    ("gradnoise", "how"): _parse_choice(GRADNOISE_HOWS),
    ("gradnoise", "op"): _parse_choice(GRADNOISE_OPS),
    ("gradnoise", "param"): lambda key, text, token: _parse_int(key, text, token, minimum=-1),
    ("outflip", "factor"): _parse_factor,
    ("outflip", "layer"): _parse_text,
    ("outflip", "how"): _parse_choice(OUTFLIP_HOWS),
}


def _check_corrupt_combination(params: dict, given: set[str], token: str) -> None:
    """Refuse corrupt parameters that the chosen target or how would silently ignore."""
    if "key" in given and params["target"] != "state":
        raise ValueError(f"fault spec {token!r}: key= names an optimizer-state entry; it needs target=state")
    if "factor" in given and params["how"] != "scale":
        raise ValueError(f"fault spec {token!r}: factor= is used by how=scale only")
    if "frac" in given and (params["how"] in ("pct1", "pct100") or params["target"] == "gathered"):
        raise ValueError(
            f"fault spec {token!r}: frac= does not apply to how={params['how']} / "
            f"target={params['target']}; valid hows with frac: bitflip, sign, scale, expflip, signflip"
        )


def _check_gradnoise_combination(params: dict, given: set[str], token: str) -> None:
    """Refuse gradnoise parameters that how=activation cannot honour (it has no parameter of its own to hold)."""
    if params["how"] != "activation":
        return
    if params["op"] == "stale":
        raise ValueError(f"fault spec {token!r}: op=stale needs how=tensor (a parameter's own gradient to hold)")
    if "param" in given:
        raise ValueError(f"fault spec {token!r}: param= picks one parameter's gradient; it needs how=tensor")


def _parse_ranks(text: str, token: str) -> tuple[int, ...] | None:
    if text == "all":
        return None
    if not text.lstrip("-").isdigit():
        raise ValueError(
            f"fault spec {token!r}: rank={text!r} is not an integer or 'all' "
            "(one rank per spec; use several specs for several ranks)"
        )
    return (_parse_int("rank", text, token, minimum=0),)


def parse_fault(token: str) -> FaultSpec:
    """Parse one ``kind:key=value:...`` token; ValueError names the token and what would be valid."""
    token = token.strip()
    kind, *items = [part.strip() for part in token.split(":")]
    if kind not in _KIND_PARAMS:
        raise ValueError(f"fault spec {token!r}: unknown kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    defaults = _KIND_PARAMS[kind]
    valid_keys = _COMMON_KEYS + tuple(defaults)
    ranks: tuple[int, ...] | None = None  # rank omitted = every rank
    step = DEFAULT_STEP
    attempt: int | None = None
    params = dict(defaults)
    seen: set[str] = set()
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ValueError(
                f"fault spec {token!r}: {item!r} is not key=value; valid keys for {kind}: {', '.join(valid_keys)}"
            )
        if key not in valid_keys:
            raise ValueError(
                f"fault spec {token!r}: unknown key {key!r}; valid keys for {kind}: {', '.join(valid_keys)}"
            )
        if key in seen:
            raise ValueError(f"fault spec {token!r}: key {key!r} given twice")
        seen.add(key)
        if key == "rank":
            ranks = _parse_ranks(value, token)
        elif key == "step":
            step = _parse_int("step", value, token, minimum=0)
        elif key == "attempt":
            attempt = _parse_int("attempt", value, token, minimum=0)
        else:
            params[key] = _PARAM_PARSERS[(kind, key)](key, value, token)
    if kind == "corrupt":
        _check_corrupt_combination(params, seen, token)
    elif kind == "gradnoise":
        _check_gradnoise_combination(params, seen, token)
    return FaultSpec(kind=kind, ranks=ranks, step=step, params=params, attempt=attempt)


def parse_faults(text: str) -> list[FaultSpec]:
    """Parse ``;``-separated fault specs. Empty text (or stray separators) means no faults."""
    return [parse_fault(token) for token in text.split(";") if token.strip()]


def format_faults(specs: list[FaultSpec]) -> str:
    """Inverse of parse_faults: the value to put in TRAINSCOUT_INJECT for these specs."""
    return ";".join(spec.to_text() for spec in specs)
