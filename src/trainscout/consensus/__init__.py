"""Consensus: C3 vote and robust statistics over evidence per member of an equivalence class.

Pure functions the coordinator's detectors call; no torch, no I/O.
"""

from trainscout.consensus.c3 import AGREE, ATTRIBUTED, INCONCLUSIVE, Verdict, vote_exact, vote_exact_array
from trainscout.consensus.robust import Persistence, median_mad, vote_against_peers, vote_statistical

__all__ = [
    "AGREE",
    "ATTRIBUTED",
    "INCONCLUSIVE",
    "Persistence",
    "Verdict",
    "median_mad",
    "vote_exact",
    "vote_against_peers",
    "vote_exact_array",
    "vote_statistical",
]
