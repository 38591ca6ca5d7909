"""ps_bench: a benchmark suite for gradient synchronisation in data-parallel PyTorch training."""

import os

__version__ = "0.1.0"

# One intra-op thread per rank unless OMP_NUM_THREADS says otherwise, set here so that it is in
# the environment before torch loads in every rank (spawned ranks inherit it; torchrun ranks
# import ps_bench first). torch.set_num_threads(1) would not do: OpenMP and MKL keep the count
# per thread, and the gloo and TensorPipe threads that run hook callbacks would split their
# kernels in two, rounding differently from the main thread. PowerSGD computes in those
# callbacks, so trainers would end with replicas an ulp apart.
os.environ.setdefault("OMP_NUM_THREADS", "1")
