"""A causal LM shaped like the common library models (a head model around its transformer), 3-4 rank DDP on gloo.

What replay has to cope with in such models, none of it in the demo's: the blocks sit one level down
(`model.blocks.N`, not `blocks.N`); each block is called with keyword arguments (an attention mask, rotary
embeddings as a tuple) and answers with a dict; the transformer answers with a dataclass record and the head
model with a dict holding the loss. Unmodified training loop: torchrun, DDP, AdamW.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

VOCAB, SEQ, DIM, HEADS = 128, 32, 32, 4


@dataclass
class TransformerOutput:
    last_hidden_state: torch.Tensor
    hidden_states: tuple | None = None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, hidden, attention_mask=None, rotary=None, use_cache=False):
        b, t, _ = hidden.shape
        q, k, v = self.qkv(self.norm1(hidden)).view(b, t, 3, HEADS, DIM // HEADS).transpose(1, 3).unbind(2)
        cos, sin = rotary
        q, k = q * cos + q.roll(1, -1) * sin, k * cos + k.roll(1, -1) * sin
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        hidden = hidden + self.proj(att.transpose(1, 2).reshape(b, t, DIM))
        hidden = hidden + self.mlp(self.norm2(hidden))
        return {"hidden_states": hidden, "present": None}


class Transformer(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        freq = 1.0 / 10000 ** (torch.arange(DIM // HEADS) / (DIM // HEADS))
        angles = torch.arange(SEQ)[:, None] * freq[None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, input_ids, output_hidden_states=False):
        t = input_ids.shape[1]
        # an additive causal mask, as many models pass it
        mask = torch.full((t, t), float("-inf"), device=input_ids.device).triu(1)
        hidden = self.embed(input_ids)
        rotary = (self.cos[:t], self.sin[:t])
        seen = []
        for block in self.blocks:
            hidden = block(hidden, attention_mask=mask, rotary=rotary, use_cache=False)["hidden_states"]
            seen.append(hidden)
        return TransformerOutput(self.norm(hidden), tuple(seen) if output_hidden_states else None)


class CausalLM(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.model = Transformer(layers)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids, labels=None):
        logits = self.lm_head(self.model(input_ids).last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def batch(step: int, rank: int, size: int = 8) -> torch.Tensor:
    """Repeated motifs: a learnable language, different on every rank and step."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    period = int(torch.randint(2, 6, (1,), generator=g))
    motif = torch.randint(0, VOCAB, (size, period), generator=g)
    return motif.repeat(1, SEQ // period + 1)[:, :SEQ]


def add_sync_noise(model, on_this_rank: bool, now_due) -> None:
    """Where a gradient enters its reduction, outside trainscout: 100x its norm of noise, once, on one rank."""

    def noisy(t: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(7)
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device, t.dtype)
        t.add_(noise * (100 * t.norm() / noise.norm()))

    if isinstance(model, DistributedDataParallel):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):
            if on_this_rank and now_due():
                noisy(bucket.buffer())
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
    elif on_this_rank:
        real = dist.reduce_scatter_single

        def reduce_scatter_single(output, input, *args, **kwargs):
            if now_due():
                noisy(input)
            return real(output, input, *args, **kwargs)

        dist.reduce_scatter_single = reduce_scatter_single


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--zero", action="store_true", help="shard the optimizer: ZeroRedundancyOptimizer(AdamW)")
    parser.add_argument("--fsdp", action="store_true", help="shard the model: FSDP2 fully_shard, no DDP")
    parser.add_argument("--flip", default="", help="RANK:STEP: the job itself negates blocks.1's output there")
    parser.add_argument("--cuda", action="store_true", help="every rank on cuda:0 (gloo: ranks may share the GPU)")
    parser.add_argument("--hook", action="store_true", help="DDP: a Python communication hook (the plain all-reduce)")
    parser.add_argument(
        "--sync-noise",
        default="",
        help="RANK:STEP: the job itself adds noise to the gradient on its way into the reduction there (DDP: in its "
        "communication hook; FSDP2: in a wrapper of the reduce-scatter)",
    )
    parser.add_argument(
        "--zero-grad", default="", help="RANK:STEP: from then on the job itself zeroes blocks.1's local gradient"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        model = CausalLM(args.layers)
        for block in model.model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = DistributedDataParallel(CausalLM(args.layers).to(device))
    now = [0]
    noise_rank, noise_step = (int(v) for v in args.sync_noise.split(":")) if args.sync_noise else (-1, -1)
    if args.hook or args.sync_noise:
        add_sync_noise(model, rank == noise_rank, lambda: now[0] == noise_step)
    if args.flip and rank == int(args.flip.split(":")[0]):  # a fault trainscout is not told of
        start = int(args.flip.split(":")[1])

        def flip(module, inputs, output):
            return {**output, "hidden_states": -output["hidden_states"]} if now[0] >= start else output

        getattr(model, "module", model).model.blocks[1].register_forward_hook(flip)
    if args.zero_grad and rank == int(args.zero_grad.split(":")[0]):  # a hook gone wrong, before the all-reduce
        first = int(args.zero_grad.split(":")[1])
        for param in getattr(model, "module", model).model.blocks[1].parameters():
            param.register_hook(lambda grad: torch.zeros_like(grad) if now[0] >= first else grad)
    if args.zero:  # each rank steps its shard, then the wrapper broadcasts every shard from its owner
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        now[0] = step
        ids = batch(step, rank).to(device)
        loss = model(ids, labels=ids)["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print("done", flush=True)


if __name__ == "__main__":
    main()
