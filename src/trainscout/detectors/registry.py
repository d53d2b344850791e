"""The detectors a coordinator runs, in judging order, built from the settings.

Adding a detector: implement detectors/interface.py's `Detector` and list it in `default_detectors`; the
coordinator needs no change unless the detector asks for something new of it (a new kind of `Ask`).
Order matters where findings of one pass depend on each other: protocol first (a desync explains the hang it
causes), exits last (an exit that follows from a root cause named in the same pass is not a new fault).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from trainscout.detectors.desync import DesyncDetector
from trainscout.detectors.devices import DeviceWatch
from trainscout.detectors.exits import ExitDetector
from trainscout.detectors.hpz import HpzRaceDetector
from trainscout.detectors.interface import Detector
from trainscout.detectors.nonfinite import NonFiniteDetector
from trainscout.detectors.numerics import NumericDetector
from trainscout.detectors.progress import HangDetector
from trainscout.detectors.replay import ReplayDetector
from trainscout.detectors.state import ReplicaStateDetector
from trainscout.detectors.straggler import StragglerDetector


class Registry:
    def __init__(self, detectors: Iterable[Detector]) -> None:
        self._order: list[Detector] = []
        self._by_name: dict[str, Detector] = {}
        for d in detectors:
            if not isinstance(d, Detector) or not d.name:
                raise TypeError(f"{d!r} does not implement the detector interface (a name, observe, judge, close)")
            if d.name in self._by_name:
                raise ValueError(f"two detectors named {d.name!r}")
            self._order.append(d)
            self._by_name[d.name] = d

    def __iter__(self) -> Iterator[Detector]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def names(self) -> list[str]:
        return [d.name for d in self._order]

    def get(self, name: str) -> Detector | None:
        return self._by_name.get(name)


def default_detectors(*, hang_timeout_s: float, stall_timeout_s: float, gpu_stragglers: bool = True) -> Registry:
    return Registry(
        [
            DesyncDetector(),
            HangDetector(hang_timeout_s=hang_timeout_s, stall_timeout_s=stall_timeout_s),
            ReplicaStateDetector(),
            NumericDetector(),  # loss and layer gradient norms against peers: suspects, confirmed before named
            NonFiniteDetector(),
            HpzRaceDetector(),
            ReplayDetector(),
            # CUDA jobs: compute is judged on GPU-side spans, or (stragglers.gpu off) not at all
            StragglerDetector(gpu_compute=gpu_stragglers),
            DeviceWatch(),
            ExitDetector(blocked_s=hang_timeout_s),
        ]
    )
