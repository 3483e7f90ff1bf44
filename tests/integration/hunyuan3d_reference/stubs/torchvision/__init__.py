"""A small torchvision stand-in for the reference test only (`import torchvision` fails on this machine): the
reference conditioner uses just `transforms.Compose / Resize / CenterCrop / Normalize` on tensors."""
