"""Image classification: torchvision's ResNets and the classic benchmark CNNs (VGG-16, AlexNet,
Inception v3), random initialisation, on seeded synthetic images."""

from __future__ import annotations

import torch

from ps_bench.models.base import (DATA, HELD_OUT_STREAM, MODELS, RANDOM, TEACHER_STREAM,
                                  BenchmarkModel, Dataset, SyntheticData, need_positive, preset,
                                  stream)

IMAGES = "images"
DEPTHS = (18, 34, 50, 101, 152)


@DATA.register("SyntheticImages")
class SyntheticImages(SyntheticData):
    """Normally distributed images with uniformly drawn labels; teacher labels: the highest of
    ``num_classes`` seeded linear scores of the image average-pooled to 4 x 4 per channel."""

    gives = IMAGES
    teacher = ("the highest of seeded linear class scores of the image average-pooled to 4 x 4 "
               "per channel")
    POOLED = 4

    def __init__(self, sample_count: int, image_size: int = 224, channels: int = 3,
                 num_classes: int = 1000) -> None:
        need_positive(sample_count=sample_count, image_size=image_size, channels=channels,
                      num_classes=num_classes)
        self.sample_count, self.image_size, self.channels, self.num_classes = (
            sample_count, image_size, channels, num_classes)

    def build(self, seed: int, labels: str = RANDOM) -> Dataset:
        generator = torch.Generator().manual_seed(seed)
        images = self.images(self.sample_count, generator)
        if labels != RANDOM:
            return Dataset((images,), self.teach(images, seed))
        return Dataset((images,), torch.randint(0, self.num_classes, (self.sample_count,),
                                                generator=generator))

    def held_out(self, seed: int, count: int) -> Dataset:
        images = self.images(count, stream(seed, HELD_OUT_STREAM))
        return Dataset((images,), self.teach(images, seed))

    def images(self, count: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(count, self.channels, self.image_size, self.image_size,
                           generator=generator)

    def teach(self, images: torch.Tensor, seed: int) -> torch.Tensor:
        pooled = torch.nn.functional.adaptive_avg_pool2d(
            images, min(self.POOLED, self.image_size)).flatten(1)
        weights = torch.randn(pooled.shape[1], self.num_classes,
                              generator=stream(seed, TEACHER_STREAM))
        return (pooled @ weights).argmax(dim=1)


class ImageClassifier(BenchmarkModel):
    """A torchvision network (``self.network``) on 3-channel images, ``num_classes`` outputs;
    ``label`` names it in what ``fits`` says."""

    takes = IMAGES
    label = "the model"

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.network(images)

    def fits(self, data: SyntheticData) -> str | None:
        if data.channels != 3:
            return f"has {data.channels} channels but {self.label} takes 3"
        if data.num_classes > self.num_classes:
            return f"has {data.num_classes} classes but the model outputs {self.num_classes}"
        return None


@MODELS.register("ResNet")
class ResNet(ImageClassifier):
    """torchvision's ResNet of the given depth; ``layers`` overrides its blocks per stage (the
    small variants use one block per stage)."""

    label = "ResNet"
    min_batch_size = 2  # BatchNorm needs more than one value per channel in training

    def __init__(self, depth: int = 18, num_classes: int = 1000,
                 layers: list[int] | None = None) -> None:
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"depth must be one of {', '.join(map(str, DEPTHS))}; got {depth!r}")
        need_positive(num_classes=num_classes)
        if layers is not None:
            if not isinstance(layers, list) or len(layers) != 4:
                raise ValueError(f"layers must be a list of 4 block counts, one per stage; "
                                 f"got {layers!r}")
            need_positive(**{f"layers[{i}]": count for i, count in enumerate(layers)})
        try:
            # only runs that build a ResNet pay for the import
            from torchvision.models import resnet
        except ImportError as error:
            raise ValueError(f"ResNet needs torchvision, which did not import ({error}); "
                             f"install the pinned torch and torchvision as the README's quick "
                             f"start does") from None

        block = resnet.BasicBlock if depth < 50 else resnet.Bottleneck
        blocks = layers or {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3],
                            101: [3, 4, 23, 3], 152: [3, 8, 36, 3]}[depth]
        self.num_classes = num_classes
        self.network = resnet.ResNet(block, blocks, num_classes=num_classes)


# torchvision's builders
CLASSIC = {"vgg16": "vgg16", "alexnet": "alexnet", "inception_v3": "inception_v3"}


@MODELS.register("TorchvisionCNN")
class TorchvisionCNN(ImageClassifier):
    """A classic benchmark CNN from torchvision (``arch``: vgg16, alexnet, inception_v3), as
    published (no batch norm for VGG-16 and AlexNet); Inception v3 without its auxiliary
    classifier (a training-time second output). VGG-16 is the standard communication-bound
    case: 138 M parameters, 90 % of them in its fully connected layers, for little compute."""

    def __init__(self, arch: str = "vgg16", num_classes: int = 1000) -> None:
        super().__init__()
        if arch not in CLASSIC:
            raise ValueError(f"arch must be one of {', '.join(CLASSIC)}; got {arch!r}")
        need_positive(num_classes=num_classes)
        try:
            from torchvision import models  # only runs that build one pay for the import
        except ImportError as error:
            raise ValueError(f"{arch} needs torchvision, which did not import ({error}); "
                             f"install the pinned torch and torchvision as the README's quick "
                             f"start does") from None
        options = {"aux_logits": False, "init_weights": True} if arch == "inception_v3" else {}
        self.arch, self.label, self.num_classes = arch, arch, num_classes
        self.min_batch_size = 2 if arch == "inception_v3" else 1  # its BatchNorm
        self.network = getattr(models, CLASSIC[arch])(weights=None, num_classes=num_classes,
                                                      **options)

    def fits(self, data: SyntheticData) -> str | None:
        unfit = super().fits(data)
        if unfit is not None:
            return unfit
        smallest = 75 if self.arch == "inception_v3" else 32 if self.arch == "vgg16" else 63
        if data.image_size < smallest:
            return f"has images of {data.image_size} pixels, smaller than {self.arch}'s {smallest}"
        return None


preset("resnet18", "ResNet", {"depth": 18}, "images224", "SyntheticImages",
       {"sample_count": 128, "image_size": 224})
preset("resnet50", "ResNet", {"depth": 50}, "images224")
preset("resnet101", "ResNet", {"depth": 101}, "images224")
preset("resnet152", "ResNet", {"depth": 152}, "images224")
preset("vgg16", "TorchvisionCNN", {"arch": "vgg16"}, "images224")
preset("alexnet", "TorchvisionCNN", {"arch": "alexnet"}, "images224")
preset("inception_v3", "TorchvisionCNN", {"arch": "inception_v3"}, "images299", "SyntheticImages",
       {"sample_count": 128, "image_size": 299})
preset("resnet18_small", "ResNet", {"depth": 18, "num_classes": 10, "layers": [1, 1, 1, 1]},
       "images32", "SyntheticImages", {"sample_count": 32, "image_size": 32, "num_classes": 10},
       small_of="resnet18")
preset("resnet50_small", "ResNet", {"depth": 50, "num_classes": 10, "layers": [1, 1, 1, 1]},
       "images32", small_of="resnet50")
