"""A drop-in subset of DeepEP's Buffer, low-latency mode, on ferry.

    from ferry import deep_ep
    buf = deep_ep.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=hint,
                         low_latency_mode=True, num_qps_per_rank=1)
    recv_x, recv_count, handle, event, hook = buf.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True)
    # recv_x: (fp8 [E_local, N*T, H], fp32 scales [E_local, N*T, H/128]),
    #         or bf16 [E_local, N*T, H] when use_fp8=False
    y = experts(recv_x, recv_count)           # [E_local, N*T, H] bf16
    out, event, hook = buf.low_latency_combine(y, topk_idx, topk_weights, handle)

On rank r, the rows of each expert come from source ranks r, r + 1, ...,
N - 1, 0, ..., r - 1 (its own tokens first, wrapping around), each in
token order. handle is DeepEP's (recv_src_info, recv_layout_range, T, H,
E); handle.src_rank gives each row's source rank.

Buffers: the tensors a call returns (recv_x, its scales, recv_count, the
handle's src_rank/src_token, combine's output when `out` is not given)
are allocated once per context and buffer set, and reused two rounds
later (rounds alternate between two sets, like ferry's own buffers): copy
them if they must outlive the next dispatch after next. A call does no
allocation, no synchronisation and no host read of device data, so it can
be captured in a CUDA graph. Arguments ferry does not support
raise a clear error naming them (see docs/python.md for the mapping).
Tensors are checked before use (TypeError for a wrong type or dtype,
ValueError for a wrong shape or device, naming the argument); inputs are
made contiguous here (a copy when they are not; the normal-mode
dispatch's float32 [T, H/128] scales excepted: their strides go to the
engine, which reads them in place), `out` must already be.
"""
import ctypes as C
import operator
import os
import weakref

import torch

from . import Comm, FerryError
from . import _group_info, _is_mpi_comm, _lib, _lib_handle
from ._compat import Config, _UnsetSms
from ._deep_ep_ll import _LowLatency
from ._deep_ep_normal import _Normal

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t", "ElasticBuffer", "EPHandle"]

#: dtype of topk_idx (DeepEP's later versions name it; int64 everywhere here)
topk_idx_t = torch.int64


from ._deep_ep_common import EventOverlap, _parse_shapes
from ._deep_ep_common import _layout_c, _layout_torch  # noqa: F401  (tools/bench_layout.py, tests)


def _node_and_gpu():
    """This rank's node as ferry names it (FERRY_NODE_ID, else the host
    name), its host name, and its GPU's UUID (None without CUDA)."""
    import socket
    host = socket.gethostname()
    node = os.environ.get("FERRY_NODE_ID") or host
    if not torch.cuda.is_available():
        return node, host, None
    dev = torch.cuda.current_device()
    return node, host, str(getattr(torch.cuda.get_device_properties(dev), "uuid", dev))


def _default_sms(everyone, me):
    """The SMs a context's kernels may use by default: the device's, shared
    evenly among the group's ranks on the same GPU (ranks sharing a GPU
    under MPS must leave room for each other's senders: waiting blocks
    hold SMs). everyone: every rank's _node_and_gpu(); me: this rank's.
    A GPU is its host and UUID (ranks of "nodes" in network namespaces of
    one host share its GPUs)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    everyone = [o[1:] for o in everyone]
    me = me[1:]
    sharing = max(1, sum(1 for o in everyone if o == me))
    return max(1, props.multi_processor_count // sharing)


class _Runtime:
    """DeepEP's Buffer.runtime, for the queries engines make of it (DeepEP's
    C++ object has more: its set-up and kernels, which ferry does not
    have). Ranks per node and nodes come from ferry's node names
    (FERRY_NODE_ID, else the host name), not from DeepEP's arithmetic of 8
    GPUs per node: get_num_rdma_ranks() is the group's nodes,
    get_rdma_rank() this rank's node among them (in order of their first
    rank), get_root_rdma_rank(global) its place on its node when global
    (DeepEP's nvl_rank) else 0, is_internode_available() whether the group
    spans nodes."""

    def __init__(self, buf, nodes):
        self._buf = weakref.ref(buf)
        order = list(dict.fromkeys(nodes))
        me = nodes[buf.rank]
        self._nnodes, self._node = len(order), order.index(me)
        self._node_of = [order.index(n) for n in nodes]  # each rank's node (RDMA rank)
        self._node_t = {}  # _node_of as a tensor, per device (_nodes_on)
        self._local = sum(1 for n in nodes[:buf.rank] if n == me)

    def _nodes_on(self, device):
        """Each rank's node as an int64 tensor on `device`, made at the first
        call for that device (get_dispatch_layout's per-node counts; later
        calls copy nothing, so they can be captured in a CUDA graph)."""
        t = self._node_t.get(device)
        if t is None:
            t = self._node_t[device] = torch.tensor(self._node_of, dtype=torch.int64,
                                                    device=device)
        return t

    def _ranks_per_node(self):
        """n when the nodes are blocks of n consecutive ranks (the last may
        be smaller), else 0."""
        n = self._node_of.count(self._node_of[0]) if self._node_of else 0
        ok = n > 0 and all(b == i // n for i, b in enumerate(self._node_of))
        return n if ok else 0

    def is_available(self):
        b = self._buf()
        return b is not None and b._scratch is not None  # until destroy()

    def is_internode_available(self):
        return self.is_available() and self._nnodes > 1

    def get_num_rdma_ranks(self):
        return self._nnodes

    def get_rdma_rank(self):
        return self._node

    def get_root_rdma_rank(self, global_):
        return self._local if global_ else 0

    def get_local_device_id(self):
        """The current CUDA device (-1 without CUDA)."""
        return torch.cuda.current_device() if torch.cuda.is_available() else -1

    def get_comm_stream(self):
        b = self._buf()
        return b.get_comm_stream() if b is not None else None

    def __getattr__(self, name):
        raise AttributeError(f"runtime.{name}: ferry.deep_ep's runtime answers DeepEP's queries "
                             f"only (is_available, is_internode_available, get_num_rdma_ranks, "
                             f"get_rdma_rank, get_root_rdma_rank, get_local_device_id, "
                             f"get_comm_stream)")


# Buffer.num_sms until it is set (_compat._UnsetSms): DeepEP's default, 20,
# to engines that compute with it (SGLang without --deepep-config takes
# max(Buffer.num_sms, experts per rank) and compares it with the GPU's SMs),
# while ferry's kernels keep ferry's default.




class Buffer(_LowLatency, _Normal):
    """num_sms (DeepEP's knob, set on the class, the instance or by
    set_num_sms): the SMs of the normal mode's kernels, as in DeepEP. Until
    it is set it reads as DeepEP's default, 20, and ferry's normal-mode
    kernels take ferry's default: the GPU's multiprocessors divided by the
    ranks of the group on it (None means the same). The low-latency
    kernels ignore it, as DeepEP's do (they take the whole GPU): ferry's
    own ferry_ll_sms (None: that default) sets theirs. Both are read when
    a shape's context is made (its first call, or Buffer())."""
    num_sms = _UnsetSms(20)
    ferry_ll_sms = None

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True,
                 allow_mnnvl=False, explicitly_destroy=False, comm=None, enable_shrink=False, *,
                 use_fabric=False, ferry_shapes=None, **unsupported):
        if unsupported:
            raise TypeError("ferry.deep_ep.Buffer: unsupported argument(s): "
                            + ", ".join(sorted(unsupported)))
        # low-latency shapes declared up front (ferry_shapes, else
        # FERRY_DEEP_EP_SHAPES): their contexts and buffers made at the end
        # of Buffer(), collectively, as DeepEP allocates there; other shapes
        # are still made at their first call
        src = "ferry_shapes" if ferry_shapes is not None else "FERRY_DEEP_EP_SHAPES"
        shapes = _parse_shapes(ferry_shapes if ferry_shapes is not None
                               else os.environ.get("FERRY_DEEP_EP_SHAPES", ""), src)
        if shapes and not low_latency_mode:
            if ferry_shapes is not None:
                raise ValueError(f"{src}: low-latency shapes, but the buffer is made with "
                                 f"low_latency_mode=False")
            shapes = []  # the variable is for the process's low-latency buffers
        # allow_mnnvl: DeepEP's "use multi-node NVLink if present". ferry has
        # no multi-node NVLink path: ranks of this node use NVLink peer
        # memory, others the fabric, whatever the flag says.
        self.allow_mnnvl = bool(allow_mnnvl)
        # use_fabric (SGLang passes it on CUDA 13 with multi-node NVLink, for
        # DeepEP builds that allocate through CUDA's fabric handles): kept
        # and ignored likewise, ferry's peer memory is its own
        self.use_fabric = bool(use_fabric)
        # kept as DeepEP keeps it; destroy() releases everything either way
        self.explicitly_destroy = bool(explicitly_destroy)
        # enable_shrink (DeepEP after v1.2.1): a low-latency wait that runs
        # out masks the silent rank instead of failing (ferry's
        # mask_on_timeout; ranks of one node only)
        self.enable_shrink = bool(enable_shrink)
        # normal mode (on every buffer): ferry's high-throughput engine
        # (EP(mode="ht")), one context per (experts, topk, hidden); the
        # low-latency calls need low_latency_mode=True
        self.low_latency_mode = bool(low_latency_mode)
        # the ranks: a torch.distributed group (None: the default one), or,
        # when group is None, DeepEP's `comm`, an mpi4py communicator (its
        # collectives then run on host copies)
        self._mpi = None
        if group is None and comm is not None:
            if not _is_mpi_comm(comm):
                raise TypeError(f"comm: expected an mpi4py communicator (Get_rank, Get_size, "
                                f"Allgather, Allreduce), got {type(comm).__name__}")
            self._mpi = comm
            self.group = comm
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()
        else:
            self.group = group
            self.rank, self.group_size, _ = _group_info(group)
        self.num_rdma_bytes = num_rdma_bytes
        self.num_nvl_bytes = num_nvl_bytes
        self._scratch = {}  # get_local_buffer_tensor's buffers, made at its first call
        self.comm = Comm(self.group)  # the group, the mpi4py comm, or None: the environment
        self._eps = {}
        self._plans = {}
        self._masked = set()  # ranks masked (low_latency_update_mask_buffer)
        self._sms_warned = False  # _ht_sms_check's one warning
        self._comm_streams = {}  # device -> the normal mode's own stream (_call_stream)
        # every rank's node and GPU (collective): the default SMs, and what
        # runtime reports of the nodes
        me = _node_and_gpu()
        everyone = self._gather_obj(me)
        self._sms = _default_sms(everyone, me) if torch.cuda.is_available() else 16
        self.runtime = _Runtime(self, [o[0] for o in everyone])
        try:
            for E, K, H, T, kind in shapes:
                self._make_shape(E, K, H, T, kind)
        except BaseException:
            self.destroy()  # collective, as the failed creation was
            raise

    def _kernel_sms(self, mode):
        """The SMs a new context's kernels get (mode "ht" or "ll"): num_sms
        (normal mode) or ferry_ll_sms (low latency) once set, else ferry's
        default for this group (see the class)."""
        v = self.num_sms if mode == "ht" else self.ferry_ll_sms
        return self._sms if v is None or isinstance(v, _UnsetSms) else v

    def _gather_obj(self, obj):
        """Every rank's obj, in rank order (collective)."""
        if self._mpi is not None:
            return self._mpi.allgather(obj)
        everyone = [None] * self.group_size
        torch.distributed.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def _make_shape(self, E, K, H, T, kind):
        """A declared shape's context (and, on a GPU, its plan: the buffers
        the calls use), as the first low_latency_dispatch of that shape
        would make them."""
        fp8, rs, ue = kind != "bf16", kind in ("fp8_round", "fp8_ue8m0"), kind == "fp8_ue8m0"
        if torch.cuda.is_available():
            x = torch.empty(0, device=torch.device("cuda", torch.cuda.current_device()))
            # (the zero-copy combine inputs, [E_local, N*T, H] bf16 per buffer
            # set, stay made at the first get_next_low_latency_combine_buffer:
            # most callers never ask, and they are large)
            self._plan(x, E, K, H, T, fp8, rs, ue)
        else:
            self._ep(E, K, H, T, fp8, "cpu", rs, ue)

    @classmethod
    def set_num_sms(cls, new_num_sms):
        """DeepEP's name: the SMs of the normal mode's kernels (contexts
        created from then on; the low-latency ones take ferry_ll_sms)."""
        try:
            n = operator.index(new_num_sms)  # numpy ints too; not bools or floats
        except TypeError:
            n = None
        if n is None or isinstance(new_num_sms, bool) or n < 1:
            raise ValueError(f"new_num_sms: expected a positive int, got {new_num_sms!r}")
        cls.num_sms = _lib.c_int(n, "new_num_sms")

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                       num_experts):
        """Bytes of ferry's receive buffers per rank for this shape (both
        dtypes, two buffer sets); informational: ferry allocates its own."""
        T, H, N = num_max_dispatch_tokens_per_rank, hidden, num_ranks
        K = 16  # upper bound on top-k
        El = num_experts // max(1, N)
        kmax = min(K, El)

        def up(v, a):
            return (v + a - 1) // a * a
        # core/layout.h: record header with le[kmax] and pos[kmax], the
        # slice header with the sender's rows per local expert
        rec_hdr = up(up(12 + 2 * kmax, 4) + 4 * kmax, 16)
        rec = up(rec_hdr + 2 * H + (H // 128) * 4, 16)
        dispatch = 2 * N * (up(64 + 4 * El, 64) + T * rec)
        combine = 2 * T * K * 2 * H
        return ((dispatch + combine + 4096 + 2 * 2 * N * 64) + (1 << 20) - 1) // (1 << 20) * (1 << 20)

    @staticmethod
    def is_sm90_compiled():
        """True when this libferry has GPU kernels (ferry builds sm_90 and
        sm_100 code with PTX whenever nvcc is found) and, when a GPU is
        visible, it is sm_90 or later. Unlike DeepEP's (a constant of the
        build) it asks the CUDA runtime for the devices."""
        why = C.create_string_buffer(256)
        if _lib_handle().ferry_cuda_available(why, 256):
            return torch.cuda.get_device_capability()[0] >= 9
        return b"no CUDA kernels" not in why.value

    @staticmethod
    def capture():
        """An EventOverlap holding an event recorded on the current
        stream."""
        ev = torch.cuda.Event()
        ev.record()
        return EventOverlap(ev)

    @staticmethod
    def get_dispatch_config(num_ranks):
        """A Config with DeepEP's defaults and, as DeepEP's, Buffer.num_sms
        (unset: ferry's default SMs where it is used). dispatch and combine
        take the SMs of the config given to a shape's first call; ferry's
        high-throughput engine sizes its own rings (ring_tokens)."""
        n = Buffer.num_sms
        try:  # set_num_sms takes positive ints only; anything else set by hand: unset
            n = operator.index(n) if n is not None and not isinstance(n, (bool, _UnsetSms)) \
                else None
        except TypeError:
            n = None
        return Config(num_sms=_UnsetSms(20) if n is None or n < 1 else n)

    @staticmethod
    def get_combine_config(num_ranks):
        """A Config with DeepEP's defaults and Buffer.num_sms (see
        get_dispatch_config)."""
        return Buffer.get_dispatch_config(num_ranks)

    # ------------------------------------------------------------ normal mode

    def _low_latency(self, what):
        if not self.low_latency_mode:
            raise RuntimeError(f"ferry.deep_ep.Buffer.{what}: low-latency call on a buffer made "
                               "with low_latency_mode=False")

    # Normal-mode calls run on every Buffer, as DeepEP's do: one made with
    # low_latency_mode=True serves both modes (SGLang's --deepep-mode auto:
    # normal-mode prefill and low-latency decode on one buffer); its
    # contexts of each mode are apart.

    @staticmethod
    def _not_capturing(what, key):
        """A context is made at the first call of its shape (collective,
        allocating): refused inside a CUDA-graph capture, where it would
        break the capture, before anything reaches CUDA."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise FerryError(-1, f"ferry.deep_ep: {what} of a new shape {key} inside a CUDA "
                                 f"graph capture: its first call creates a ferry context "
                                 f"(collective, allocates memory), which a capture cannot "
                                 f"hold; make one such call before capturing (an engine's "
                                 f"warm-up does)")

    @staticmethod
    def _config_sms(config, what):
        """The SMs a Config passed to dispatch or combine asks for, or None
        (no config, or its num_sms unset)."""
        n = getattr(config, "num_sms", None)
        if n is None or type(n) is _UnsetSms:  # no config, or one that sets no SMs
            return None
        try:
            v = operator.index(n)  # ints, numpy ints; not floats
        except TypeError:
            v = None
        if v is None or isinstance(n, bool):
            raise TypeError(f"ferry.deep_ep.Buffer.{what}: config.num_sms: expected an int, got "
                            f"{n!r}")
        return _lib.c_int(v, f"ferry.deep_ep.Buffer.{what}: config.num_sms") if v >= 1 else None

    def get_comm_stream(self):
        """DeepEP's communication stream: the stream of this Buffer's on the
        current device where normal-mode calls run (after previous_event or
        the current stream; see dispatch), None without CUDA. Low-latency
        calls run on the current stream."""
        if not torch.cuda.is_available():
            return None
        return self._comm_stream(torch.cuda.current_device())

    def get_local_buffer_tensor(self, dtype, size=None, offset=0, use_rdma_buffer=False):
        """DeepEP's raw buffer as a tensor of `dtype`, from byte `offset`
        (DeepEP's unit) to the end, or its first size.numel() elements shaped
        `size`. ferry's communication memory holds flags and counters that a
        write would corrupt, so this is a buffer of its own: num_rdma_bytes
        (use_rdma_buffer) or num_nvl_bytes as given to Buffer(), zeroed, made
        on this rank's device at the first call and kept until destroy().
        Engines that use it as workspace or zero it (vLLM's shrink path)
        work; ferry never reads it, and it costs that much memory: make the
        first call before sizing other memory (a KV cache) and outside a
        CUDA-graph capture (refused there: the allocation would belong to
        the graph)."""
        if self._scratch is None:
            raise RuntimeError("get_local_buffer_tensor: the buffer was destroyed")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
        kind = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        try:
            nbytes = operator.index(nbytes)
        except TypeError:
            raise TypeError(f"{kind}: expected an int, got {nbytes!r}") from None
        if nbytes < 0:
            raise ValueError(f"{kind}: {nbytes} bytes given to Buffer()")
        try:
            offset = operator.index(offset)
        except TypeError:
            raise TypeError(f"offset: expected an int (bytes), got {offset!r}") from None
        es = torch.empty(0, dtype=dtype).element_size()
        if offset < 0 or offset > nbytes or offset % es:
            raise ValueError(f"offset: {offset} bytes: expected a multiple of {es} ({dtype}) "
                             f"in 0..{nbytes} ({kind} given to Buffer())")
        raw = self._scratch.get(kind)
        if raw is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("get_local_buffer_tensor: its first call makes the buffer, "
                                   "which a CUDA-graph capture would own: call it once before "
                                   "capturing")
            dev = (torch.device("cuda", torch.cuda.current_device())
                   if torch.cuda.is_available() else torch.device("cpu"))
            raw = self._scratch[kind] = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        n = (nbytes - offset) // es
        t = raw[offset:offset + n * es].view(dtype)
        if size is None:
            return t
        try:
            shape = (operator.index(size),) if not hasattr(size, "__len__") else \
                tuple(operator.index(d) for d in size)
        except TypeError:
            raise TypeError(f"size: expected a torch.Size or a sequence of ints, got "
                            f"{size!r}") from None
        want = 1
        for d in shape:
            want *= d
        if any(d < 0 for d in shape) or want > n:
            raise ValueError(f"size: {shape} is {want} elements, the buffer holds {n} "
                             f"of {dtype} from offset {offset} ({kind} {nbytes})")
        return t[:want].view(shape)

    def destroy(self):
        self._scratch = None  # get_local_buffer_tensor refuses from now on
        self._plans.clear()
        self._plain_ctx = self._layout_ctx = None
        for ep in self._eps.values():
            ep.close()
        self._eps.clear()
        self.comm.close()


# DeepEP 2's V2 API on the same contexts (its normal mode runs on Buffer's)
from ._deep_ep_elastic import ElasticBuffer, EPHandle  # noqa: E402
ElasticBuffer._legacy = Buffer
