#!/usr/bin/env python3
"""Make tests/fixtures/hf/chatml: a tiny Qwen2 model with a ChatML chat template, the base of
`cockpit chat`'s tests (tests/chat.rs) and of the README's worked chat example.

A byte-level BPE tokenizer with the ChatML special tokens (<|im_start|>, <|im_end|>, the end of
a turn and the model's EOS), the template in tokenizer_config.json, and a model trained a few
hundred steps with transformers on ChatML conversations of one skill (saying a word back), so
it knows the format: it answers after `<|im_start|>assistant` and ends its turn. It has never
seen arithmetic (the README example teaches that with LoRA).

    python3 scripts/chat_fixture.py [OUT_DIR]    (needs torch, transformers)
"""
import json
import os
import random
import sys

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
               r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("apple river stone cloud green seven tiger paper music light plus what is and how "
         "much add the a one two three four five six eight nine zero calculator answer in "
         "sentence you are").split()


def conversation(rng):
    w = rng.choice(WORDS)
    m = []
    if rng.random() < 0.3:
        m.append({"role": "system", "content": "You are a helpful assistant."})
    ask = rng.choice(["Say {w}.", "Repeat {w}.", "Say {w} twice."]).format(w=w)
    m.append({"role": "user", "content": ask})
    m.append({"role": "assistant", "content": f"{w} {w}." if "twice" in ask else f"{w}."})
    return m


def render(messages, gen=False):
    import jinja2
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(TEMPLATE).render(messages=messages, add_generation_prompt=gen)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf", "chatml")
    os.makedirs(out, exist_ok=True)
    rng = random.Random(0)
    convs = [conversation(rng) for _ in range(600)]
    corpus = [render(c) for c in convs] + [
        f"What is {a} plus {b}? {a} plus {b} is {a + b}." for a in range(10) for b in range(10)]
    # Qwen2's pipeline, which transformers' Qwen2Tokenizer rebuilds whatever tokenizer.json
    # says: NFC, its split (digits one by one), then bytes.
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    pad = tok.token_to_id("<|endoftext|>")
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"backend": "tokenizers", "bos_token": None, "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "model_max_length": 256,
                   "tokenizer_class": "TokenizersBackend", "chat_template": TEMPLATE}, f,
                  indent=2)
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, use_sliding_window=False, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    model = transformers.Qwen2ForCausalLM(cfg)
    seqs = [tok.encode(render(c)).ids for c in convs]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(300):
        batch = rng.sample(seqs, 16)
        n = max(map(len, batch))
        ids = torch.tensor([s + [pad] * (n - len(s)) for s in batch])
        labels = torch.tensor([s + [-100] * (n - len(s)) for s in batch])
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == 299:
            print(f"step {step} loss {loss.item():.3f}")
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.to(torch.bfloat16).save_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = tok.encode(render([{"role": "user", "content": "Say river twice."}], True)).ids
    hf = transformers.AutoTokenizer.from_pretrained(out)
    text = render([{"role": "user", "content": "Say 3 plus 4 twice."}], True)
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text).ids
    g = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    print("greedy:", repr(tok.decode(g[0, len(prompt):].tolist(), skip_special_tokens=False)))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
