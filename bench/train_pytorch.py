#!/usr/bin/python3
"""PyTorch's side of bench/train_vs_pytorch.sh: trains a model on random data and prints images/s.

    /usr/bin/python3 bench/train_pytorch.py --model tutorial-cnn --batch-size 12 --steps 60
Models: tutorial-cnn (the PopTorch tutorial's CNN, 1x128x128) and resnet18 (torchvision's layout;
CIFAR stem 3x3/1 without max pool unless --imagenet-stem; 3x32x32). FP32, AdamW lr 1e-3.
Prints one line: "pytorch <model> batch <B>: <images/s> images/s (<ms> ms/step)".
"""
import argparse
import os
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from torch_models import ResNet18, TutorialCnn  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tutorial-cnn")
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--imagenet-stem", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.model == "tutorial-cnn":
        model, shape, loss_fn = TutorialCnn(), (1, 128, 128), nn.NLLLoss()
    else:
        model, shape, loss_fn = ResNet18(a.imagenet_stem), (3, 32, 32), nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(a.batch_size, *shape)
    y = torch.randint(0, 10, (a.batch_size,))
    model.train()
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    dt = time.perf_counter() - t0
    ips = a.steps * a.batch_size / dt
    print(f"pytorch {a.model} batch {a.batch_size}: {ips:.1f} images/s ({1000 * dt / a.steps:.1f} ms/step)")


if __name__ == "__main__":
    main()
