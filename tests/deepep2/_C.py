"""deep_ep._C for DeepEP 2's test helpers on ferry (a test aid, put in the
package tests/deepep2.sh assembles): the few names its deep_ep/utils reach
at import and in tests/elastic/test_ep.py. Nothing here is DeepEP's."""
import torch

from ferry.deep_ep import Config, topk_idx_t  # noqa: F401


class EventHandle:
    """An event recorded on the current stream when made."""

    def __init__(self):
        self.event = torch.cuda.Event()
        self.event.record()

    def current_stream_wait(self):
        torch.cuda.current_stream().wait_event(self.event)


def init_jit(*args):
    """ferry compiles nothing at run time."""


def destroy_nccl_comm(comm):
    """ferry makes no NCCL communicator."""


def _no_nccl(*args):
    raise NotImplementedError("deep_ep on ferry: no NCCL communicator (ElasticBuffer runs on "
                              "ferry's own transport)")


get_local_nccl_unique_id = create_nccl_comm = _no_nccl
get_physical_domain_size = get_logical_domain_size = _no_nccl
