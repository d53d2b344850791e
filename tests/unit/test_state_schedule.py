"""The replicated-state check's schedule: slots, strides within a time budget, and what the coordinator can verify."""

from __future__ import annotations

import torch

from trainscout.detectors.state import verified_step, verified_window
from trainscout.fingerprint import fingerprint_range
from trainscout.probe import state_check
from trainscout.probe.state_check import StateCheck


def _optimizer(sizes=(3000, 70000, 12, 40000, 5)):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt, params


def _check(tmp_path, monkeypatch, **kw):
    monkeypatch.setattr(state_check, "tensor_table_path", lambda run_id, rank: str(tmp_path / f"{run_id}-{rank}.json"))
    records = []
    sc = StateCheck("sched", 0, lambda *rec: records.append(rec), **kw)
    sc.replica_group = "pg0"
    return sc, records


def test_every_byte_of_state_is_in_exactly_one_slot_and_slot_count_is_odd(tmp_path, monkeypatch):
    opt, params = _optimizer()
    sc, records = _check(tmp_path, monkeypatch, min_chunk=4096)
    sc.after_step(opt, 16, 0.05)
    n = len(sc._slots)
    assert n % 2 == 1 and n > 1
    covered: dict[int, list[tuple[int, int]]] = {}
    for slot in sc._slots[: n - (1 if sc._slots[-1] is sc._slots[0] else 0)]:
        for tid, _t, start, end in slot:
            covered.setdefault(tid, []).append((start, end))
    sizes = {sc._ids[name]: None for name, _ in sc.table}
    assert set(covered) == set(sizes)
    for ranges in covered.values():
        ranges.sort()
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_records_are_the_reference_fingerprints_of_slot_step_mod_n(tmp_path, monkeypatch):
    opt, params = _optimizer()
    sc, records = _check(tmp_path, monkeypatch, min_chunk=4096, initial_stride=1, budget=0)
    sc.after_step(opt, 7, 0.05)
    n = len(sc._slots)
    expected = [(tid, fingerprint_range(t, s, e), s) for tid, t, s, e in sc._slots[7 % n]]
    assert [(r[1], r[2], r[3]) for r in records] == expected
    assert all(r[5] == 7 and r[0] == state_check.STATE_PG_INDEX for r in records)


def test_stride_grows_to_fit_the_budget_and_power_of_two_strides_still_reach_every_slot(tmp_path, monkeypatch):
    opt, params = _optimizer()
    sc, records = _check(tmp_path, monkeypatch, min_chunk=4096, initial_stride=1, budget=0.005)
    # a 1 ms step: hashing a slot costs far more than 0.5 % of it, so the stride must grow
    for step in range(1, 200):
        sc.after_step(opt, step, 0.001)
    assert sc.stride > 1 and sc.stride & (sc.stride - 1) == 0
    hashed_steps = sorted({r[5] for r in records if r[5] > 100})
    assert all(s % sc.stride == 0 for s in hashed_steps[-3:])
    n = len(sc._slots)
    for stride in (1, 2, 4, 8, 16, 64):
        assert {(k * stride) % n for k in range(n)} == set(range(n))


def test_a_generous_step_time_keeps_stride_one(tmp_path, monkeypatch):
    opt, params = _optimizer(sizes=(64, 32))
    sc, records = _check(tmp_path, monkeypatch, initial_stride=4, budget=0.5)
    for step in range(1, 40):
        sc.after_step(opt, step, 10.0)
    assert sc.stride == 1


def test_fixed_period_hashes_every_step_and_covers_the_state_within_the_period(tmp_path, monkeypatch):
    opt, params = _optimizer()
    sc, records = _check(tmp_path, monkeypatch, period=8)
    for step in range(1, 9):
        sc.after_step(opt, step, 0.001)
    assert sc.stride == 1 and len(sc._slots) <= 8
    seen = {(r[1], r[3]) for r in records}
    assert seen == {(tid, s) for slot in sc._slots for tid, _, s, _ in slot}


def test_verified_window_needs_every_slot_clean_since_the_last_disagreement():
    # three slots checked at stride 2: steps 2, 4, 6 visit slots 2, 1, 0
    assert verified_window({2: True, 4: True, 6: True}, 3) == (6, 2)
    assert verified_window({2: True, 4: True}, 3) == (-1, -1)
    # a disagreement at 8 resets; 10, 12, 14 cover slots 1, 0, 2 again
    clean = {2: True, 4: True, 6: True, 8: False, 10: True, 12: True}
    assert verified_window(clean, 3) == (6, 2)
    clean[14] = True
    assert verified_window(clean, 3) == (14, 10)
    assert verified_step(clean, 3) == 14
    assert verified_window(clean, 0) == (-1, -1)
