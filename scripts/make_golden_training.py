#!/usr/bin/python3
"""Writes tests/golden/training.safetensors: PyTorch's optimizers, schedules and the first training
steps of the tutorial CNN on real Fashion-MNIST, for the C++ tests to compare against.

Run with Debian's PyTorch (python3-torch, 1.13, CPU) and dataset-fashion-mnist installed:
    /usr/bin/python3 scripts/make_golden_training.py
The tests do not need Python. Contents:
  opt/<case>/p<j>/init, opt/<case>/step<k>/g<j>, opt/<case>/step<k>/p<j>   optimizer trajectories
  sched/step, sched/cosine                                                 lr per step
  resize/in (3, 5, 7) u8, resize/out (3, 11, 11)                           the loader's resize
  cnn/images (240, 28, 28) u8, cnn/labels (240) i64                        first training images
  cnn/bounds                                                               init bound per tensor
  cnn/losses (20)                                                          PyTorch's step losses
The tutorial CNN's initial weights are not stored (16 MB): tensor k of the state dict, element i,
holds bound_k * (2 * frac((i + 1) * PHI + k * PLASTIC) - 1), computed in float64 and rounded to
float32; tests/golden/test_training_golden.cc computes the same.
"""
import gzip
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import OUT_DIR, save  # noqa: E402
from torch_models import TutorialCnn  # noqa: E402

PHI = 0.6180339887498949
PLASTIC = 0.3247179572447460
FMNIST = "/usr/share/datasets/fashion-mnist"


def formula(k, shape, bound):
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.float64)
    x = (i + 1.0) * PHI + float(k) * PLASTIC
    u = x - np.floor(x)
    return torch.from_numpy((bound * (2.0 * u - 1.0)).astype(np.float32).reshape(shape))


def optimizer_cases(out):
    torch.manual_seed(7)
    shapes = [(3, 4), (5,)]
    steps = 6
    cases = {
        "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), None),
        "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1,
                                                    weight_decay=0.01), None),
        "sgd_nesterov": (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                    weight_decay=0.001), None),
        "adam": (lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.9, 0.99), weight_decay=0.01), None),
        "adamw": (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), None),
        "sgd_clip": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5), 0.5),
        "adamw_nobc": (None, None),  # bias correction off: not in torch.optim, written out below
    }
    for name, (make, clip) in cases.items():
        params = [torch.randn(*s, requires_grad=True) for s in shapes]
        for j, p in enumerate(params):
            out[f"opt/{name}/p{j}/init"] = p.detach().clone()
        opt = make(params) if make else None
        state = [(torch.zeros(s), torch.zeros(s)) for s in shapes]
        for k in range(1, steps + 1):
            grads = [torch.randn(*s) * (3.0 if name == "sgd_clip" else 1.0) for s in shapes]
            for j, (p, g) in enumerate(zip(params, grads)):
                out[f"opt/{name}/step{k}/g{j}"] = g.clone()
                p.grad = g.clone()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            if opt is not None:
                opt.step()
            else:  # AdamW without bias correction, lr 0.01, weight decay 0.1, PyTorch's op order
                with torch.no_grad():
                    for p, (m, v) in zip(params, state):
                        p.mul_(1 - 0.01 * 0.1)
                        m.mul_(0.9).add_(p.grad, alpha=1 - 0.9)
                        v.mul_(0.999).addcmul_(p.grad, p.grad, value=1 - 0.999)
                        p.addcdiv_(m, v.sqrt().add_(1e-8), value=-0.01)
            for j, p in enumerate(params):
                out[f"opt/{name}/step{k}/p{j}"] = p.detach().clone()


def schedule_cases(out):
    p = [torch.zeros(1, requires_grad=True)]
    for name, make in {
        "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=0.001),
    }.items():
        opt = torch.optim.SGD(p, lr=0.1)
        sched = make(opt)
        lrs = []
        for _ in range(12):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        out[f"sched/{name}"] = torch.tensor(lrs, dtype=torch.float64).float()


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * d:8 + 4 * d], "big") for d in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def cnn_case(out, steps=20, batch=12):
    images = read_idx(os.path.join(FMNIST, "train-images-idx3-ubyte.gz"))[: steps * batch].copy()
    labels = read_idx(os.path.join(FMNIST, "train-labels-idx1-ubyte.gz"))[: steps * batch].astype(np.int64)
    model = TutorialCnn()
    bounds = []
    with torch.no_grad():
        for k, (name, p) in enumerate(model.state_dict().items()):
            if name.startswith("norm."):
                bound = 1.0  # GroupNorm affine: any values work; keep them O(1)
            else:
                layer = getattr(model, name.split(".")[0])
                fan_in = layer.weight[0].numel()
                bound = 1.0 / math.sqrt(fan_in)
            bounds.append(bound)
            p.copy_(formula(k, tuple(p.shape), bound))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x_all = torch.from_numpy(images).float().div(255.0).unsqueeze(1)
    losses = []
    for s in range(steps):
        x = x_all[s * batch:(s + 1) * batch]
        x = F.interpolate(x, size=(128, 128), mode="bilinear", align_corners=False)
        x = x.sub(0.5).div(0.5)
        y = torch.from_numpy(labels[s * batch:(s + 1) * batch])
        opt.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["cnn/images"] = torch.from_numpy(images)
    out["cnn/labels"] = torch.from_numpy(labels)
    out["cnn/bounds"] = torch.tensor(bounds, dtype=torch.float64).float()
    out["cnn/losses"] = torch.tensor(losses, dtype=torch.float32)
    print("tutorial-cnn losses:", " ".join(f"{v:.6f}" for v in losses))


def resize_case(out):
    """The loader's bilinear resize (u8 -> [0, 1] -> F.interpolate -> normalize by 0.5, 0.5)."""
    g = torch.Generator().manual_seed(3)
    img = torch.randint(0, 256, (3, 5, 7), generator=g, dtype=torch.uint8)
    x = F.interpolate(img.float().div(255.0).unsqueeze(0), size=(11, 11), mode="bilinear",
                      align_corners=False)[0]
    out["resize/in"] = img
    out["resize/out"] = x.sub(0.5).div(0.5)


def main():
    torch.set_num_threads(2)
    out = {}
    resize_case(out)
    optimizer_cases(out)
    schedule_cases(out)
    cnn_case(out)
    path = os.path.join(OUT_DIR, "training.safetensors")
    save(path, out, {"torch": torch.__version__, "script": "scripts/make_golden_training.py"})
    print(f"wrote {path}: {len(out)} tensors, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main()
