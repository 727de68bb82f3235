"""The PyTorch twins of Mantissa's models, shared by the golden-data scripts and the side-by-side
benchmark: parameter names, shapes and registration order (hence initialisation order) as in
torchvision and the PopTorch tutorial."""
import torch
import torch.nn as nn


class TutorialCnn(nn.Module):
    """The PopTorch half-precision tutorial's model, log-softmax over the classes (dim=1; the
    seed's dim=0 is a bug). fc1 has 12 * s * s inputs, s = (image - 2) // 2 - 4: 41772 at 128."""

    def __init__(self, image=128):
        super().__init__()
        side = (image - 2) // 2 - 4
        self.conv1 = nn.Conv2d(1, 5, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(5, 12, 5)
        self.norm = nn.GroupNorm(3, 12)
        self.fc1 = nn.Linear(12 * side * side, 100)
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
    """torchvision's ResNet BasicBlock; a 1x1 downsampling shortcut when the shape changes."""

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
    """torchvision's resnet18 layout; the CIFAR stem (3x3/1, no max pool) unless imagenet_stem."""

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
            layers.append(nn.Sequential(BasicBlock(cin, planes, 1 if i == 0 else 2), BasicBlock(planes, planes, 1)))
            cin = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
