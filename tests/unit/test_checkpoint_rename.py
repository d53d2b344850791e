"""A checkpoint saved under a temporary name and renamed into place takes its certificate along."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

from trainscout.probe.checkpoints import CERT_INDEX, CERT_SUFFIX, CheckpointHooks


def _hooks(tmp_path: Path, errors: list[str]) -> tuple[CheckpointHooks, types.SimpleNamespace]:
    hooks = CheckpointHooks("ckrename", 0, lambda: 40, errors.append)
    saver = types.SimpleNamespace(save=lambda obj, f: Path(f).write_bytes(b"weights"))
    hooks.wrap_torch_save(saver)
    return hooks, saver


def test_the_certificate_follows_a_rename_into_place(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv("TRAINSCOUT_RUN_DIR", str(run_dir))  # as a rank of a run has it
    real_replace, real_rename = os.replace, os.rename
    errors: list[str] = []
    hooks, saver = _hooks(tmp_path, errors)
    hooks.wrap_renames()
    try:
        assert os.replace is not real_replace and os.rename is not real_rename
        final = tmp_path / "step-000040.pt"
        saver.save({}, str(final) + ".tmp")
        assert Path(str(final) + ".tmp" + CERT_SUFFIX).exists()
        os.replace(str(final) + ".tmp", final)  # the job's own atomic save
        cert_path = Path(str(final) + CERT_SUFFIX)
        cert = json.loads(cert_path.read_text())
        assert cert["checkpoint"] == str(final) and cert["status"] == "unverified"  # no coordinator here
        assert not Path(str(final) + ".tmp" + CERT_SUFFIX).exists()
        # pathlib's rename goes through os.rename: followed too
        moved = tmp_path / "kept" / "step-000040.pt"
        moved.parent.mkdir()
        final.rename(moved)
        assert json.loads(Path(str(moved) + CERT_SUFFIX).read_text())["checkpoint"] == str(moved)
        index = [json.loads(line) for line in (run_dir / CERT_INDEX).read_text().splitlines()]
        assert [Path(e["checkpoint"]).name for e in index] == ["step-000040.pt.tmp", "step-000040.pt", "step-000040.pt"]
        assert index[-1]["certificate"] == str(moved) + CERT_SUFFIX
        # renames of anything else pass through untouched
        (tmp_path / "a").write_text("x")
        os.replace(tmp_path / "a", tmp_path / "b")
        assert (tmp_path / "b").read_text() == "x" and not list(tmp_path.glob("b" + CERT_SUFFIX))
        assert errors == []
    finally:
        os.replace, os.rename = real_replace, real_rename
