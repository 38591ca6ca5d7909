import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0  # what the GPU tests run on
