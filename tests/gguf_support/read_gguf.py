"""Read a GGUF file with the `gguf` package's GGUFReader (llama.cpp's own reader) and print
every key (with its GGUF value type) and every tensor (torch-order shape, ggml type,
dequantized values) as JSON. Exit 3 when the package is missing."""
import json
import sys

try:
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, dequantize
except ImportError as e:
    print(f"the gguf package is not installed ({e}); pip install gguf", file=sys.stderr)
    sys.exit(3)


def value(field):
    t = field.types[0]
    if t == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if t == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def main():
    r = GGUFReader(sys.argv[1])
    kv, types = {}, {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        kv[name] = value(f)
        types[name] = "/".join(t.name for t in f.types)
    tensors = {}
    for t in r.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        vals = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        tensors[t.name] = {
            "shape": shape,
            "type": t.tensor_type.name,
            "values": vals.tolist(),
        }
    json.dump({"kv": kv, "types": types, "tensors": tensors}, sys.stdout)


main()
