"""Load a GGUF file with llama.cpp (the `llama-cpp-python` package, CPU) and print, as JSON,
the mean next-token loss of the ids given (a JSON list) from llama.cpp's logits, and the ids
llama.cpp's tokenizer gives each text given (a JSON list, with its BOS where the file asks).
Exit 3 when the package is missing."""
import json
import math
import sys

try:
    import numpy as np
    from llama_cpp import Llama
except ImportError as e:
    print(f"llama-cpp-python is needed ({e}); pip install llama-cpp-python", file=sys.stderr)
    sys.exit(3)


def main():
    path, ids = sys.argv[1], json.loads(sys.argv[2])
    texts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else []
    llm = Llama(model_path=path, n_ctx=max(64, len(ids)), n_batch=len(ids), logits_all=True,
                n_threads=1, verbose=False)
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss = -float(np.mean([lp[i, ids[i + 1]] for i in range(len(ids) - 1)]))
    assert math.isfinite(loss)
    tokenized = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in texts]
    json.dump({"loss": loss, "text_ids": tokenized}, sys.stdout)


main()
