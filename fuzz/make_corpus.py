#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses into fuzz/corpus/<harness>/ (small valid files
and a few near misses). Run it again after changing a format; the files are committed."""
import gzip
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(harness, name, data):
    d = os.path.join(HERE, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def gz(data):
    return gzip.compress(data, compresslevel=9, mtime=0)


def idx(shape, data):
    return bytes([0, 0, 8, len(shape)]) + b"".join(struct.pack(">I", s) for s in shape) + data


def safetensors(tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


images = idx([2, 3, 3], bytes(range(18)))
labels = idx([4], bytes([0, 9, 3, 7]))
put("idx", "images", images)
put("idx", "labels", labels)
put("idx", "images.gz", gz(images))
put("idx", "labels.gz", gz(labels))
put("idx", "truncated", images[:-5])
put("idx", "four_dims", idx([1, 2, 1, 2], bytes(4)))
put("idx_gzip", "images", b"\0" + images)
put("idx_gzip", "labels_lying_trailer", b"\1" + labels + bytes(40))
put("idx_gzip", "truncated", b"\0" + images[:-5])

record = bytes([3]) + bytes(i % 256 for i in range(3072))
put("cifar", "one_record", record)
put("cifar", "two_records", record + bytes([9]) + record[1:])
put("cifar", "one_record.gz", gz(record))
put("cifar", "partial", record[:100])

f32 = struct.pack("<4f", 1.0, -2.5, 0.125, 3.0)
put("safetensors", "weights", safetensors(
    {"fc.weight": ("F32", [2, 2], f32), "fc.bias": ("BF16", [2], b"\x80\x3f\x00\x40"),
     "steps": ("I64", [1], struct.pack("<q", 12))},
    {"format": "mantissa-checkpoint-1", "model": "lenet5", "step": "12"}))
put("safetensors", "empty_tensor", safetensors({"e": ("F16", [0, 3], b""), "u": ("U8", [3], b"abc")}))
put("safetensors", "fp8_bool", safetensors(
    {"a": ("F8_E4M3", [2], b"\x38\xb8"), "b": ("F8_E5M2", [1], b"\x3c"),
     "c": ("BOOL", [2], b"\x01\x00"), "d": ("I32", [], struct.pack("<i", 7)),
     "e": ("F64", [1], struct.pack("<d", 0.5))}))
put("safetensors", "metadata_only", safetensors({}, {"note": "no tensors"}))

put("op_list", "lower", "# ops in 16 bits\nconv2d\nlinear  # matrix ops\n\nmatmul\n")
put("op_list", "fp32", "group_norm\nlayer_norm\r\nsoftmax\ncross_entropy\n")
put("op_list", "bad", "conv2d, linear\nconv9d\n")

for i, s in enumerate(["1000", "512MiB", "1.5GiB", "2 GB", "64k", " 7 kB ", ".5T", "18446744073709549568",
                       "0.0001 tib", "12 parsecs"]):
    put("parse_bytes", "size%d" % i, s)
