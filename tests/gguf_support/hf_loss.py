"""Load a GGUF file with transformers' GGUF loader (AutoModelForCausalLM and AutoTokenizer,
`gguf_file=`) and print, as JSON, the mean next-token loss of the ids given (a JSON list) and
the ids its tokenizer gives the text given. Exit 3 when torch, transformers or gguf is
missing."""
import json
import os
import sys

try:
    import gguf  # noqa: F401
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
except ImportError as e:
    print(f"torch, transformers and gguf are needed ({e})", file=sys.stderr)
    sys.exit(3)


def main():
    path, ids, text = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    d, f = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits[0, :-1].double()
    lp = torch.log_softmax(logits, -1)
    loss = -lp.gather(1, x[0, 1:, None]).mean().item()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    enc = tok(text)["input_ids"]
    json.dump({"loss": loss, "text_ids": enc}, sys.stdout)


main()
