"""Per-step evidence on CUDA: the loss and layer gradient norms the non-finite check emits (from its counting
kernel's one pass, or from the foreach-norm fallback) equal torch's on the same local gradients, for the
step they were taken at, although they land a few steps later."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
import torch.nn as nn

from trainscout.probe import local_evidence
from trainscout.probe.local_evidence import EVIDENCE_PG_INDEX, LocalEvidence, layer_of, loss_from_bits
from trainscout.probe.nonfinite import NonFiniteCheck

VOCAB = 1024


class _Mixed(nn.Module):
    """fp32 layers, one of them cut into two kernel items (1024 x 512 elements), and a bf16 layer: two dtype
    groups, so two launches."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 512)
        self.blocks = nn.ModuleList([nn.Linear(512, 256), nn.Linear(256, 256).to(torch.bfloat16)])
        self.head = nn.Linear(256, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.blocks[0](self.embed(x)))
        return self.head(self.blocks[1](h.to(torch.bfloat16)).float())


def _decode(records: list, layers: list[str]) -> dict[int, tuple[float, dict[str, float]]]:
    """step -> (loss, layer -> norm) from LocalEvidence's records."""
    out: dict[int, tuple[float, dict[str, float]]] = {}
    for rec in records:
        assert rec[0] == EVIDENCE_PG_INDEX and rec[6] == "evidence"
        part, count, _ = local_evidence.unpack_header(rec[3])
        norms = np.frombuffer(rec[7], dtype=np.float32)
        assert len(norms) == count
        loss, named = out.setdefault(rec[1], (loss_from_bits(rec[2]), {}))
        start = part * local_evidence.NORMS_PER_RECORD
        named.update(zip(layers[start : start + count], norms.tolist()))
    return out


@pytest.mark.parametrize("path", ["kernel", "norms"])
def test_evidence_on_cuda_equals_torch_on_the_same_local_gradients(cuda, tmp_path, monkeypatch, path):
    monkeypatch.setattr(local_evidence, "evidence_table_path", lambda run_id, rank: str(tmp_path / "layers.json"))
    records, reports = [], []
    evidence = LocalEvidence(lambda *rec: records.append(rec), "gpu", 0)
    state = {"step": 0}
    check = NonFiniteCheck(lambda *rec: reports.append(rec), lambda: state["step"], evidence=evidence)
    autograd = types.SimpleNamespace(backward=torch.autograd.backward)
    check.patch_autograd(autograd)  # the wrapper, without patching torch itself
    torch.manual_seed(0)
    model = _Mixed().to(cuda)
    named = dict(model.named_parameters())
    check.hook_params(model.parameters(), {id(p): n for n, p in named.items()})
    assert evidence.layers == ["embed", "blocks.0", "blocks.1", "head"]
    used = {"kernel": 0, "norms": 0}
    submit_counts, submit = check._submit_counts, check._submit

    def counting(step, loss):
        taken = submit_counts(step, loss)
        used["kernel"] += bool(taken)
        return taken

    def norms(*args, **kwargs):
        used["norms"] += 1
        return submit(*args, **kwargs)

    check._submit_counts, check._submit = counting, norms
    if path == "norms":
        check._counts_ok = False  # as after a kernel failure, or where Triton is missing
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator(device=cuda).manual_seed(5)
    want = {}
    steps = 14
    for step in range(1, steps + 1):
        x = torch.randint(0, VOCAB, (4, 32), device=cuda, generator=gen)
        loss = nn.functional.cross_entropy(model(x).view(-1, VOCAB), x.view(-1))
        if step % 2:
            loss = -loss  # the sign must survive
        autograd.backward(loss)
        sums: dict[str, float] = {}
        for name, p in named.items():  # torch on the same gradients, in float64 (syncs: a test, not the probe)
            sums[layer_of(name)] = sums.get(layer_of(name), 0.0) + float(p.grad.double().square().sum())
        want[step] = (float(loss.detach()), {layer: math.sqrt(v) for layer, v in sums.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] = step
        check.check_step()
    published_during_training = len(records)
    check.flush(timeout_s=10)
    got = _decode(records, evidence.layers)
    assert sorted(got) == list(range(1, steps + 1)) and published_during_training > 0
    for step, (loss, norms_by_layer) in want.items():
        assert got[step][0] == loss and (loss < 0) == (step % 2 == 1), (step, got[step][0], loss)
        layers = sorted(norms_by_layer)
        np.testing.assert_allclose([got[step][1][k] for k in layers], [norms_by_layer[k] for k in layers], rtol=1e-5)
    assert reports == [] and check._device_ok and check.device_checks == steps
    if path == "kernel":
        assert used == {"kernel": steps, "norms": 0} and check._counts_ok and check._layout is not None
        assert len(check._layout.groups) == 2 and check._layout.n_out == 1 + len(named) + 1  # the embedding: 2 items
    else:
        assert used == {"kernel": 0, "norms": steps}
