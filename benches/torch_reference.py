"""PyTorch reference benchmark for cockpit's GPT-2 small training step.

This is the baseline that `cockpit bench configs/gpt2-small.toml` is measured against: the
same model (GPT-2 small, 124M, tied embeddings, learned positions, LayerNorm with bias, GELU-tanh
MLP, no dropout), the same init and the same AdamW settings, trained on random token ids that live
on the GPU, so that only the training step itself (forward, backward, clip, optimizer) is timed.

Usage (GPU machine with PyTorch 2.x + CUDA, no internet needed):

    python3 benches/torch_reference.py --mode compile --json out.json
    python3 benches/torch_reference.py --mode eager --batch 8 --seq 1024 --dtype bf16
    python3 benches/torch_reference.py --mode eager-naive --steps 30 --warmup 5

Modes: `eager` and `compile` use F.scaled_dot_product_attention(is_causal=True); `compile` wraps
the model (forward + loss) in torch.compile; `eager-naive` spells attention out as
softmax(QK^T / sqrt(d) + causal mask) V, the closest analogue of an unfused implementation.
"""

import argparse
import contextlib
import json
import math
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# configs/gpt2-small.toml
VOCAB, N_LAYER, N_HEAD, N_EMBD, BLOCK, MLP_RATIO = 50304, 12, 12, 768, 1024, 4
DATA_VOCAB = 50257  # the builtin corpus draws ids below GPT-2's real vocabulary size
LR, BETAS, EPS, WD, CLIP, INIT_STD = 6e-4, (0.9, 0.95), 1e-8, 0.1, 1.0, 0.02


class Attention(nn.Module):
    def __init__(self, naive):
        super().__init__()
        self.qkv = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.proj = nn.Linear(N_EMBD, N_EMBD)
        self.proj.residual = True
        self.naive = naive

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2) for z in (q, k, v))
        if self.naive:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, naive):
        super().__init__()
        self.ln1 = nn.LayerNorm(N_EMBD, eps=1e-5)
        self.attn = Attention(naive)
        self.ln2 = nn.LayerNorm(N_EMBD, eps=1e-5)
        self.up = nn.Linear(N_EMBD, MLP_RATIO * N_EMBD)
        self.down = nn.Linear(MLP_RATIO * N_EMBD, N_EMBD)
        self.down.residual = True

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, naive=False):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.ModuleList(Block(naive) for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD, eps=1e-5)
        self.head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied: one tensor, counted once by parameters()
        resid_std = INIT_STD / math.sqrt(2 * N_LAYER)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) and m is not self.head:
                std = resid_std if getattr(m, "residual", False) else INIT_STD
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def make_optimizer(model):
    # Decay only the Linear weight matrices, as cockpit does by default (Matrix params decay;
    # embeddings, norms and biases do not: optim.decay_embeddings = false). The tied wte/head
    # tensor is an embedding, so it is not decayed.
    emb = {id(model.wte.weight), id(model.wpe.weight)}
    decay = [p for p in model.parameters() if p.dim() == 2 and id(p) not in emb]
    rest = [p for p in model.parameters() if p.dim() != 2 or id(p) in emb]
    groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    except (TypeError, RuntimeError):
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)


def peak_flops(name, dtype):
    """Dense tensor-core peak (bf16, or TF32 for fp32) from the device name; None if unknown."""
    n = name.upper()
    if "H100" in n:
        bf16 = 756e12 if "PCIE" in n else 989e12  # SXM / HBM3
    elif "H200" in n:
        bf16 = 989e12
    elif "A100" in n:
        bf16 = 312e12
    else:
        return None
    return bf16 if dtype == "bf16" else bf16 / 2  # dense TF32 is half the bf16 rate


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["eager", "compile", "eager-naive"], default="eager")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--json", default=None, help="write the results as a JSON object here")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    assert 1 <= args.seq <= BLOCK, f"--seq must be in 1..{BLOCK}"
    assert args.steps >= 2, "--steps must be at least 2"

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    dev = torch.device("cuda")
    b, t = args.batch, args.seq

    model = GPT(naive=args.mode == "eager-naive").to(dev)
    n_params = sum(p.numel() for p in model.parameters())  # shared wte/head counted once
    opt = make_optimizer(model)
    step_model = torch.compile(model) if args.mode == "compile" else model
    if args.dtype == "bf16":
        autocast = lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext

    # All tokens generated once on the GPU; each step takes a fresh contiguous slice.
    total = args.warmup + args.steps
    tokens = torch.randint(0, DATA_VOCAB, (total * b * t + 1,), device=dev)

    def batch(i):
        s = i * b * t
        return tokens[s : s + b * t].view(b, t), tokens[s + 1 : s + 1 + b * t].view(b, t)

    def train_step(i):
        x, y = batch(i)
        with autocast():
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()  # constant lr: the cosine schedule does not change the step's cost
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    model.train()
    times, loss_first, loss_last = [], None, None
    for i in range(total):
        if i == args.warmup:  # steady-state peak, not compile/autotune transients
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = train_step(i)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
        if i == 0:
            loss_first = loss.item()
        if i == total - 1:
            loss_last = loss.item()

    median = statistics.median(times[len(times) // 2 :])  # second half: past any late warm-up
    tok_s = b * t / median
    # PaLM-style FLOPs per token: 6N for the weight matmuls (fwd + bwd) plus 12·L·d·T for the
    # attention scores and values. The causal half is NOT discounted (as in PaLM / nanoGPT), so
    # this matches the convention cockpit's bench reports, not the FLOPs actually executed.
    flops_per_token = 6 * n_params + 12 * N_LAYER * N_EMBD * t
    name = torch.cuda.get_device_name(dev)
    peak = peak_flops(name, args.dtype)
    if peak is None:
        print(f"unknown peak for {name!r}: MFU not reported")
    mfu = flops_per_token * tok_s / peak if peak else None
    peak_mem = torch.cuda.max_memory_allocated(dev) / 1e9

    system = f"torch-{args.mode}"
    mfu_s = f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a"
    print(
        f"{system} | {1e3 * median:.1f} ms/step | {tok_s / 1e3:.0f}k tok/s | {mfu_s} | "
        f"peak {peak_mem:.1f} GB | loss {loss_first:.2f} -> {loss_last:.2f}"
    )
    if args.json:
        result = {
            "system": system, "device": name, "dtype": args.dtype, "batch": b, "seq": t,
            "params": n_params, "ms_per_step_median": 1e3 * median, "tokens_per_sec": tok_s,
            "mfu": mfu, "peak_mem_gb": peak_mem, "loss_first": loss_first, "loss_last": loss_last,
            "steps": args.steps, "warmup": args.warmup, "torch_version": torch.__version__,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
