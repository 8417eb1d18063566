"""Load a GGUF file's tokenizer with transformers' GGUF loader (`AutoTokenizer`, `gguf_file=`)
and print, as JSON, the ids it gives each text given (a JSON list), with its special tokens, and
the text it decodes them to (special tokens skipped). Exit 3 when transformers or gguf is
missing."""
import json
import os
import sys

try:
    import gguf  # noqa: F401
    from transformers import AutoTokenizer
except ImportError as e:
    print(f"transformers and gguf are needed ({e})", file=sys.stderr)
    sys.exit(3)


def main():
    path, texts = sys.argv[1], json.loads(sys.argv[2])
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    out = []
    for t in texts:
        ids = tok(t)["input_ids"]
        out.append({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
    json.dump(out, sys.stdout)


main()
