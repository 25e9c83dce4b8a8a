"""imagenet-dp: data-parallel ResNet training on ImageNet-format datasets."""
