#!/usr/bin/env python3
"""Distance of checkpoints' model weights from a reference checkpoint's, per parameter.

  python3 bench/weight_distance.py REFERENCE.safetensors OTHER.safetensors [OTHER ...]

For each model tensor (the checkpoint's tensors not named "optimizer.*") prints the
relative L2 distance ||w - w_ref|| / ||w_ref||, computed in FP64 from the stored values (F32, F16
and BF16 read exactly), and the same over all parameters together. Standard library only.
"""
import array
import json
import math
import struct
import sys


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[base + begin:base + end]
        dtype = info["dtype"]
        if dtype == "F32":
            values = array.array("f", raw)
        elif dtype == "BF16":
            halves = array.array("H", raw)
            values = array.array("f", array.array("I", (h << 16 for h in halves)).tobytes())
        elif dtype == "F16":
            values = array.array("f", (struct.unpack("<e", raw[i:i + 2])[0]
                                       for i in range(0, len(raw), 2)))
        else:
            continue
        out[name] = values
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    ref = read_safetensors(sys.argv[1])
    params = [k for k in ref if not k.startswith("optimizer.")]
    others = [(p, read_safetensors(p)) for p in sys.argv[2:]]
    print("parameter\t" + "\t".join(p for p, _ in others))
    totals = [[0.0, 0.0] for _ in others]
    for name in params:
        r = ref[name]
        norm = math.fsum(float(x) * float(x) for x in r)
        row = [name]
        for k, (_, o) in enumerate(others):
            d = math.fsum((float(a) - float(b)) ** 2 for a, b in zip(o[name], r))
            totals[k][0] += d
            totals[k][1] += norm
            row.append("%.3e" % (math.sqrt(d / norm) if norm > 0 else math.sqrt(d)))
        print("\t".join(row))
    print("all\t" + "\t".join("%.3e" % math.sqrt(d / n) for d, n in totals))


if __name__ == "__main__":
    main()
