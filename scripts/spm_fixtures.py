#!/usr/bin/env python3
"""Make the SentencePiece-tokenized fixture that tests/gguf_spm.rs checks cockpit against.

tests/fixtures/spm/ gets:
- tokenizer/tokenizer.model: a tiny SentencePiece BPE model trained here with Llama 2's settings (byte
  fallback, a dummy prefix, no normalization, digits split, <unk> <s> </s> at 0 1 2);
- hf/: a tiny Llama model (trained a few steps) saved with save_pretrained, with the Hugging Face
  tokenizer transformers converts from tokenizer.model (tokenizer.json: BPE, byte fallback,
  Metaspace);
- gguf/model.gguf: that model as llama.cpp's converter writes it, with the `gguf` package's writer:
  `tokenizer.ggml.model = "llama"`, the SentencePiece pieces, scores and token types (llama.cpp's
  sentencepiece path: no merges), q/k rows permuted, f32;
- expected.json: what transformers' GGUF loader (`AutoTokenizer.from_pretrained(dir,
  gguf_file=...)`) gives for a few strings (ids with and without special tokens, decoded text),
  what SentencePiece itself gives, and the loss transformers computes on model.gguf.

Needs torch, transformers, gguf, sentencepiece and protobuf (CI does not run this; the outputs are
committed):
    python3 scripts/spm_fixtures.py [OUT_DIR]
"""
import io
import json
import os
import shutil
import sys

import numpy as np
import sentencepiece as spm
import torch
import transformers
from gguf import GGUFWriter, TokenType

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_fixtures import TEXT  # noqa: E402

VOCAB = 400
SEQ = 32

# ASCII, runs of spaces, a leading space, newlines and tabs, digits, accents that are in the
# vocabulary or not, characters only byte fallback spells, special tokens written in the text.
STRINGS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world",
    " leading space",
    "two  spaces   and three",
    "trailing space ",
    "line one\nline two\n\ttabbed",
    "digits 12345 and 3.14",
    "café naïve résumé",
    "日本語のテキスト",
    "emoji 🦀 and ✓ marks",
    "<s> written in text </s>",
    "",
]


def train_spm(out):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    os.makedirs(os.path.join(out, "tokenizer"))
    path = os.path.join(out, "tokenizer", "tokenizer.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def token_types(sp):
    """llama.cpp's token type of each piece (its sentencepiece vocabulary's rule)."""
    types = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            types.append(TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    return types


def permute(w, n_head):
    """llama.cpp's q/k row order (interleaved rotary halves)."""
    w = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
    return w.swapaxes(1, 2).reshape(-1, *w.shape[3:])


def write_gguf(model, sp, path):
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = GGUFWriter(path, "llama")
    w.add_name("spm-fixture")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_file_type(0)
    n = sp.get_piece_size()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([sp.id_to_piece(i).encode("utf-8") for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(token_types(sp))
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, g in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{g}.weight"
    for hf, g in names.items():
        t = sd[hf]
        if g.endswith("attn_q.weight"):
            t = permute(t, cfg.num_attention_heads)
        elif g.endswith("attn_k.weight"):
            t = permute(t, cfg.num_key_value_heads)
        w.add_tensor(g, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/spm"
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    sp_path = train_spm(out)
    sp = spm.SentencePieceProcessor(model_file=sp_path)
    vocab = sp.get_piece_size()
    # (transformers' own conversion of tokenizer.model, as Llama 2's tokenizer.json is)
    slow = transformers.LlamaTokenizer.from_pretrained(os.path.dirname(sp_path), legacy=False,
                                                       add_bos_token=True)
    data = sp.encode(TEXT.replace("\n", " "))
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=sp.bos_id(),
        eos_token_id=sp.eos_id())
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(2)
    for _ in range(100):
        starts = torch.randint(0, len(data) - SEQ - 1, (8,), generator=g)
        x = torch.stack([torch.tensor(data[s:s + SEQ]) for s in starts.tolist()])
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    hf_dir = os.path.join(out, "hf")
    model.save_pretrained(hf_dir)
    slow.save_pretrained(hf_dir)
    for extra in ("tokenizer.model", "special_tokens_map.json"):
        p = os.path.join(hf_dir, extra)
        if os.path.exists(p):
            os.remove(p)
    gguf_dir = os.path.join(out, "gguf")
    os.makedirs(gguf_dir)
    gguf_path = os.path.join(gguf_dir, "model.gguf")
    write_gguf(model, sp, gguf_path)

    tok = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file="model.gguf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    cases = []
    for s in STRINGS:
        ids = tok(s)["input_ids"]
        plain = tok(s, add_special_tokens=False)["input_ids"]
        cases.append({
            "text": s,
            "ids": ids,
            "ids_plain": plain,
            "decoded": tok.decode(ids, skip_special_tokens=True),
            "decoded_special": tok.decode(ids),
            "sentencepiece": sp.encode(s),
            "hf_dir_ids": hf_tok(s)["input_ids"],
        })
    ids = [sp.bos_id()] + data[:SEQ]
    ref = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file="model.gguf",
                                                            dtype=torch.float32)
    with torch.no_grad():
        x = torch.tensor([ids])
        lp = torch.log_softmax(ref(x).logits[0, :-1].double(), -1)
        gguf_loss = -lp.gather(1, x[0, 1:, None]).mean().item()
    exp = {
        "cases": cases,
        "ids": ids,
        "gguf_loss": gguf_loss,
        "train_loss": float(loss.detach()),
        "transformers": transformers.__version__,
        "sentencepiece": spm.__version__,
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(exp, f, indent=1, ensure_ascii=False)
    for c in cases:
        same = "same" if c["ids"][1:] == c["sentencepiece"] else "DIFFERS from sentencepiece"
        print(f"{c['text']!r}: {c['ids']} ({same}; hf dir {c['hf_dir_ids'] == c['ids']})")
    print(f"gguf loss {gguf_loss:.4f} (train {float(loss.detach()):.3f})")


main()
