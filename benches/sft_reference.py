"""Instruction-tuning reference: transformers + PEFT LoRA on a chat JSONL, padded batches.

The baseline of cockpit's SFT speed target: the same chat records cockpit trains on
(`data.format = "messages"`, ChatML rendering as tests/fixtures/chat/qwen.jinja writes it, a
byte-level tokenizer: one token per UTF-8 byte, as cockpit's `data.tokenizer = "byte"`), the loss
on the assistant turns only (labels -100 elsewhere), batches padded to their longest sample, as a
plain `Trainer`-style loop does. The model is a Llama of the shape given (random bf16 weights),
LoRA r16 on every linear layer (PEFT). Reports real (non-padding) tokens/s and trained tokens/s.

Usage (GPU machine with torch, transformers, peft; no internet needed):

    python3 benches/sft_reference.py --make-data chat.jsonl --records 4000
    python3 benches/sft_reference.py --data chat.jsonl --batch 8 --steps 20 --json out.json
    python3 benches/sft_reference.py --family qwen3 --layers 28 --width 2048 --heads 16 \
        --kv-heads 8 --mlp 6144 --vocab 151936 --lm 2048 --batch 4   # plain LM, Qwen3-1.7B shape
    python3 benches/sft_reference.py --family granitemoehybrid --layers 40 --width 1536 --heads 12 \
        --kv-heads 4 --mlp 4096 --vocab 100352 --lm 2048 --batch 4   # Granite-4.0-H-1B shape

`--family granitemoehybrid` is transformers' Granite 4.0 hybrid: Mamba-2 layers (`--mamba-*`) with
NoPE attention at `--attention-layers`, a dense shared SwiGLU MLP of `--mlp` in every layer, the
Granite multipliers, LoRA on q/k/v/o, Mamba's in_proj/out_proj and the shared MLP's
input_linear/output_linear. Its Mamba layers run the mamba_ssm / causal_conv1d kernels only where
those packages import; otherwise transformers' PyTorch scan, and the script says which.

`--make-data` writes synthetic conversations (a system turn in some, user and assistant turns of
varied lengths) that both systems then read.
"""

import argparse
import json
import random
import time


def make_data(path, records, seed=0):
    rng = random.Random(seed)
    words = ("the of and to in is was for on that with as by at from his an were are which this "
             "be or has had not but what all when we there can more if no out so said up one about "
             "into than them only other new some could time these two may first then do any like").split()

    def text(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    with open(path, "w") as f:
        for i in range(records):
            m = []
            if i % 3 == 0:
                m.append({"role": "system", "content": text(5, 30)})
            for _ in range(rng.choice([1, 1, 2])):
                m.append({"role": "user", "content": text(10, 120)})
                m.append({"role": "assistant", "content": text(20, 250)})
            f.write(json.dumps({"messages": m}) + "\n")


def render(messages):
    """ChatML as qwen.jinja renders it, split into (bytes, trains) pieces."""
    out = []
    for m in messages:
        head = f"<|im_start|>{m['role']}\n"
        if m["role"] == "assistant":
            out.append((head.encode(), False))
            out.append((m["content"].encode() + b"<|im_end|>", True))
            out.append((b"\n", False))
        else:
            out.append((head.encode() + m["content"].encode() + b"<|im_end|>\n", False))
    return out


def samples(path, max_len):
    res = []
    with open(path) as f:
        for line in f:
            ids, labels = [], []
            for b, trains in render(json.loads(line)["messages"]):
                ids.extend(b)
                labels.extend(b if trains else [-100] * len(b))
            # Next-token targets: the label of position i is the token at i + 1.
            ids, labels = ids[: max_len + 1], labels[: max_len + 1]
            res.append((ids[:-1], labels[1:]))
    return res


def build(a, transformers, peft):
    """The model of the shape and family in `a`, bf16, PEFT's LoRA r16 attached, on the CPU."""
    import torch

    common = dict(
        hidden_size=a.width, intermediate_size=a.mlp, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
        max_position_embeddings=max(a.max_len, a.lm, 2048), tie_word_embeddings=True)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if a.family == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=a.head_dim or 128, rope_theta=1e6,
                                       rms_norm_eps=1e-6)
        cls = transformers.Qwen3ForCausalLM
    elif a.family == "gemma3":
        cfg = transformers.Gemma3TextConfig(**common, head_dim=a.head_dim or 256,
                                            query_pre_attn_scalar=256, sliding_window=512,
                                            rms_norm_eps=1e-6)
        cls = transformers.Gemma3ForCausalLM
    elif a.family == "granitemoehybrid":
        attn = sorted({int(i) for i in a.attention_layers.split(",") if i.strip()})
        if any(i < 0 or i >= a.layers for i in attn):
            raise SystemExit(f"--attention-layers {a.attention_layers}: outside 0..{a.layers - 1}")
        inner = a.mamba_heads * a.mamba_head_dim
        if inner % a.width:
            raise SystemExit(f"transformers' GraniteMoeHybrid needs --mamba-heads x "
                             f"--mamba-head-dim ({inner}) to be a whole multiple (mamba_expand) "
                             f"of --width ({a.width})")
        # (intermediate_size is the routed experts' width: none here, so it is the shared MLP's,
        # as in the published config). use_cache off: a training forward with a cache records
        # every Mamba layer's conv and scan states and keeps mamba_ssm's training path out.
        cfg = transformers.GraniteMoeHybridConfig(
            **common, shared_intermediate_size=a.mlp, num_local_experts=0, num_experts_per_tok=0,
            use_cache=False,
            layer_types=["attention" if i in attn else "mamba" for i in range(a.layers)],
            position_embedding_type="nope", rms_norm_eps=1e-5,
            mamba_n_heads=a.mamba_heads, mamba_d_head=a.mamba_head_dim,
            mamba_d_state=a.mamba_state, mamba_n_groups=a.mamba_groups,
            mamba_d_conv=a.mamba_conv, mamba_chunk_size=a.mamba_chunk,
            mamba_expand=inner // a.width, mamba_conv_bias=True, mamba_proj_bias=False,
            embedding_multiplier=a.embedding_multiplier,
            attention_multiplier=a.attention_multiplier,
            residual_multiplier=a.residual_multiplier, logits_scaling=a.logits_scaling)
        cls = transformers.GraniteMoeHybridForCausalLM
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj",
                   "input_linear", "output_linear"]
    else:
        cfg = transformers.LlamaConfig(**common, head_dim=a.head_dim or a.width // a.heads,
                                       rope_theta=500000.0, rms_norm_eps=1e-5)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = a.attn
    model = cls(cfg).to(torch.bfloat16)
    if a.grad_ckpt:
        # every decoder layer's forward again in the backward (non-reentrant), as cockpit's
        # model.recompute = "full"
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lcfg = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets)
    return peft.get_peft_model(model, lcfg)


def mamba_kernels(fused):
    """Which code the Mamba-2 layers of transformers' GraniteMoeHybrid will run, in words.

    transformers takes mamba_ssm's and causal_conv1d's kernels where those packages import
    (the same look-up as here) and falls back to its PyTorch reference scan otherwise. In training,
    with mamba_ssm, it first tries mamba_ssm's fused kernel, which applies out_proj.weight itself
    and so bypasses a PEFT adapter on out_proj: unless `fused`, that fused call is switched off
    (the layer then takes its unfused path: conv, chunked scan, gated norm, out_proj as a module).
    """
    import importlib

    def has(module, name):
        try:
            return getattr(importlib.import_module(module), name, None) is not None
        except Exception:
            return False

    ssm = has("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    conv = has("causal_conv1d", "causal_conv1d_fn")
    import transformers.models.granitemoehybrid.modeling_granitemoehybrid as mod

    if ssm and not fused:
        if hasattr(mod, "mamba2_split_conv1d_scan_combined"):
            # the layer treats None as "no fused kernel" and goes on unfused
            mod.mamba2_split_conv1d_scan_combined = lambda *args, **kwargs: None
        else:
            print("warning: this transformers has no switch for mamba_ssm's fused training "
                  "kernel: PEFT's out_proj adapter gets no effect and no gradient", flush=True)
    print(f"mamba_ssm importable: {'yes' if ssm else 'NO'}; "
          f"causal_conv1d importable: {'yes' if conv else 'NO'}", flush=True)
    if not ssm and not conv:
        return "transformers' PyTorch scan (no mamba_ssm, no causal_conv1d: NOT a kernel baseline)"
    parts = ["mamba_ssm " + ("fused conv+scan+out_proj kernel (out_proj adapter bypassed)"
                             if fused else "chunked-scan kernel") if ssm
             else "PyTorch chunked scan (no mamba_ssm)",
             "causal_conv1d kernel" if conv else "PyTorch conv (no causal_conv1d)"]
    return ", ".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--make-data", default=None)
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--data", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--mlp", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--family", choices=["llama", "qwen3", "gemma3", "granitemoehybrid"],
                    default="llama",
                    help="qwen3: QK-norm per head, --head-dim (default 128), rope θ 1e6; "
                         "gemma3: Gemma 3's text model (head dim 256, 5 sliding layers of "
                         "512 a full one, transformers' defaults for the rest); "
                         "granitemoehybrid: Granite 4.0 hybrid (Mamba-2 + NoPE attention at "
                         "--attention-layers, shared MLP of --mlp, no routed experts)")
    # granitemoehybrid only; the defaults are granite-4.0-h-1b's published config.json
    ap.add_argument("--mamba-heads", type=int, default=48)
    ap.add_argument("--mamba-head-dim", type=int, default=64)
    ap.add_argument("--mamba-state", type=int, default=128)
    ap.add_argument("--mamba-groups", type=int, default=1)
    ap.add_argument("--mamba-conv", type=int, default=4)
    ap.add_argument("--mamba-chunk", type=int, default=256)
    ap.add_argument("--attention-layers", default="5,15,25,35",
                    help="comma-separated indices of the attention layers; the rest are Mamba-2")
    ap.add_argument("--embedding-multiplier", type=float, default=12.0)
    ap.add_argument("--attention-multiplier", type=float, default=0.0078125)
    ap.add_argument("--residual-multiplier", type=float, default=0.22)
    ap.add_argument("--logits-scaling", type=float, default=6.0)
    ap.add_argument("--mamba-fused", action="store_true",
                    help="let mamba_ssm's fused training kernel (mamba_split_conv1d_scan_combined) "
                         "run: it reads out_proj.weight itself, so PEFT's adapter on out_proj is "
                         "skipped (no effect, no gradient). Off: the unfused path, still on the "
                         "causal_conv1d and chunked-scan kernels where they import")
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--lm", type=int, default=0, metavar="T",
                    help="plain LM batches of random ids [batch, T] instead of the chat data")
    ap.add_argument("--grad-ckpt", action="store_true",
                    help="gradient checkpointing of every decoder layer (transformers' "
                         "gradient_checkpointing_enable, non-reentrant)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.make_data:
        make_data(a.make_data, a.records)
        print(f"wrote {a.records} conversations to {a.make_data}")
        return

    import torch
    import transformers
    import peft

    torch.manual_seed(0)
    mamba = None
    if a.family == "granitemoehybrid":
        mamba = mamba_kernels(a.mamba_fused)
        print(f"granitemoehybrid Mamba-2 layers: {mamba}", flush=True)
    model = build(a, transformers, peft).cuda()
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    data = samples(a.data, a.max_len) if not a.lm else None
    if data:
        random.Random(1).shuffle(data)

    def batch(k):
        if a.lm:
            ids = torch.randint(0, a.vocab, (a.batch, a.lm + 1), device="cuda")
            n = a.batch * a.lm
            return ids[:, :-1], ids[:, 1:], None, n, n
        rows = [data[(k * a.batch + i) % len(data)] for i in range(a.batch)]
        n = max(len(x) for x, _ in rows)
        ids = torch.zeros(a.batch, n, dtype=torch.long)
        lab = torch.full((a.batch, n), -100, dtype=torch.long)
        att = torch.zeros(a.batch, n, dtype=torch.long)
        real = trained = 0
        for i, (x, y) in enumerate(rows):
            ids[i, : len(x)] = torch.tensor(x)
            lab[i, : len(y)] = torch.tensor(y)
            att[i, : len(x)] = 1
            real += len(x)
            trained += sum(1 for v in y if v != -100)
        return ids.cuda(), lab.cuda(), att.cuda(), real, trained

    model.train()
    try:
        times, reals, trains = run_steps(a, model, opt, batch)
    except torch.cuda.OutOfMemoryError as e:
        # (a search for the longest T that fits reads this line)
        print(json.dumps({"oom": True, "lm": a.lm, "batch": a.batch,
                          "error": str(e).splitlines()[0]}))
        return
    report(a, transformers, peft, mamba, times, reals, trains)


def run_steps(a, model, opt, batch):
    import torch

    times, reals, trains = [], [], []
    for k in range(a.warmup + a.steps):
        ids, lab, att, real, trained = batch(k)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if a.lm:
                # (labels already shifted: the loss over logits and the next ids)
                logits = model(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.size(-1)), lab.reshape(-1))
            else:
                loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if k >= a.warmup:
            times.append(time.perf_counter() - t0)
            reals.append(real)
            trains.append(trained)
    return times, reals, trains


def report(a, transformers, peft, mamba, times, reals, trains):
    import torch

    total = sum(times)
    res = {
        "system": f"transformers {transformers.__version__} + peft {peft.__version__} "
                  f"({a.family}, {a.attn}, {'LM T' + str(a.lm) if a.lm else 'chat, padded'}"
                  f"{', Mamba-2: ' + mamba if mamba else ''}"
                  f"{', gradient checkpointing' if a.grad_ckpt else ''})",
        "real_tok_s": sum(reals) / total,
        "trained_tok_s": sum(trains) / total,
        "step_ms": 1000 * total / len(times),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
        "batch": a.batch,
    }
    if mamba:
        res["mamba_kernels"] = mamba
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
