"""PyTorch reference benchmark for cockpit's training step, built from a cockpit config.

This is the baseline that `cockpit bench CONFIG` is measured against: the model the config
describes (GPT-2 or Llama family: LayerNorm or RMSNorm, GELU-tanh or SwiGLU MLP, biases or not,
grouped-query attention, learned positions or RoPE, tied or untied head, dropout), cockpit's init
and AdamW groups, trained on random token ids that live on the GPU, so that only the training step
itself (forward, backward, clip, optimizer) is timed. Keys the config leaves out take the defaults
of configs/tiny.toml, and `model.arch = "llama"` its family's defaults, as in cockpit.

Usage (GPU machine with PyTorch 2.5+ + CUDA, no internet needed):

    python3 benches/torch_reference.py --config configs/gpt2-small.toml --mode compile --json out.json
    torchrun --nproc_per_node 2 benches/torch_reference.py --mode compile   # DDP over 2 GPUs
    python3 benches/torch_reference.py --config configs/llama-small.toml --mode eager --batch 8
    python3 benches/torch_reference.py --set model.dropout=0.2 --set model.bias=false --mode compile
    python3 benches/torch_reference.py --config configs/llama-small.toml --set lora.enabled=true \
        --set lora.r=16 --set 'lora.targets=["q","v"]' --mode compile

With `lora.enabled` the base is frozen in bf16 (no gradient, no optimizer state) and fp32
adapters train on the config's `lora.targets` (`y += alpha/r · (x·Aᵀ)·Bᵀ`, B from zero), as a
compiled PEFT-style LoRA would.

Modes: `eager` and `compile` use F.scaled_dot_product_attention(is_causal=True, enable_gqa for
grouped-query attention); `compile` wraps the model (forward + loss) in torch.compile;
`eager-naive` spells attention out as softmax(QK^T / sqrt(d) + causal mask) V, the closest
analogue of an unfused implementation.
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import time
import tomllib

import torch
import torch.nn as nn
import torch.utils.checkpoint
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
CLIP = 1.0


def load_config(path, overrides):
    """The config as cockpit resolves it: tiny.toml's defaults, the file, `--set` overrides,
    then the arch's family defaults for the model keys left out."""
    with open(os.path.join(HERE, "..", "configs", "tiny.toml"), "rb") as f:
        cfg = tomllib.load(f)
    with open(path, "rb") as f:
        given = tomllib.load(f)
    for arg in overrides:
        key, raw = arg.split("=", 1)
        section, name = key.strip().split(".", 1)
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        given.setdefault(section, {})[name] = value
    for section, table in given.items():
        cfg.setdefault(section, {}).update(table)
    m = cfg["model"]
    if m["arch"] == "llama":
        family = {"norm": "rmsnorm", "pos": "rope", "activation": "swiglu", "bias": False,
                  "tie_embeddings": False}
        for k, v in family.items():
            if k not in given.get("model", {}):
                m[k] = v
    return cfg


class Norm(nn.Module):
    def __init__(self, m):
        super().__init__()
        d, eps = m["n_embd"], m["norm_eps"]
        if m["norm"] == "rmsnorm":
            self.norm = nn.RMSNorm(d, eps=eps)
        else:
            self.norm = nn.LayerNorm(d, eps=eps, bias=m["bias"])

    def forward(self, x):
        return self.norm(x)


def rope_tables(m, t, device):  # (rope_scaling only changes the values, not the cost)
    hd = m["n_embd"] // m["n_head"]
    inv = 1.0 / (m["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def rotate(x, cos, sin):
    # the two halves of each head (the Llama/NeoX layout), as cockpit
    h = x.size(-1) // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos.to(x.dtype) + rot * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, m, naive):
        super().__init__()
        self.h, self.kv = m["n_head"], m["n_kv_head"] or m["n_head"]
        self.hd = m["n_embd"] // self.h
        d, bias = m["n_embd"], m["bias"]
        self.qkv = nn.Linear(d, (self.h + 2 * self.kv) * self.hd, bias=bias)
        self.proj = nn.Linear(d, d, bias=bias)
        self.proj.residual = True
        self.naive, self.p = naive, m["dropout"]

    def forward(self, x, rope):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], 2)
        q = q.view(b, t, self.h, self.hd).transpose(1, 2)
        k = k.view(b, t, self.kv, self.hd).transpose(1, 2)
        v = v.view(b, t, self.kv, self.hd).transpose(1, 2)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        p = self.p if self.training else 0.0
        if self.naive:
            if self.kv != self.h:
                k = k.repeat_interleave(self.h // self.kv, dim=1)
                v = v.repeat_interleave(self.h // self.kv, dim=1)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            att = F.dropout(att.masked_fill(~mask, float("-inf")).softmax(dim=-1), p)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                               enable_gqa=self.kv != self.h)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, m, naive):
        super().__init__()
        d, bias = m["n_embd"], m["bias"]
        hidden = max(1, round(d * m["mlp_ratio"]))
        self.ln1, self.ln2 = Norm(m), Norm(m)
        self.attn = Attention(m, naive)
        self.swiglu = m["activation"] == "swiglu"
        # SwiGLU: gate and up as one matmul (as cockpit's fast step does)
        self.up = nn.Linear(d, (2 if self.swiglu else 1) * hidden, bias=bias)
        self.down = nn.Linear(hidden, d, bias=bias)
        self.down.residual = True
        self.drop = nn.Dropout(m["dropout"])

    def forward(self, x, rope):
        x = x + self.drop(self.attn(self.ln1(x), rope))
        u = self.up(self.ln2(x))
        if self.swiglu:
            g, u = u.chunk(2, dim=-1)
            a = F.silu(g) * u
        else:
            a = F.gelu(u, approximate="tanh")
        return x + self.drop(self.down(a))


class GPT(nn.Module):
    def __init__(self, m, vocab, naive=False):
        super().__init__()
        d, std = m["n_embd"], m["init_std"]
        self.m, self.vocab = m, vocab
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(m["seq_len"], d) if m["pos"] == "learned" else None
        self.blocks = nn.ModuleList(Block(m, naive) for _ in range(m["n_layer"]))
        self.ln_f = Norm(m)
        self.head = nn.Linear(d, vocab, bias=False)
        self.drop = nn.Dropout(m["dropout"])
        if m["tie_embeddings"]:
            self.head.weight = self.wte.weight  # tied: one tensor, counted once by parameters()
        resid_std = std / math.sqrt(2 * m["n_layer"])
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                if mod is self.head and m["tie_embeddings"]:
                    continue
                s = resid_std if getattr(mod, "residual", False) else std
                s = s / 2 if mod is self.wpe else s
                nn.init.normal_(mod.weight, mean=0.0, std=s)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)
        self.rope = None

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.wte(idx)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(t, device=idx.device))
        else:
            if self.rope is None or self.rope[0].size(0) < t:
                self.rope = rope_tables(self.m, t, idx.device)
            rope = (self.rope[0][:t], self.rope[1][:t])
        x = self.drop(x)
        # model.recompute = "full": every block's forward again in the backward (activation
        # checkpointing), as cockpit's step does; "attention" has no torch analogue here.
        ckpt = self.training and self.m.get("recompute", "none") == "full"
        for block in self.blocks:
            if ckpt:
                x = torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.view(-1))


class LoRALinear(nn.Module):
    """A frozen linear layer plus LoRA adapters on column slices of its (packed) output.

    The adapters of all adapted slices act as one pair of matmuls: A stacks every slice's
    A [k·r, in]; B is a dense [out, k·r] matrix masked to the block each slice owns (the
    entries outside the blocks get a zero gradient and stay zero), so the delta is exactly
    Σ_slices scale·(x·A_sᵀ)·B_sᵀ written into its columns, with nothing concatenated per step.
    """

    def __init__(self, base, slices, r, alpha):
        super().__init__()
        self.base, self.scale = base, alpha / r
        adapted = [(col, width) for col, width, on in slices if on]
        a = torch.empty(len(adapted) * r, base.in_features)
        for k in range(len(adapted)):
            nn.init.normal_(a[k * r:(k + 1) * r], std=1.0 / math.sqrt(base.in_features))
        self.a = nn.Parameter(a)
        self.b = nn.Parameter(torch.zeros(base.out_features, len(adapted) * r))
        mask = torch.zeros(base.out_features, len(adapted) * r)
        for k, (col, width) in enumerate(adapted):
            mask[col:col + width, k * r:(k + 1) * r] = 1.0
        self.register_buffer("mask", mask)

    def forward(self, x):
        return self.base(x) + ((x @ self.a.t()) @ (self.b * self.mask).t()) * self.scale


def add_lora(model, lcfg):
    """Freeze the base in bf16 and put adapters on the configured projections."""
    for p in model.parameters():
        p.requires_grad_(False)
        p.data = p.data.to(torch.bfloat16)
    targets, r, alpha = set(lcfg["targets"]), lcfg["r"], lcfg["alpha"]
    for blk in model.blocks:
        at = blk.attn
        q, kv = at.h * at.hd, at.kv * at.hd
        qkv = [(0, q, "q" in targets), (q, kv, "k" in targets), (q + kv, kv, "v" in targets)]
        if any(s[2] for s in qkv):
            at.qkv = LoRALinear(at.qkv, qkv, r, alpha)
        if "o" in targets:
            at.proj = LoRALinear(at.proj, [(0, at.proj.out_features, True)], r, alpha)
        hidden = blk.down.in_features
        up = ([(0, hidden, "gate" in targets), (hidden, hidden, "up" in targets)]
              if blk.swiglu else [(0, hidden, "up" in targets)])
        if any(s[2] for s in up):
            blk.up = LoRALinear(blk.up, up, r, alpha)
        if "down" in targets:
            blk.down = LoRALinear(blk.down, [(0, blk.down.out_features, True)], r, alpha)


def make_optimizer(model, o):
    # Decay only the Linear weight matrices, as cockpit does by default (Matrix params decay;
    # embeddings, norms and biases do not: optim.decay_embeddings = false). The tied wte/head
    # tensor is an embedding, so it is not decayed; an untied head is a matrix and is.
    emb = {id(model.wte.weight)} | ({id(model.wpe.weight)} if model.wpe is not None else set())
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    decay = [p for p in params if p.dim() == 2 and id(p) not in emb]
    rest = [p for p in params if p.dim() != 2 or id(p) in emb]
    groups = [{"params": decay, "weight_decay": o["weight_decay"]},
              {"params": rest, "weight_decay": 0.0}]
    kw = dict(lr=o["lr"], betas=(o["beta1"], o["beta2"]), eps=o["eps"])
    try:
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (TypeError, RuntimeError):
        return torch.optim.AdamW(groups, **kw)


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


def print_profile(train_step, first, steps, top=30):
    """GPU time per step of each kernel over `steps` more steps, most first, and the total."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            train_step(first - 1 - i % 2)  # any slice of the drawn tokens
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us, n = kernels.get(ev.name, (0.0, 0))
            kernels[ev.name] = (us + ev.device_time_total, n + 1)
    busy = sum(us for us, _ in kernels.values()) / steps / 1e3
    print(f"profile: {busy:.2f} ms of GPU time a step over {steps} steps")
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {us / steps / 1e3:8.3f} ms  {n / steps:6.1f}x  {name[:110]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(HERE, "..", "configs", "gpt2-small.toml"))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key, as cockpit's --set")
    ap.add_argument("--mode", choices=["eager", "compile", "eager-naive"], default="eager")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=None, help="default: optim.micro_batch")
    ap.add_argument("--seq", type=int, default=None, help="default: model.seq_len")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--json", default=None, help="write the results as a JSON object here")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="after timing, profile this many steps and print the GPU time per step "
                    "of the kernels that take the most (what `cockpit bench --profile` reports)")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    # Launched by torchrun with several processes: DistributedDataParallel over NCCL (buckets
    # all-reduced during the backward), each rank its own micro-batch; tokens/s is the job's.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl")
    cfg = load_config(args.config, args.set)
    m = cfg["model"]
    args.batch = args.batch or cfg["optim"]["micro_batch"]
    args.seq = args.seq or m["seq_len"]
    assert 1 <= args.seq <= m["seq_len"], f"--seq must be in 1..{m['seq_len']}"
    assert args.steps >= 2, "--steps must be at least 2"
    assert cfg["data"]["source"] == "builtin", "the reference draws random ids: builtin data only"
    data_vocab = cfg["data"]["builtin_vocab"]
    vocab = m["vocab_size"] or data_vocab

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    b, t = args.batch, args.seq

    with dev:  # weights drawn on the GPU: an 8B base in seconds, not minutes on the host
        model = GPT(m, vocab, naive=args.mode == "eager-naive")
    n_params = sum(p.numel() for p in model.parameters())  # shared wte/head counted once
    lora = cfg["lora"]["enabled"]
    if lora:
        add_lora(model, cfg["lora"])
    model = model.to(dev)
    opt = make_optimizer(model, cfg["optim"])
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    step_model = torch.compile(model) if args.mode == "compile" else model
    if args.dtype == "bf16":
        autocast = lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext

    # All tokens generated once on the GPU; each step takes a fresh contiguous slice.
    total = args.warmup + args.steps
    torch.manual_seed(1 + rank)  # each rank its own data
    tokens = torch.randint(0, data_vocab, (total * b * t + 1,), device=dev)

    def batch(i):
        s = i * b * t
        return tokens[s : s + b * t].view(b, t), tokens[s + 1 : s + 1 + b * t].view(b, t)

    def train_step(i):
        x, y = batch(i)
        with autocast():
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP)
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
    if world > 1:  # the job's step is its slowest rank's
        m_t = torch.tensor([median], device=dev)
        torch.distributed.all_reduce(m_t, op=torch.distributed.ReduceOp.MAX)
        median = m_t.item()
        if rank != 0:
            torch.distributed.destroy_process_group()
            return
        model = model.module
    tok_s = world * b * t / median
    # PaLM-style FLOPs per token: 6N for the weight matmuls (fwd + bwd) plus 12·L·d·T for the
    # attention scores and values. The causal half is NOT discounted (as in PaLM / nanoGPT), so
    # this matches the convention cockpit's bench reports, not the FLOPs actually executed.
    # (cockpit counts the matmul weights and a tied head once more as the head's matmul.)
    mats = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wpe" not in n
               and "wte" not in n)  # (with LoRA: the base and the adapters, as cockpit counts)
    head = vocab * m["n_embd"] if m["tie_embeddings"] else 0
    flops_per_token = 6 * (mats + head) + 12 * m["n_layer"] * m["n_embd"] * t
    name = torch.cuda.get_device_name(dev)
    peak = peak_flops(name, args.dtype)
    if peak is None:
        print(f"unknown peak for {name!r}: MFU not reported")
    mfu = flops_per_token * tok_s / (peak * world) if peak else None
    peak_mem = torch.cuda.max_memory_allocated(dev) / 1e9
    # What the device has in use (total − free: the CUDA context, the caching allocator's
    # reserve, library workspaces), the way `cockpit bench` reports its peak.
    free, total_mem = torch.cuda.mem_get_info(dev)
    device_mem = (total_mem - free) / 1e9

    system = f"torch-{args.mode}" + ("-lora" if lora else "") + (f"-ddp{world}" if world > 1 else "")
    print(f"model: {os.path.basename(args.config)} {' '.join(args.set)} | {n_params / 1e6:.1f}M params")
    mfu_s = f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a"
    print(
        f"{system} | {1e3 * median:.1f} ms/step | {tok_s / 1e3:.0f}k tok/s | {mfu_s} | "
        f"peak {peak_mem:.1f} GB allocated, {device_mem:.1f} GB in use on the device | "
        f"loss {loss_first:.2f} -> {loss_last:.2f}"
    )
    if args.profile > 0:
        print_profile(train_step, total, args.profile)
    if args.json:
        result = {
            "system": system, "device": name, "dtype": args.dtype, "batch": b, "seq": t,
            "params": n_params, "ms_per_step_median": 1e3 * median, "tokens_per_sec": tok_s,
            "mfu": mfu, "peak_mem_gb": peak_mem, "device_mem_gb": device_mem, "loss_first": loss_first, "loss_last": loss_last,
            "steps": args.steps, "warmup": args.warmup, "torch_version": torch.__version__,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
