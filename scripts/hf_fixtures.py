#!/usr/bin/env python3
"""Make the tiny Hugging Face models that cockpit's parity tests (tests/hf.rs) check against.

One directory per supported model_type under tests/fixtures/hf/: a model made and trained a few
dozen steps with transformers (so its predictions are sharp), saved with save_pretrained, a tiny
BPE tokenizer, and expected.json: the per-token log-probabilities of a fixed token sequence and
the greedy continuation of a prompt, computed by transformers in float32 on the CPU.

Needs torch, transformers and tokenizers (CI does not run this; the outputs are committed):
    python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors peft
    /tmp/hfvenv/bin/python scripts/hf_fixtures.py [OUT_DIR]

`--only NAME[,NAME…] [OUT_DIR]` remakes those fixtures alone.
`--check-export DIR [FIXTURE]` loads a directory written by `cockpit export` with
AutoModelForCausalLM and prints its loss and greedy tokens on the fixture's sequence, beside the
fixture's own; `--check-adapter ADAPTER_DIR BASE_DIR MERGED_DIR` loads an `export --adapter`
directory with PEFT on its base and compares its logits with the merged export (the round
trips CI cannot run: it has no torch).
"""
import json
import math
import os
import shutil
import sys

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

TEXT = """\
The quick brown fox jumps over the lazy dog. A cockpit shows the pilot what the machine is doing,
and a training cockpit shows the researcher what the model is doing. Loss goes down, the learning
rate follows its schedule, and the gradient norm stays bounded. When the loss spikes, the pilot
looks at the gauges first: the learning rate, the batch size, the precision, the data. Small
models learn small texts by heart; large models learn the world. Every number after a silent
mistake is meaningless, so the loader must fail loudly or be exact. The dog sleeps, the fox runs,
the model predicts the next token, and the cockpit draws the curve.
"""

VOCAB = 300
SEQ = 48
PROMPT = 8
NEW = 16


def make_tokenizer(out):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    path = os.path.join(out, "_tokenizer.json")
    tok.save(path)
    return path


def configs(vocab, bos, eos):
    common = dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos, max_position_embeddings=64)
    return {
        # Llama-2 layout: MHA, untied, theta 1e4; saved in f32 and sharded through an index.
        "llama2": ("f32", "shard", transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=False, **common)),
        # Llama-3.2 layout: GQA, tied, theta 5e5, llama3 rope_scaling, head_dim·heads ≠ hidden.
        "llama3": ("bf16", None, transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                              high_freq_factor=4.0, original_max_position_embeddings=32),
            tie_word_embeddings=True, **common)),
        # Mistral: GQA, linear rope scaling, a sliding window longer than the sequences; f16.
        "mistral": ("f16", None, transformers.MistralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
            rope_scaling=dict(rope_type="linear", factor=2.0), tie_word_embeddings=False,
            **common)),
        # Qwen2: q/k/v biases, tied, bf16.
        "qwen2": ("bf16", None, transformers.Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=True, use_sliding_window=False, **common)),
        # GPT-2: LayerNorm with bias, learned positions, gelu_new, Conv1D weights, tied head.
        "gpt2": ("f32", None, transformers.GPT2Config(
            vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4,
            bos_token_id=bos, eos_token_id=eos, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)),
        # Granite (dense): embedding/attention/residual multipliers and logits scaling.
        "granite": ("f32", None, transformers.GraniteConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
            embedding_multiplier=4.0, attention_multiplier=0.125, residual_multiplier=0.5,
            logits_scaling=2.0, tie_word_embeddings=False, **common)),
        # Qwen3: per-head RMSNorm on q and k before RoPE, head_dim·heads ≠ hidden, GQA, tied.
        "qwen3": ("bf16", None, transformers.Qwen3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=True, use_sliding_window=False, **common)),
        # OLMo 2: norms after attention and MLP outputs, RMSNorm over the whole q and k
        # projections, GQA, untied.
        "olmo2": ("f32", None, transformers.Olmo2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500000.0,
            tie_word_embeddings=False, pad_token_id=None, **common)),
        # Phi-3: fused qkv_proj and gate_up_proj, partial rotary (half of each head), GQA.
        "phi3": ("f32", None, transformers.Phi3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, partial_rotary_factor=0.5,
            rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=None, **common)),
        # Gemma 3 (text): GeGLU, (1 + w) RMSNorms, four norms a block, embeddings × √hidden,
        # per-head QK-norm, query_pre_attn_scalar, head_dim·heads ≠ hidden, sliding layers
        # (window 8 < the sequence) with their own RoPE θ among full ones with linear scaling.
        "gemma3_text": ("bf16", None, transformers.Gemma3TextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10000.0}},
            tie_word_embeddings=True, pad_token_id=None, **common)),
        # Gemma 2: as Gemma 3 without QK-norm or local θ, with attention and final soft-caps
        # (small, so that they matter), alternating sliding layers.
        "gemma2": ("bf16", None, transformers.Gemma2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, query_pre_attn_scalar=32,
            sliding_window=8, attn_logit_softcapping=10.0, final_logit_softcapping=5.0,
            tie_word_embeddings=True, pad_token_id=None, **common)),
        # Phi-3 with LongRoPE: original context 16, so the fixed sequence (48) takes the long
        # factors and the greedy continuation crosses from short to long.
        "phi3_longrope": ("f32", None, transformers.Phi3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, original_max_position_embeddings=16,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0, 1.0, 1.2, 1.5, 2.0, 3.0, 4.0, 6.0],
                             "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0]},
            tie_word_embeddings=False, pad_token_id=None, **common)),
        # Granite 4.0 hybrid (dense, NoPE): Mamba-2 layers around one attention layer, the
        # shared MLP, n_groups > 1, a chunk size that does not divide the sequence, tied head.
        "granite_hybrid": ("bf16", None, transformers.GraniteMoeHybridConfig(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            shared_intermediate_size=128, intermediate_size=32, num_local_experts=0,
            num_experts_per_tok=0, layer_types=["mamba", "attention", "mamba", "mamba"],
            mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=20, rms_norm_eps=1e-5,
            embedding_multiplier=4.0, attention_multiplier=0.125, residual_multiplier=0.5,
            logits_scaling=2.0, position_embedding_type=None, tie_word_embeddings=True,
            **common)),
        # Granite 4.0 hybrid with routed experts (top-2 of 4, the load-balancing loss on),
        # RoPE attention, biases on the Mamba projections, untied head.
        "granite_hybrid_moe": ("bf16", None, transformers.GraniteMoeHybridConfig(
            hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            shared_intermediate_size=64, intermediate_size=32, num_local_experts=4,
            num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.01,
            layer_types=["attention", "mamba", "mamba"], mamba_n_heads=4, mamba_d_head=32,
            mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=3, mamba_expand=2,
            mamba_chunk_size=32, mamba_proj_bias=True, rms_norm_eps=1e-6,
            embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.7,
            logits_scaling=1.5, position_embedding_type="rope", rope_theta=10000.0,
            tie_word_embeddings=False, **common)),
    }


# The longrope fixture's log-probabilities of its first tokens, a forward within the original
# context (short factors).
SHORT = 16


def gemma3_wrapped(text_dir, out):
    """The gemma3_text fixture's language model inside a Gemma3ForConditionalGeneration with a
    tiny vision tower, saved as transformers saves it (model_type gemma3, text_config)."""
    text = transformers.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    cfg = transformers.Gemma3Config(
        text_config=text.config.to_dict(),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16,
                           intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=2, eoi_token_index=3, image_token_index=4,
        eos_token_id=text.config.eos_token_id, bos_token_id=text.config.bos_token_id)
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    missing = model.model.language_model.load_state_dict(text.model.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    shutil.rmtree(out, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(text_dir, f), out)
    ref = transformers.Gemma3ForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    return ref


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def expected_logprobs(model, ids):
    """Per-token log-probs of ids[1:] given the prefix (one forward over ids[:-1])."""
    model.eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        logits = model(x[:, :-1]).logits.float()
        lp = torch.log_softmax(logits[0], dim=-1)
        return [float(v) for v in lp.gather(1, x[0, 1:, None])[:, 0]], x


def expected(model, ids):
    """Per-token log-probs of ids[1:] given the prefix, and the greedy continuation."""
    tok_lp, x = expected_logprobs(model, ids)
    with torch.no_grad():
        prompt = torch.tensor([ids[:PROMPT]])
        out = model.generate(prompt, max_new_tokens=NEW, do_sample=False,
                             attention_mask=torch.ones_like(prompt))
    return tok_lp, out[0, PROMPT:].tolist()


def aux_loss(model, ids):
    """The load-balancing loss transformers adds (× router_aux_loss_coef) on the sequence, for
    models with routed experts that output their router logits; else None."""
    if getattr(model.config, "num_local_experts", 0) <= 0:
        return None
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return float(out.aux_loss)


def make(out_root, only=None):
    torch.manual_seed(0)
    os.makedirs(out_root, exist_ok=True)
    tok_path = make_tokenizer(out_root)
    tok = Tokenizer.from_file(tok_path)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    data = tok.encode(TEXT).ids
    vocab = tok.get_vocab_size()
    assert vocab <= VOCAB, vocab
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=tok_path, bos_token="<s>",
                                                eos_token="</s>")
    seq = data[:SEQ]
    for name, (dtype, shard, cfg) in configs(vocab, bos, eos).items():
        if only and name not in only:
            continue
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
        g = torch.Generator().manual_seed(2)
        model.train()
        for step in range(200):
            starts = torch.randint(0, len(data) - SEQ - 1, (8,), generator=g)
            x = torch.stack([torch.tensor(data[s:s + SEQ]) for s in starts.tolist()])
            loss = model(x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        d = os.path.join(out_root, name)
        shutil.rmtree(d, ignore_errors=True)
        model = model.to(DTYPES[dtype])
        kw = {"max_shard_size": "150KB"} if shard else {}
        model.save_pretrained(d, **kw)
        fast.save_pretrained(d)
        # Expected values from the saved files, in float32 (what cockpit computes on the CPU).
        ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        lps, greedy = expected(ref, seq)
        exp = {
            "model_type": cfg.model_type,
            "dtype": dtype,
            "ids": seq,
            "logprobs": lps,
            "loss": -sum(lps) / len(lps),
            "prompt_ids": seq[:PROMPT],
            "prompt_text": tok.decode(seq[:PROMPT]),
            "greedy": greedy,
            "aux_loss": aux_loss(ref, seq),
            "train_loss": float(loss.detach()),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        }
        if name == "phi3_longrope":
            short, _ = expected_logprobs(ref, seq[:SHORT])
            exp["short_logprobs"] = short
        with open(os.path.join(d, "expected.json"), "w") as f:
            json.dump(exp, f, indent=1)
        if name == "gemma3_text" and (not only or "gemma3" in only or name in only):
            wd = os.path.join(out_root, "gemma3")
            wref = gemma3_wrapped(d, wd)
            wlps, wgreedy = expected(wref, seq)
            wexp = dict(exp, model_type="gemma3", logprobs=wlps,
                        loss=-sum(wlps) / len(wlps), greedy=wgreedy)
            with open(os.path.join(wd, "expected.json"), "w") as f:
                json.dump(wexp, f, indent=1)
            print(f"gemma3   bf16 loss {wexp['loss']:.4f} greedy {wgreedy}")
        print(f"{name:8s} {dtype:4s} loss {exp['loss']:.4f} (train {float(loss.detach()):.3f}) "
              f"greedy {greedy}")
    os.remove(tok_path)


def check_export(export_dir, fixture_dir):
    """Load a cockpit export with transformers; print its loss on a fixture's sequence."""
    exp = json.load(open(os.path.join(fixture_dir, "expected.json")))
    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    lps, greedy = expected(model, exp["ids"])
    loss = -sum(lps) / len(lps)
    print(json.dumps({"model_type": model.config.model_type, "loss": loss,
                      "fixture_loss": exp["loss"], "greedy": greedy,
                      "fixture_greedy": exp["greedy"]}))
    if os.path.exists(os.path.join(export_dir, "tokenizer.json")):
        tok = transformers.AutoTokenizer.from_pretrained(export_dir)
        print(json.dumps({"tokenizer": type(tok).__name__, "decoded": tok.decode(greedy)}))


def check_adapter(adapter_dir, base_dir, merged_dir):
    """Load a cockpit --adapter export with PEFT on its base; compare with the merged export."""
    from peft import PeftModel
    exp = json.load(open(os.path.join(base_dir, "expected.json")))
    x = torch.tensor([exp["ids"]])
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    with torch.no_grad():
        a, b = peft(x).logits, merged.eval()(x).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)(x).logits
    print(json.dumps({"peft_vs_merged_max_abs": float((a - b).abs().max()),
                      "adapter_effect_max_abs": float((a - plain).abs().max())}))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--check-adapter":
        check_adapter(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) >= 3 and sys.argv[1] == "--check-export":
        check_export(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "tests/fixtures/hf/llama2")
    elif len(sys.argv) >= 2 and sys.argv[1] == "--only":
        # --only NAME[,NAME…] [OUT_DIR]: remake these fixtures alone.
        make(sys.argv[3] if len(sys.argv) > 3 else "tests/fixtures/hf", sys.argv[2].split(","))
    else:
        make(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf")
