"""VGG19 for TinyImageNet (200 classes), as Han et al. trained it: a model builder for
``commpress predict --model examples/models/vgg19.py:vgg19`` (built on the meta device)."""

from torch import nn

LAYERS = [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
          512, 512, 512, 512, "M"]


def vgg19(num_classes: int = 200) -> nn.Module:
    layers: list[nn.Module] = []
    channels = 3
    for v in LAYERS:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, int(v), 3, padding=1), nn.ReLU(inplace=True)]
            channels = int(v)
    return nn.Sequential(
        *layers, nn.AdaptiveAvgPool2d(7), nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, num_classes),
    )
