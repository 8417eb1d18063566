#!/usr/bin/env python3
"""Write a small chat dataset as JSON Lines of OpenAI/TRL `messages` records: questions about
adding two small numbers, answered in one sentence; a system turn in every fourth record and a
follow-up question in every fifth (two assistant turns). Python's standard library only.

    python3 scripts/chat_data.py data/chat-add          # train.jsonl (400) and val.jsonl (40)
    python3 scripts/chat_data.py OUT_DIR --train N --val M --seed S
"""
import argparse
import json
import pathlib
import random

SYSTEM = "You are a calculator. Answer in one sentence."
ASK = ["What is {a} plus {b}?", "Add {a} and {b}.", "How much is {a} + {b}?"]


def record(rng):
    a, b = rng.randrange(10), rng.randrange(10)
    messages = []
    if rng.random() < 0.25:
        messages.append({"role": "system", "content": SYSTEM})
    messages.append({"role": "user", "content": rng.choice(ASK).format(a=a, b=b)})
    messages.append({"role": "assistant", "content": f"{a} plus {b} is {a + b}."})
    if rng.random() < 0.2:
        c = rng.randrange(10)
        messages.append({"role": "user", "content": f"And plus {c}?"})
        messages.append({"role": "assistant", "content": f"{a + b} plus {c} is {a + b + c}."})
    return {"messages": messages}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--train", type=int, default=400)
    p.add_argument("--val", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    for name, n in (("train.jsonl", a.train), ("val.jsonl", a.val)):
        with open(a.out / name, "w", encoding="utf-8") as f:
            for _ in range(n):
                f.write(json.dumps(record(rng)) + "\n")
    print(f"{a.train} + {a.val} conversations in {a.out}/train.jsonl and val.jsonl")


if __name__ == "__main__":
    main()
