#!/usr/bin/env python3
"""Render the chat templates in tests/fixtures/chat/*.jinja with transformers (what
`tokenizer.apply_chat_template(..., tokenize=False)` calls: `render_jinja_template` with the
tokenizer's special tokens) and write tests/fixtures/chat/expected.json, which
`cargo test --lib engine::data::chat` compares cockpit's rendering with.

Usage: python scripts/chat_template_fixtures.py   (needs `pip install transformers jinja2`)
"""
import json
import pathlib

from transformers.utils.chat_template_utils import render_jinja_template

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat"

SPECIALS = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "smollm": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
    "gemma": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "granite": {"bos_token": "<|end_of_text|>", "eos_token": "<|end_of_text|>"},
}

CONVERSATIONS = [
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
    ],
    [
        {"role": "system", "content": "You answer in French. "},
        {"role": "user", "content": "  Hello there!\nHow are you?"},
        {"role": "assistant", "content": "Bonjour ! Très bien, merci.\n"},
        {"role": "user", "content": "And the weather — \"sunny\"?"},
        {"role": "assistant", "content": "Il fait beau."},
    ],
    [
        {"role": "user", "content": "Only a question, é ü 漢字"},
    ],
]

TOOLS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Calling the tool."},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "It is 21 degrees."},
]


def main():
    cases = []
    for name, specials in SPECIALS.items():
        template = (ROOT / f"{name}.jinja").read_text()
        convs = CONVERSATIONS + ([TOOLS] if name in ("llama3", "qwen", "granite") else [])
        for messages in convs:
            for gen in (False, True):
                # Every prefix ending before an assistant turn, as cockpit renders them to find
                # the assistant spans, and the whole conversation.
                text = render_jinja_template(
                    conversations=[messages],
                    chat_template=template,
                    add_generation_prompt=gen,
                    **specials,
                )[0][0]
                cases.append(
                    {
                        "template": name,
                        "specials": specials,
                        "messages": messages,
                        "add_generation_prompt": gen,
                        "text": text,
                    }
                )
    (ROOT / "expected.json").write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n")
    # A tokenizer_config.json with the template inside (the way Hugging Face ships most).
    cfg = dict(SPECIALS["llama3"], chat_template=(ROOT / "llama3.jinja").read_text())
    (ROOT / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    print(f"{len(cases)} renderings written to {ROOT / 'expected.json'}")


if __name__ == "__main__":
    main()
