"""transformers' `generate` measured the way `cockpit generate --bench` and `cockpit generate
--prompts FILE --samples N` measure cockpit's batched generation, on the same model directory.

Usage (GPU machine with PyTorch + transformers, no internet needed):

    python3 benches/generate_reference.py --model DIR --prompts-out prompts.jsonl --json hf.json

1. Throughput: random prompts of --prompt-len ids, batches of --batches rows, --max-new new tokens
   each (sampling: --temperature/--top-k/--top-p, every row to the end), tokens/s and the time to
   the first token (a generate of one new token).
2. The polychromic shape: --n-prompts prompts × --samples samples of --sample-tokens tokens, then
   each sample's embedding (the model's final hidden states mean-pooled over its new tokens, one
   forward) and the mean pairwise cosine distance of each prompt's samples (one normalized bmm):
   the wall time of it all. The prompts go to --prompts-out as JSON Lines ({"prompt_ids": [...]})
   for `cockpit generate --prompts` to run the same ones.
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--n-prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--sample-tokens", type=int, default=256)
    ap.add_argument("--prompts-out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype))
    model = model.to(a.device).eval()
    sync()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    sampling = dict(do_sample=True, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    result = {"load_s": load_s, "throughput": [], "torch": torch.__version__}
    print(f"load {load_s:.2f} s")

    def generate(ids, new):
        mask = torch.ones_like(ids)
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
            **sampling,
        )

    with torch.inference_mode():
        if not a.skip_throughput:
            generate(torch.randint(0, vocab, (1, a.prompt_len), device=a.device), 4)  # warm-up
            for b in [int(x) for x in a.batches.split(",")]:
                ids = torch.randint(0, vocab, (b, a.prompt_len), device=a.device)
                _, first = timed(lambda: generate(ids, 1))
                out, secs = timed(lambda: generate(ids, a.max_new))
                new = (out.shape[1] - a.prompt_len) * b
                row = {
                    "batch": b,
                    "new_tokens": new,
                    "seconds": secs,
                    "tokens_per_s": new / secs,
                    "first_token_ms": first * 1e3,
                }
                result["throughput"].append(row)
                print(json.dumps(row))

        # The polychromic shape.
        prompts = torch.randint(0, vocab, (a.n_prompts, a.prompt_len), device=a.device)
        if a.prompts_out:
            with open(a.prompts_out, "w") as f:
                for p in prompts.tolist():
                    f.write(json.dumps({"prompt_ids": p}) + "\n")

        def polychromic():
            rows = prompts.repeat_interleave(a.samples, dim=0)
            out = generate(rows, a.sample_tokens)
            hidden = model(input_ids=out, output_hidden_states=True).hidden_states[-1]
            # The final hidden states at the new tokens' positions, mean-pooled.
            emb = hidden[:, a.prompt_len :].float().mean(dim=1).view(a.n_prompts, a.samples, -1)
            unit = torch.nn.functional.normalize(emb, dim=-1)
            sim = torch.bmm(unit, unit.transpose(1, 2))
            n = a.samples
            off = (sim.sum(dim=(1, 2)) - sim.diagonal(dim1=1, dim2=2).sum(-1)) / (n * (n - 1))
            return (1 - off).tolist(), out.shape[1] - a.prompt_len

        (dist, new), secs = timed(polychromic)
        row = {
            "prompts": a.n_prompts,
            "samples": a.samples,
            "sample_tokens": new,
            "seconds": secs,
            "tokens_per_s": a.n_prompts * a.samples * new / secs,
            "mean_cosine_distance": sum(dist) / len(dist),
        }
        result["polychromic"] = row
        print(json.dumps(row))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
