"""Megatron-Core: a small GPT (2 layers, local transformer spec), tensor parallel over all ranks. Unmodified by trainscout.

Uses Megatron-Core's own parallel state, model and tensor-parallel layers; plain torch AdamW. NCCL on GPUs
(GPU machine), gloo on CPU.

    torchrun --nproc-per-node 2 examples/megatron_gpt_train.py --steps 20
"""

import argparse
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, pipeline_model_parallel_size=1)
    torch.manual_seed(0)
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=not cuda)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=args.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(0)  # one batch for the tensor-parallel group
    positions = torch.arange(args.seq, device=device).unsqueeze(0).expand(4, -1)
    causal = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device=device), diagonal=1).view(
        1, 1, args.seq, args.seq)  # True: masked out
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (4, args.seq), device=device, generator=gen)
        labels = torch.roll(tokens, -1, dims=1)
        loss = model(tokens, positions, causal, labels=labels).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {logged.item() / world:.4f}", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if rank == 0:
        print("done", os.getpid())


if __name__ == "__main__":
    main()
