#!/usr/bin/python3
"""Writes the PyTorch golden files the C++ tests compare against (tests/golden/*.safetensors).

Run with Debian's PyTorch (python3-torch, 1.13, CPU):   /usr/bin/python3 scripts/make_golden.py
The tests do not need Python; this script only regenerates the files. Every case here has a twin
of the same name in tests/golden/test_golden.cc, which must call Mantissa the same way.

For each op and dtype (f32, and bf16 where PyTorch supports it on the CPU) the file holds
  <case>/<dtype>/in<i>     inputs                    <case>/<dtype>/out    the output
  <case>/<dtype>/R         weights of the loss sum(out * R)
  <case>/<dtype>/grad<i>   d loss / d input i        (extra outputs, e.g. running statistics)
The safetensors format is written by hand (json + struct) so no package beyond torch is needed.
"""
import json
import os
import struct
import sys
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_models import BasicBlock, TutorialCnn  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "..", "tests", "golden")

CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
         torch.int32: "I32", torch.uint8: "U8"}


def save(path, tensors, metadata):
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(path + ".tmp", path)


def randn(*shape):
    return torch.randn(*shape)


def away_from_zero(*shape):
    x = torch.randn(*shape)
    return x + torch.where(x < 0, -0.1, 0.1)


def positive(*shape):
    return 0.5 + torch.randn(*shape).abs()


def distinct(*shape):
    n = 1
    for d in shape:
        n *= d
    v = (torch.arange(n, dtype=torch.float32) - n / 2) / 16
    return v[torch.randperm(n)].reshape(shape)


def targets(n, classes, ignored=False):
    t = torch.randint(0, classes, (n,))
    if ignored:
        t[1] = -100
    return t


# name -> (input makers, function of inputs). Integer inputs are labels (never differentiated).
def cases():
    c = {}
    c["linear"] = ([lambda: randn(3, 5), lambda: randn(4, 5), lambda: randn(4)], lambda x, w, b: F.linear(x, w, b))
    c["matmul"] = ([lambda: randn(2, 3, 4), lambda: randn(2, 4, 5)], torch.matmul)
    c["conv2d_pad1"] = ([lambda: randn(2, 3, 7, 6), lambda: randn(4, 3, 3, 3), lambda: randn(4)],
                        lambda x, w, b: F.conv2d(x, w, b, padding=1))
    c["conv2d_stride2_groups2"] = ([lambda: randn(2, 4, 7, 7), lambda: randn(6, 2, 3, 3), lambda: randn(6)],
                                   lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1, groups=2))
    c["conv2d_dilation2"] = ([lambda: randn(1, 2, 8, 8), lambda: randn(3, 2, 3, 3)],
                             lambda x, w: F.conv2d(x, w, None, padding=2, dilation=2))
    c["max_pool2d"] = ([lambda: distinct(2, 3, 7, 8)], lambda x: F.max_pool2d(x, 3, 2, 1))
    c["avg_pool2d"] = ([lambda: randn(2, 3, 7, 8)], lambda x: F.avg_pool2d(x, 3, 2, 1))
    c["avg_pool2d_exclude_pad"] = ([lambda: randn(2, 3, 7, 8)],
                                   lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False))
    c["adaptive_avg_pool2d"] = ([lambda: randn(2, 3, 7, 5)], lambda x: F.adaptive_avg_pool2d(x, (3, 2)))
    c["relu"] = ([lambda: away_from_zero(3, 4, 5)], F.relu)
    c["gelu"] = ([lambda: randn(3, 4, 5)], F.gelu)
    c["sigmoid"] = ([lambda: randn(3, 4, 5)], torch.sigmoid)
    c["tanh"] = ([lambda: randn(3, 4, 5)], torch.tanh)
    c["add"] = ([lambda: randn(2, 3, 4), lambda: randn(3, 1)], torch.add)
    c["sub"] = ([lambda: randn(2, 1, 4), lambda: randn(1, 3, 1)], torch.sub)
    c["mul"] = ([lambda: randn(2, 3, 4, 5), lambda: randn(1, 3, 1, 1)], torch.mul)
    c["div"] = ([lambda: randn(3, 4), lambda: positive(4)], torch.div)
    c["add_scalar"] = ([lambda: randn(3, 5)], lambda x: x + 0.75)
    c["mul_scalar"] = ([lambda: randn(3, 5)], lambda x: x * -1.5)
    c["batch_norm_eval"] = ([lambda: randn(4, 3, 2, 5), lambda: randn(3), lambda: randn(3)],
                            lambda x, w, b: F.batch_norm(x, torch.tensor([0.1, -0.2, 0.3]), torch.tensor([1.5, 0.5, 2.0]),
                                                         w, b, training=False, eps=1e-5))
    c["group_norm"] = ([lambda: randn(2, 6, 3, 4), lambda: randn(6), lambda: randn(6)],
                       lambda x, w, b: F.group_norm(x, 3, w, b, 1e-5))
    c["layer_norm"] = ([lambda: randn(3, 4, 6), lambda: randn(6), lambda: randn(6)],
                       lambda x, w, b: F.layer_norm(x, (6,), w, b, 1e-5))
    c["softmax"] = ([lambda: randn(3, 7)], lambda x: F.softmax(x, 1))
    c["log_softmax"] = ([lambda: randn(5, 3, 2)], lambda x: F.log_softmax(x, 0))
    c["sum"] = ([lambda: randn(3, 4, 5)], lambda x: x.sum((0, 2), keepdim=True))
    c["mean"] = ([lambda: randn(3, 4, 5)], lambda x: x.mean(1))
    c["cat"] = ([lambda: randn(2, 3), lambda: randn(2, 4), lambda: randn(2, 1)], lambda a, b, d: torch.cat([a, b, d], 1))
    c["transpose"] = ([lambda: randn(2, 3, 4)], lambda x: x.transpose(0, 2).contiguous())
    c["flatten"] = ([lambda: randn(2, 3, 4, 5)], lambda x: torch.flatten(x, 1))
    c["nll_loss"] = ([lambda: randn(5, 4), lambda: targets(5, 4, True)], lambda x, t: F.nll_loss(x, t))
    c["cross_entropy"] = ([lambda: randn(6, 5), lambda: targets(6, 5)], lambda x, t: F.cross_entropy(x, t))
    c["cross_entropy_label_smoothing"] = ([lambda: randn(6, 5), lambda: targets(6, 5, True)],
                                         lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1))
    return c


def run_op(name, makers, fn, dtype, out, skipped):
    torch.manual_seed(zlib.crc32(name.encode()))  # str hash() is randomised per process
    raw = [m() for m in makers]
    xs = [t.to(dtype).requires_grad_() if t.is_floating_point() else t for t in raw]
    try:
        y = fn(*xs)
        r = torch.randn(y.shape)
        (y.float() * r).sum().backward()
    except RuntimeError as e:
        skipped.append(f"{name}/{dtype}: {str(e).splitlines()[0][:100]}")
        return
    tag = f"{name}/{'f32' if dtype == torch.float32 else 'bf16'}"
    for i, x in enumerate(xs):
        out[f"{tag}/in{i}"] = x
        if x.is_floating_point():
            out[f"{tag}/grad{i}"] = x.grad
    out[f"{tag}/out"] = y
    out[f"{tag}/R"] = r


def batch_norm_train(dtype, out):
    """Training-mode batch norm, including the running-statistics update (kept in FP32)."""
    torch.manual_seed(7)
    x = randn(4, 3, 2, 5).to(dtype).requires_grad_()
    w, b = randn(3).to(dtype).requires_grad_(), randn(3).to(dtype).requires_grad_()
    rm, rv = torch.zeros(3), torch.ones(3)
    try:
        y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
        r = torch.randn(y.shape)
        (y.float() * r).sum().backward()
    except RuntimeError:
        return
    tag = f"batch_norm_train/{'f32' if dtype == torch.float32 else 'bf16'}"
    out.update({f"{tag}/in0": x, f"{tag}/in1": w, f"{tag}/in2": b, f"{tag}/out": y, f"{tag}/R": r,
                f"{tag}/grad0": x.grad, f"{tag}/grad1": w.grad, f"{tag}/grad2": b.grad,
                f"{tag}/running_mean": rm, f"{tag}/running_var": rv})


def network(name, model, x, loss_fn, dtype, out, skipped):
    tag = f"{name}/{'f32' if dtype == torch.float32 else 'bf16'}"
    model = model.to(dtype) if dtype != torch.float32 else model
    # Keep batch-norm running statistics in FP32 (Mantissa always does).
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.data = m.running_mean.float()
            m.running_var.data = m.running_var.float()
    x = x.to(dtype).requires_grad_()
    for k, v in model.state_dict().items():
        if "num_batches_tracked" not in k:
            out[f"{tag}/param/{k}"] = v.clone()
    try:
        y = model(x)
        loss = loss_fn(y)
        loss.backward()
    except RuntimeError as e:
        skipped.append(f"{tag}: {str(e).splitlines()[0][:100]}")
        return
    out[f"{tag}/input"] = x
    out[f"{tag}/out"] = y
    out[f"{tag}/loss"] = loss.float().reshape(())
    out[f"{tag}/grad/input"] = x.grad
    for k, p in model.named_parameters():
        out[f"{tag}/grad/{k}"] = p.grad
    for k, v in model.state_dict().items():
        if "running" in k:
            out[f"{tag}/after/{k}"] = v.clone()


def main():
    torch.set_num_threads(1)
    skipped, ops = [], {}
    for name, (makers, fn) in cases().items():
        for dtype in (torch.float32, torch.bfloat16):
            run_op(name, makers, fn, dtype, ops, skipped)
    for dtype in (torch.float32, torch.bfloat16):
        batch_norm_train(dtype, ops)
    meta = {"generator": "scripts/make_golden.py", "torch": torch.__version__, "skipped": json.dumps(skipped)}
    save(os.path.join(OUT_DIR, "ops.safetensors"), ops, meta)

    nets, skipped_nets = {}, []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(1)
        cnn = TutorialCnn(20)
        x = torch.rand(2, 1, 20, 20) * 2 - 1
        labels = torch.tensor([3, 7])
        nets[f"tutorial_cnn/{'f32' if dtype == torch.float32 else 'bf16'}/target"] = labels
        network("tutorial_cnn", cnn, x, lambda y: F.nll_loss(y.float(), labels), dtype, nets, skipped_nets)
        torch.manual_seed(2)
        block = BasicBlock(8, 16, 2)
        x = torch.randn(2, 8, 6, 6)
        r = torch.randn(2, 16, 3, 3)
        nets[f"resnet_block/{'f32' if dtype == torch.float32 else 'bf16'}/R"] = r
        network("resnet_block", block.train(), x, lambda y: (y.float() * r).sum(), dtype, nets, skipped_nets)
    save(os.path.join(OUT_DIR, "networks.safetensors"), nets,
         {"generator": "scripts/make_golden.py", "torch": torch.__version__, "skipped": json.dumps(skipped_nets),
          "tutorial_cnn": "the PopTorch tutorial CNN on 20x20 input (fc1 300 -> 100) to keep the file small"})
    print(f"ops: {len(ops)} tensors, skipped {skipped}; networks: {len(nets)} tensors, skipped {skipped_nets}")


if __name__ == "__main__":
    sys.exit(main())
