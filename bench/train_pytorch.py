#!/usr/bin/python3
"""PyTorch's side of bench/train_vs_pytorch.sh: trains a model on random data and prints images/s.

    /usr/bin/python3 bench/train_pytorch.py --model tutorial-cnn --batch-size 12 --steps 60
Models: tutorial-cnn (the PopTorch tutorial's CNN, 1x128x128) and resnet18 (torchvision's layout;
CIFAR stem 3x3/1 without max pool unless --imagenet-stem; 3x32x32). FP32, AdamW lr 1e-3.
Prints one line: "pytorch <model> batch <B>: <images/s> images/s (<ms> ms/step)".
"""
import argparse
import time

import torch
import torch.nn as nn


class TutorialCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 5, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(5, 12, 5)
        self.norm = nn.GroupNorm(3, 12)
        self.fc1 = nn.Linear(41772, 100)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(100, 10)
        self.log_softmax = nn.LogSoftmax(dim=1)

    def forward(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.norm(self.relu(self.conv2(x)))
        x = torch.flatten(x, start_dim=1)
        x = self.relu(self.fc1(x))
        return self.log_softmax(self.fc2(x))


class BasicBlock(nn.Module):
    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + (self.downsample(x) if self.downsample is not None else x))


class ResNet18(nn.Module):
    def __init__(self, imagenet_stem=False, classes=10):
        super().__init__()
        if imagenet_stem:
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        else:
            self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        layers, cin = [], 64
        for i, planes in enumerate([64, 128, 256, 512]):
            blocks = [BasicBlock(cin, planes, 1 if i == 0 else 2), BasicBlock(planes, planes, 1)]
            layers.append(nn.Sequential(*blocks))
            cin = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


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
