"""Train a tiny byte-level language model with ZeRO-2 and the quantized weight gather.

    torchrun --nproc_per_node=2 examples/train_tiny.py            # CPU, gloo
    torchrun --nproc_per_node=2 examples/train_tiny.py --no-quant # the plain gather
    torchrun --nproc_per_node=4 examples/train_tiny.py --int4 --ranks-per-node 2  # 2 pseudo-nodes of 2

``--int4``: INT4 weight differences and INT4 gradients, the lowest-bit mode. On several nodes
the collectives are two-level by default; ``--ranks-per-node`` declares nodes on one host
(docs/multi-node.md). Rank 0 prints the topology and, at the end, the bits per parameter one
node sent across the network in the last step.

The text is this Python's own standard library sources (offline, the same on every
machine); each rank reads its slice of every global batch.
"""

import argparse
import functools
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import qzero
from qzero.app.workload import load_corpus


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=256, d=128, layers=2, heads=4, seq=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        torch.nn.init.normal_(self.emb.weight, std=0.02)
        self.mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask.to(x.dtype)[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        return self.norm(x) @ self.emb.weight.T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--no-quant", action="store_true")
    ap.add_argument("--int4", action="store_true", help="INT4 weight differences and INT4 gradients")
    ap.add_argument("--ranks-per-node", type=int, default=0, help="0: detect the nodes from the hosts")
    args = ap.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = TinyLM(seq=args.seq).to(device=device, dtype=torch.bfloat16)
    lowbit = dict(zero_quantized_weights_delta=True, zero_quantized_gradients=True,
                  zero_quantized_gradients_format="int4") if args.int4 else {}
    config = qzero.ZeroConfig(stage=2, zero_quantized_weights=not args.no_quant, small_param_numel=4096,
                              ranks_per_node=args.ranks_per_node, **lowbit)
    opt = qzero.ZeroOptimizer(model, functools.partial(torch.optim.AdamW, lr=1e-3), config=config)
    if rank == 0:
        print(f"topology: {opt.topology.describe()}", flush=True)

    data = load_corpus(limit=2_000_000)  # the stdlib sources, byte tokens (qzero.app.workload)
    g = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        t0 = time.perf_counter()
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=g)
        local = starts.chunk(world)[rank]
        x = torch.stack([data[s : s + args.seq] for s in local]).to(device)
        y = torch.stack([data[s + 1 : s + args.seq + 1] for s in local]).to(device)
        loss = F.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            s = opt.last_gather[0]
            print(f"step {step:3d}  loss {loss.item():.4f}  {1e3 * (time.perf_counter() - t0):6.1f} ms  "
                  f"gather {s.bytes_sent / 1e6:.2f} MB/rank ({s.ratio:.2f} of plain)", flush=True)
    if rank == 0 and opt.topology.nodes > 1:
        print(f"across the network: {opt.network_bits_per_param():.2f} bits per parameter per node in the last step",
              flush=True)
    dist.barrier()  # every rank done before any leaves: a rank that exits first can abort another's exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
