"""What a CUDA-RPC agent does with an RRef's value, on the objects the master holds by RRef."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from torch._jit_internal import _extract_tensors  # what OwnerRRef::setValue calls with device maps set

from ps_bench.metrics.limits import RpcFloorTarget
from ps_bench.runtime.resident import Resident
from ps_bench.servers.base import ParameterServer
from ps_bench.servers.ssp import StaleSynchronousServer
from ps_bench.trainers.ssp import StaleSynchronousTrainer
from ps_bench.trainers.trainer import DdpTrainer


class Holder:
    """Stands for a trainer: tensors beside something no pickle takes (a process group, DDP)."""

    def __init__(self) -> None:
        self.weights = torch.ones(3)
        self.unpicklable = (lambda: None)
        self.lock = threading.Lock()


class ResidentHolder(Resident, Holder):
    pass


def test_an_object_that_holds_what_no_pickle_takes_fails_the_extraction():
    with pytest.raises(Exception, match="pickle"):
        _extract_tensors(Holder())


def test_a_resident_passes_the_extraction_and_is_never_sent():
    assert _extract_tensors(ResidentHolder()) == []
    with pytest.raises(TypeError, match="ResidentHolder lives on the rank that made it"):
        pickle.loads(pickle.dumps(ResidentHolder()))


@pytest.mark.parametrize("cls", [DdpTrainer, StaleSynchronousTrainer, ParameterServer, StaleSynchronousServer,
                                 RpcFloorTarget])
def test_every_class_the_master_makes_with_rpc_remote_is_resident(cls):
    assert issubclass(cls, Resident)
