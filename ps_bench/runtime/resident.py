"""Objects that live on the rank ``rpc.remote`` made them on, called only through their RRef."""

from __future__ import annotations


def _not_sent(name: str) -> None:
    raise TypeError(f"a {name} lives on the rank that made it and is called through its RRef; "
                    f"it is never sent")


class Resident:
    """A trainer, a server or a floor's target: the master holds its RRef and calls its methods,
    and the object itself never crosses RPC.

    On a CUDA-RPC agent (device maps set), the owner of an RRef pickles its value when the value
    is set, to find the CUDA tensors a later ``to_here`` must wait for; a value that holds a
    process group or a DDP model cannot be pickled, and ``rpc.remote`` fails. A resident offers
    nothing to that pickle (it is never fetched, so there is nothing to wait for), and anything
    that does try to send one fails saying so."""

    def __reduce__(self):
        return _not_sent, (type(self).__name__,)
