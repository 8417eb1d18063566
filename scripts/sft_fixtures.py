#!/usr/bin/env python3
"""Write the Parquet fixtures of tests/sft.rs the way Hugging Face datasets stores a split
(pyarrow; snappy pages, and zstd for one file): alpaca, prompt/completion and messages
records. Usage: python scripts/sft_fixtures.py  (needs `pip install pyarrow`)."""
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "sft"


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    n = 30
    alpaca = pa.table(
        {
            "instruction": [f"Add {i} and {i % 7}." for i in range(n)],
            "input": ["" if i % 2 else f"Show the sum of {i} and {i % 7}." for i in range(n)],
            "output": [f"{i + i % 7}" for i in range(n)],
        }
    )
    pq.write_table(alpaca, OUT / "alpaca.parquet", compression="snappy")
    pc = pa.table(
        {
            "prompt": [f"{i} + 1 =" for i in range(n)],
            "completion": [f" {i + 1}" for i in range(n)],
        }
    )
    pq.write_table(pc, OUT / "prompt_completion.parquet", compression="zstd")
    messages = pa.table(
        {
            "messages": [
                [
                    {"role": "user", "content": f"Say {i} twice."},
                    {"role": "assistant", "content": f"{i} {i}"},
                ]
                for i in range(n)
            ]
        }
    )
    pq.write_table(messages, OUT / "messages.parquet", compression="snappy")
    print(f"written to {OUT}")


if __name__ == "__main__":
    main()
