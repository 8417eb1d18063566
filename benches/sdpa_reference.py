"""PyTorch's causal attention alone, per SDPA backend: forward and backward TFLOP/s.

The attention rows of `cockpit bench --profile` ("flash attention: forward N TFLOP/s, backward
M") measured on PyTorch's side: `F.scaled_dot_product_attention(is_causal=True)` on bf16 tensors
of one sequence, with the backend PyTorch picks by itself and with each backend forced, FLOPs
counted as cockpit counts them (causal pairs only, 4·T²·D·H / 2 forward, the backward 2.5× that).
It then names the kernels PyTorch ran (torch.profiler), which says whose attention
`benches/torch_reference.py --mode compile` trains with.

Usage (GPU machine with PyTorch 2.5+, no internet needed):

    python3 benches/sdpa_reference.py                       # T 16384 and 32768 at head dim 64, 16384 at 128
    python3 benches/sdpa_reference.py --shape 32768,12,64   # T, heads, head dim
"""

import argparse
import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def run(t, h, d, backend, reps):
    q, k, v = (
        torch.randn(1, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    do = torch.randn(1, h, t, d, device="cuda", dtype=torch.bfloat16)
    flops = 4 * t * t * d * h / 2
    ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
    with ctx:
        for _ in range(3):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        tf = tb = 0.0
        for _ in range(reps):
            ev[0].record()
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            ev[1].record()
            o.backward(do)
            ev[2].record()
            torch.cuda.synchronize()
            tf += ev[0].elapsed_time(ev[1])
            tb += ev[1].elapsed_time(ev[2])
    tf, tb = tf / reps, tb / reps
    name = "default" if backend is None else backend.name
    print(
        f"T {t} heads {h} head dim {d} {name}: forward {tf:.3f} ms {flops / tf / 1e9:.0f} TFLOP/s, "
        f"backward {tb:.3f} ms {2.5 * flops / tb / 1e9:.0f} TFLOP/s",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", action="append", help="T,heads,head_dim (repeatable)")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape or []] or [
        (16384, 12, 64),
        (32768, 12, 64),
        (16384, 6, 128),
    ]
    torch.manual_seed(0)
    for t, h, d in shapes:
        for backend in [None, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]:
            try:
                run(t, h, d, backend, args.reps)
            except RuntimeError as e:  # a backend that does not take this shape or GPU
                print(f"T {t} head dim {d} {backend}: {str(e).splitlines()[0][:120]}", flush=True)
    t, h, d = shapes[0]
    q, k, v = (
        torch.randn(1, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if "sdpa" in e.key or "flash" in e.key}
    print("kernels:", ", ".join(sorted(names)) or "(none named sdpa or flash)")


if __name__ == "__main__":
    main()
