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
import contextlib
import ctypes as C
import functools
import operator
import os
import warnings
import weakref

import torch

from . import Comm, EP, FerryError
from . import _elem_strides, _fmt_shape, _group_info, _is_mpi_comm, _lib, _lib_handle
from ._compat import Config, _UnsetSms

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]

#: dtype of topk_idx (DeepEP's later versions name it; int64 everywhere here)
topk_idx_t = torch.int64


class EventOverlap:
    """DeepEP's event object: event (a CUDA event, or None: ferry's work is
    already on the current stream) and extra_tensors (kept alive with it,
    DeepEP's stand-in for record_stream). Leaving a `with` block makes the
    current stream wait for the event, as DeepEP's does."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self):
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()


def _as_list(a):
    """A numpy array's or a tensor's values as a list of ints (a CUDA tensor
    in one copy)."""
    return [int(v) for v in (a.tolist() if hasattr(a, "tolist") else a)]


def _tensor(t, name, dtype=None, shape=None):
    """t is a torch tensor (of dtype and shape: None or a str entry any size,
    a str naming it in the message); the message is built only when a check
    fails (this runs on every call)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(_mismatch(t, name, dtype, shape))
    if shape is not None:
        ts = t.shape
        if len(ts) != len(shape) or any(n is not None and type(n) is not str and n != m
                                        for n, m in zip(shape, ts)):
            raise ValueError(_mismatch(t, name, dtype, shape))


def _mismatch(t, name, dtype, shape):
    want = " ".join(p for p in (
        _fmt_shape(["T" if n is None else n for n in shape]) if shape is not None else "",
        str(dtype).replace("torch.", "") if dtype is not None else "") if p)
    if shape is not None:
        want = "shape " + want
    got = f"{_fmt_shape(tuple(t.shape))} {str(t.dtype).replace('torch.', '')}"
    return f"{name}: expected {want}, got {got}"


_EVENT = None


#: torch's switch for __torch_function__ handling: under a mode such as
#: torch.set_default_device's (DeepEP's tests set one), every tensor method
#: call from Python goes through the mode (about 1 us each); the low-latency
#: calls and the normal mode's get_dispatch_layout, dispatch and combine make
#: a few dozen of them, so they run with it off. Every tensor they allocate
#: names its device.
_NO_TORCH_FUNCTION = getattr(torch._C, "DisableTorchFunction", None)


def _plain_torch(fn):
    """fn run with __torch_function__ handling off (see above)."""
    if _NO_TORCH_FUNCTION is None:
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with _NO_TORCH_FUNCTION():
            return fn(*args, **kwargs)
    return run


def _no_event():
    global _EVENT
    if _EVENT is None:
        _EVENT = EventOverlap()
    return _EVENT


def _event_after(x):
    """async_finish: a real CUDA event recorded on the current stream after
    ferry's launches, for CUDA tensors; CPU calls have finished (no event)."""
    if isinstance(x, torch.Tensor) and x.is_cuda:
        return Buffer.capture()
    return _no_event()


def _recv_or_hook(recv, return_recv_hook):
    """DeepEP's receive hook: the receive to call later, or done now (None)."""
    if return_recv_hook:
        return recv
    recv()
    return None


class _Tok:
    """A handle's token: the plan keeps a weak reference to it, to tell a
    dropped handle from one still held; settled: its round was combined
    from scratch to free its buffer set (a later combine of the handle
    dispatches its routing again)."""
    __slots__ = ("__weakref__", "settled")

    def __init__(self):
        self.settled = False


class _LLHandle(tuple):
    """A low-latency dispatch's handle, shaped as DeepEP's: (recv_src_info
    int32 [E_local, N*T]: each row's token at its source; recv_layout_range
    int64 [E_local, N]: begin << 32 | count of each source rank's rows;
    num_max_dispatch_tokens_per_rank, hidden, num_experts). Rows of an
    expert come from sources rank, rank + 1, ... (wrapping), so a source's
    rows are one run. recv_layout_range is worked out from the rows'
    sources when first read (a few small torch kernels); like recv_x, both
    stay valid until the buffer set is reused two rounds later. ferry's
    own state rides as attributes."""

    def __new__(cls, plan, ep, rnd, src_rank, src_token, count, ntok, maxT, H, E):
        h = tuple.__new__(cls, (src_token, None, maxT, H, E))
        h.plan, h.ep, h.rnd, h.src_rank, h.count, h.ntok = plan, ep, rnd, src_rank, count, ntok
        h._lr = None
        h.topk_idx = None  # the routing, for a second combine (fast path)
        h.combined = False
        h._tok = _Tok()    # alive while the handle is (a tuple cannot be weakly referenced)
        return h

    def _layout_range(self):
        if self._lr is None:
            sr, cnt, ep = self.src_rank, self.count, self.ep
            N, r = ep.num_ranks, ep.rank
            El, cap = sr.shape
            valid = torch.arange(cap, device=sr.device).view(1, -1) < cnt.view(-1, 1)
            src = torch.where(valid, sr.long(), torch.full_like(sr, N, dtype=torch.long))
            counts = torch.zeros((El, N + 1), dtype=torch.int64, device=sr.device)
            counts.scatter_add_(1, src, torch.ones_like(src))
            counts = counts[:, :N]
            order = torch.tensor([(r + q) % N for q in range(N)], device=sr.device)
            c_rot = counts[:, order]
            begin = torch.empty_like(counts)
            begin[:, order] = torch.cumsum(c_rot, 1) - c_rot
            self._lr = (begin << 32) | counts
        return self._lr

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(5)))
        if i in (1, -4):
            return self._layout_range()
        return tuple.__getitem__(self, i)

    def __iter__(self):
        return iter([self[j] for j in range(5)])


class _Plan:
    """One context's reusable state: the output tensors of each buffer set,
    the argument structs, and the C entry points (no per-call allocation)."""

    def __init__(self, ep, fp8, dev):
        El, cap, H, K = ep.num_local_experts, ep.capacity, ep.hidden, ep.topk
        self.ep, self.fp8, self.T = ep, fp8, ep.max_tokens
        self.dev = dev.index if dev.index is not None else torch.cuda.current_device()
        self.yshape = (El, cap, H)
        self.sets = []
        for _ in range(2):
            rx = torch.empty((El, cap, H), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                             device=dev)
            # DeepEP's layout: column-major in the last two dims (float32, or
            # UE8M0 words), written so by the kernel
            sc = ep.new_expert_scales(torch, torch.float32, torch.int32, dict(device=dev)) \
                if fp8 else None
            cnt = torch.empty(El, dtype=torch.int32, device=dev)
            sr = torch.empty((El, cap), dtype=torch.int32, device=dev)
            st = torch.empty((El, cap), dtype=torch.int32, device=dev)
            out = torch.empty((self.T, H), dtype=torch.bfloat16, device=dev)
            dout = _lib.DispatchOut(C.sizeof(_lib.DispatchOut), rx.data_ptr(),
                                    sc.data_ptr() if fp8 else None, cnt.data_ptr(),
                                    sr.data_ptr(), st.data_ptr(), None)
            self.sets.append(((rx, sc) if fp8 else rx, cnt, sr, st, out, dout))
        self.din = _lib.DispatchIn(C.sizeof(_lib.DispatchIn), 0, None, None, None, None, None)
        self.cin = _lib.CombineIn(C.sizeof(_lib.CombineIn), None, None)
        # one per buffer set: a combine's receive hook may run after the
        # next round's combine was sent (two rounds in flight)
        self.couts = [_lib.CombineOut(C.sizeof(_lib.CombineOut), None, None, None)
                      for _ in range(2)]
        self.round = C.c_uint64()
        self.ybufs = [None, None]  # zero-copy combine inputs, made on first use
        # per buffer set: a round dispatched and not combined yet (0: none),
        # and whether its receive ran (see Buffer._settle)
        self.pending, self.recvd = [0, 0], [True, True]
        self.owner = [None, None]  # weak references to the pending rounds' handles
        # per buffer set: the stats tensors (wait costs, receive counts) a
        # receive not yet enqueued (hook, or a dropped round's settle)
        # writes into
        self.wc_keep = [None, None]
        self.wzero = torch.zeros((self.T, K), dtype=torch.float32, device=dev)
        self.xzero = torch.zeros((self.T, H), dtype=torch.bfloat16, device=dev)
        self.dcin = _lib.CombineIn(C.sizeof(_lib.CombineIn), None, None)
        self.dcout = _lib.CombineOut(C.sizeof(_lib.CombineOut), None, None, None)
        L = _lib_handle()
        self.send, self.recv = L.ferry_dispatch_send, L.ferry_dispatch_recv
        self.csend, self.crecv = L.ferry_combine_send, L.ferry_combine_recv
        self.both, self.cboth = L.ferry_dispatch, L.ferry_combine
        self.last_error = L.ferry_ep_last_error
        self.stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def ybuf(self, s):
        """Buffer set s's zero-copy combine input (bf16 [E_local, N*T, H]),
        allocated at the first call (never inside a CUDA graph capture)."""
        if self.ybufs[s] is None:
            if torch.cuda.is_current_stream_capturing():
                raise FerryError(-1, "ferry.deep_ep: the zero-copy combine buffer of this "
                                     "context is made at the first "
                                     "get_next_low_latency_combine_buffer call; make that call "
                                     "(for two rounds: one per buffer set) before capturing")
            self.ybufs[s] = torch.empty(self.yshape, dtype=torch.bfloat16,
                                        device=torch.device("cuda", self.dev))
        return self.ybufs[s]

    def combined(self, handle, rnd):
        """Round rnd of handle was combined (sent): no longer pending, and
        a later combine of the handle dispatches its routing again."""
        handle.combined = True
        if self.pending[rnd & 1] == rnd:
            self.pending[rnd & 1] = 0

    def raw_stream(self):
        if self.stream is not None:
            return self.stream(self.dev)
        return torch.cuda.current_stream(self.dev).cuda_stream

    def check(self, rc):
        if rc != 0:
            raise FerryError(rc, self.last_error(self.ep.handle()).decode())


#: tokens per rank one normal-mode dispatch may carry (ferry's
#: high-throughput buffers do not grow with it; FERRY_DEEP_EP_MAX_TOKENS)
_HT_MAX_TOKENS = int(os.environ.get("FERRY_DEEP_EP_MAX_TOKENS", 65536))


#: CUDA tensors: get_dispatch_layout through ferry_dispatch_layout's kernel
#: (1, the default: 15 us against 160 us for the PyTorch ops at T=4096 on
#: an H200, tools/bench_layout.py) or PyTorch ops (0); the host code serves
#: CPU tensors either way
_LAYOUT_KERNEL = os.environ.get("FERRY_DEEP_EP_LAYOUT_KERNEL", "1") == "1"


#: the kinds a declared low-latency shape may name (dispatch dtype and scale
#: options: fp8 is DeepEP's use_fp8=True, fp8_round adds round_scale, and
#: fp8_ue8m0 round_scale with use_ue8m0)
_SHAPE_KINDS = ("fp8", "bf16", "fp8_round", "fp8_ue8m0")


def _parse_shapes(spec, name):
    """Declared low-latency shapes: a string "E,K,H,T[,kind];..." or a list
    of (E, K, H, T[, kind]) tuples, kind one of _SHAPE_KINDS (default fp8);
    returns [(E, K, H, T, kind)]. A malformed one: ValueError naming `name`."""
    if isinstance(spec, str):
        items = [p.strip() for p in spec.replace("\n", ";").split(";") if p.strip()]
        items = [tuple(f.strip() for f in it.split(",")) for it in items]
    else:
        try:
            items = list(spec)
        except TypeError:
            raise ValueError(f"{name}: {spec!r}: expected a list of (num_experts, topk, hidden, "
                             f"num_max_dispatch_tokens_per_rank[, kind]) tuples") from None
    out = []
    for it in items:
        try:
            it = tuple(it)
            if len(it) not in (4, 5):
                raise ValueError
            E, K, H, T = (operator.index(v) if not isinstance(v, str) else int(v)
                          for v in it[:4])
            kind = str(it[4]) if len(it) == 5 else "fp8"
            if kind not in _SHAPE_KINDS or min(E, K, H, T) < 1 or \
                    (kind == "fp8_ue8m0" and H % 512):
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"{name}: {it!r}: expected num_experts, topk, hidden, "
                             f"num_max_dispatch_tokens_per_rank and optionally one of "
                             f"{', '.join(_SHAPE_KINDS)} (e.g. \"256,8,7168,128,fp8\"; "
                             f"fp8_ue8m0 needs hidden a multiple of 512)") from None
        out.append((E, K, H, T, kind))
    return out


def _layout_c(topk_idx, num_experts, N, ranks_per_node=0):
    """(per rank, per expert, is_token_in_rank, per node or None) from
    ferry_dispatch_layout: the host loop, or memsets and one kernel on the
    current stream; indices outside 0..E-1 count nowhere. ranks_per_node >
    0: nodes are blocks of that many consecutive ranks, counted too."""
    T, K = topk_idx.shape
    dev = topk_idx.device
    idx = topk_idx if topk_idx.is_contiguous() else topk_idx.contiguous()
    per_rank = torch.empty(N, dtype=torch.int32, device=dev)
    per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
    in_rank = torch.empty((T, N), dtype=torch.bool, device=dev)
    per_node = (torch.empty(-(-N // ranks_per_node), dtype=torch.int32, device=dev)
                if ranks_per_node > 0 else None)
    args = _lib.LayoutArgs(C.sizeof(_lib.LayoutArgs),
                           _lib.DEVICES["cuda" if idx.is_cuda else "cpu"], T, K, num_experts,
                           N, idx.data_ptr(), per_rank.data_ptr(), per_expert.data_ptr(),
                           in_rank.data_ptr(),
                           torch.cuda.current_stream(dev).cuda_stream if idx.is_cuda else None,
                           ranks_per_node,
                           per_node.data_ptr() if per_node is not None else None)
    msg = C.create_string_buffer(512)
    # the memsets and the kernel run on the current device: topk_idx's
    with torch.cuda.device(dev) if idx.is_cuda else contextlib.nullcontext():
        rc = _lib_handle().ferry_dispatch_layout(C.byref(args), msg, len(msg))
    if rc != 0:
        raise FerryError(rc, f"get_dispatch_layout: {msg.value.decode()}")
    return per_rank, per_expert, in_rank, per_node


def _layout_torch(topk_idx, num_experts, N):
    """The same from PyTorch ops (about a dozen launches)."""
    T = topk_idx.shape[0]
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    e = torch.where(valid, topk_idx, torch.zeros_like(topk_idx))
    in_rank = torch.zeros((T, N), dtype=torch.int32, device=topk_idx.device)
    in_rank.scatter_add_(1, e // (num_experts // N), valid.to(torch.int32))
    is_token_in_rank = in_rank > 0
    per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    per_expert = torch.zeros(num_experts, dtype=torch.int32, device=topk_idx.device)
    per_expert.scatter_add_(0, e.flatten(), valid.flatten().to(torch.int32))
    return per_rank, per_expert, is_token_in_rank


class _HtHandle:
    """A normal-mode dispatch's handle: ferry's route (where each token went
    and what this rank received), reusable for combine and for later
    dispatches with the same routing (DeepEP's cached layout and the
    backward pass). Its GPU tables are freed with it. Indexed like DeepEP's
    tuples (docs/python.md has each field): within one node the 6-tuple
    (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    recv_src_idx, is_token_in_rank, send_head); across nodes the 10-tuple
    (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
    recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum,
    recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
    send_rdma_head, send_nvl_head). DeepEP's per-channel matrices and send
    heads belong to its kernels' channels, which ferry does not have: None."""

    def __init__(self, ep, route, T, prefix=None, in_rank=None, internode=False):
        self.ep, self.route, self.T = ep, route, T
        self.prefix, self.in_rank = prefix, in_rank
        self.internode = internode
        self.src_idx = None   # set by the dispatch that made the route
        self.src_rank = None  # each received row's source rank (same)
        self._gbl = self._rdma = None  # the prefix sums, made when first read

    def _recv_prefix(self):
        """recv_gbl_rank_prefix_sum: int32 [N], rows this rank received from
        ranks 0..i (rows arrive by source rank)."""
        if self._gbl is None and self.src_rank is not None:
            N = self.prefix.shape[0]
            self._gbl = torch.cumsum(torch.bincount(self.src_rank.long(), minlength=N),
                                     0, dtype=torch.int32)
        return self._gbl

    def _rdma_prefix(self):
        """recv_rdma_rank_prefix_sum: int32 [nodes], rows this rank received
        from the ranks of nodes 0..i."""
        nodes = self.ep_nodes
        g = self._recv_prefix()
        if self._rdma is None and g is not None and nodes is not None:
            last = [max(r for r, n in enumerate(nodes) if n == k)
                    for k in range(max(nodes) + 1)]
            self._rdma = g[torch.tensor(last, device=g.device)]
        return self._rdma

    ep_nodes = None  # each rank's node index, set across nodes

    def _items(self):
        if self.internode:
            return (self.in_rank, None, None, None, self._rdma_prefix(), None,
                    self._recv_prefix(), self.src_idx, None, None)
        return (self.prefix, None, None, self.src_idx, self.in_rank, None)

    def __getitem__(self, i):
        return self._items()[i]

    def __len__(self):
        return 10 if self.internode else 6

    def __iter__(self):
        return iter(self._items())

    @property
    def num_recv(self):
        return self.route.num_recv

    def __del__(self):
        try:
            self.route.close()
        except Exception:
            pass


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


class Buffer:
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

    def _normal(self, what):
        """Normal-mode calls run on every Buffer, as DeepEP's do: one made
        with low_latency_mode=True serves both modes (SGLang's
        --deepep-mode auto: normal-mode prefill and low-latency decode on
        one buffer); its contexts of each mode are apart."""

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

    def _ht_sms_check(self, ep, sms, what):
        """A normal-mode context's SMs are fixed when it is made (its rings
        are per channel): a call whose config asks for others runs on the
        context's, with a warning once per Buffer (vLLM's dual-batch
        overlap changes set_num_sms between calls)."""
        have = ep.num_sms
        if sms is None or have is None or sms == have or self._sms_warned:
            return
        self._sms_warned = True
        warnings.warn(f"ferry.deep_ep.Buffer.{what}: config.num_sms = {sms}, but this shape's "
                      f"normal-mode context was made with {have} SMs, which it keeps (a "
                      f"context's channels are fixed; set the SMs before a shape's first "
                      f"dispatch). Warned once per Buffer.", RuntimeWarning, stacklevel=3)

    def _ht_ep(self, num_experts, topk, hidden, device="cuda", sms=None):
        key = ("ht", num_experts, topk, hidden, device)
        ep = self._eps.get(key)
        if ep is None:
            self._not_capturing("dispatch", key[1:])
            n = sms if sms is not None else self._kernel_sms("ht")
            ep = EP(self.comm, num_experts=num_experts, topk=topk, hidden=hidden,
                    max_tokens=_HT_MAX_TOKENS, dtype="bf16", device=device, mode="ht",
                    num_sms=n)
            self._eps[key] = ep
        else:
            self._ht_sms_check(ep, sms, "dispatch")
        return ep

    @_plain_torch
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's: (num_tokens_per_rank [N] int32, num_tokens_per_rdma_rank
        [nodes] int32 (the tokens going to some rank of each node, nodes as
        buf.runtime numbers them; None on one node, as DeepEP), num_tokens_
        per_expert [E] int32, is_token_in_rank [T, N] bool, event), on
        topk_idx's device and stream. dispatch does not read them (ferry
        works its route out itself)."""
        self._normal("get_dispatch_layout")
        _tensor(topk_idx, "topk_idx", torch.int64, ("T", "K"))
        N = self.group_size
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % N:
            raise ValueError(f"num_experts = {num_experts!r}: expected a positive multiple of "
                             f"the group size {N}")
        _lib.c_int(num_experts, "num_experts")
        if previous_event is not None:
            previous_event.current_stream_wait()
        rt = self.runtime
        per_node = None
        # nodes of equal size in rank order: the kernel counts them too
        rpn = rt._ranks_per_node() if rt.get_num_rdma_ranks() > 1 else 0
        if topk_idx.is_cuda and not _LAYOUT_KERNEL:
            per_rank, per_expert, is_token_in_rank = _layout_torch(topk_idx, num_experts, N)
        else:
            per_rank, per_expert, is_token_in_rank, per_node = _layout_c(
                topk_idx, num_experts, N, rpn)
        if rt.get_num_rdma_ranks() > 1 and per_node is None:
            hit = torch.zeros((is_token_in_rank.shape[0], rt.get_num_rdma_ranks()),
                              dtype=torch.int32, device=topk_idx.device)
            hit.index_add_(1, rt._nodes_on(topk_idx.device), is_token_in_rank.to(torch.int32))
            per_node = (hit > 0).sum(0, dtype=torch.int32)
        return per_rank, per_node, per_expert, is_token_in_rank, \
            (_event_after(topk_idx) if async_finish else _no_event())

    @_plain_torch
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                 topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                 previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's normal-mode dispatch on ferry's high-throughput engine.
        x: bf16 [T, H], or (fp8 [T, H], float32 scales [T, H/128]). Without
        a handle, topk_idx [T, K] int64 makes the routing (collective, one
        wait for the counts, as DeepEP's); returns (recv_x, recv_topk_idx
        int64 (local ids, -1 elsewhere), recv_topk_weights, the rows per
        local expert as a list (rounded up to expert_alignment), handle,
        event). With a handle (cached layout), the same routing:
        (recv_x, None, None, None, None, event), as DeepEP's. The layout arguments
        (num_tokens_per_rank ...) are what get_dispatch_layout returned;
        ferry works them out itself and does not read them. Rows arrive by
        source rank, then token."""
        self._normal("dispatch")
        # passed to libferry as C ints (max_recv, expert_alignment of the route)
        num_worst_tokens = _lib.c_int(int(num_worst_tokens or 0), "num_worst_tokens")
        expert_alignment = _lib.c_int(int(expert_alignment or 1), "expert_alignment")
        if num_worst_tokens and isinstance(handle, _HtHandle) and \
                num_worst_tokens != handle.route.num_recv:
            raise ValueError(f"num_worst_tokens: {num_worst_tokens}, but the handle's routing "
                             f"receives {handle.route.num_recv} rows (a cached dispatch keeps "
                             f"the handle's routing)")
        if previous_event is not None:
            previous_event.current_stream_wait()
        fp8 = isinstance(x, tuple)
        xt, xs = (x[0], x[1]) if fp8 else (x, None)
        byte_dt = None
        if fp8 and isinstance(xt, torch.Tensor) and xt.dtype in (torch.int8, torch.uint8):
            # other 1-byte rows with their scales (vLLM's block-quantized
            # int8 models): moved bit for bit as fp8 rows are, returned in
            # their dtype, as DeepEP (which checks the size, not the dtype)
            byte_dt, xt = xt.dtype, xt.view(torch.float8_e4m3fn)
        _tensor(xt, "x", torch.float8_e4m3fn if fp8 else torch.bfloat16, ("T", "H"))
        xs, carried = self._scales_in(xt, xs) if fp8 else (None, None)
        xt = xt.contiguous()
        cached = handle is not None
        by_rank = False  # routed by is_token_in_rank alone (no top-k)
        if not cached:
            N = self.group_size
            T = xt.shape[0]
            E = num_tokens_per_expert.numel() if isinstance(num_tokens_per_expert,
                                                            torch.Tensor) else None
            if E is None:
                raise TypeError("ferry.deep_ep.Buffer.dispatch: num_tokens_per_expert (from "
                                "get_dispatch_layout) is required without a handle: it gives "
                                "the number of experts")
            if E % N:
                raise ValueError(f"num_tokens_per_expert: {E} experts is not a multiple of the "
                                 f"group size {N}")
            if topk_idx is None:
                # DeepEP's dispatch without top-k: tokens go to the ranks
                # is_token_in_rank names; ferry routes each to the first
                # expert of those ranks (a context with top-k = N)
                if is_token_in_rank is None:
                    raise TypeError("ferry.deep_ep.Buffer.dispatch: topk_idx or "
                                    "is_token_in_rank is required without a handle")
                if topk_weights is not None:
                    raise TypeError("ferry.deep_ep.Buffer.dispatch: topk_weights needs "
                                    "topk_idx")
                _tensor(is_token_in_rank, "is_token_in_rank", torch.bool, (T, N))
                first = torch.arange(N, dtype=torch.int64, device=xt.device) * (E // N)
                routing = torch.where(is_token_in_rank.to(xt.device), first.view(1, N),
                                      torch.full_like(first, -1).view(1, N)).contiguous()
                by_rank = True
            else:
                _tensor(topk_idx, "topk_idx", torch.int64, (T, None))
                routing = topk_idx.contiguous()
            ep = self._ht_ep(E, routing.shape[1], xt.shape[1], "cuda" if xt.is_cuda else "cpu",
                             self._config_sms(config, "dispatch"))
            route = ep.route(routing, 1 if by_rank else expert_alignment,
                             max_recv=num_worst_tokens)
            in_rank = is_token_in_rank
            if num_tokens_per_rank is None or in_rank is None:
                per_rank, _, _, in_rank, _ = self.get_dispatch_layout(routing, E)
                num_tokens_per_rank = per_rank if num_tokens_per_rank is None else \
                    num_tokens_per_rank
            rt = self.runtime
            handle = _HtHandle(ep, route, T, self._rank_prefix(num_tokens_per_rank, xt.device),
                               in_rank, internode=rt.get_num_rdma_ranks() > 1)
            if handle.internode:
                handle.ep_nodes = list(rt._node_of)
        elif not isinstance(handle, _HtHandle):
            raise TypeError(f"handle: expected the handle a normal-mode dispatch returned, got "
                            f"{type(handle).__name__}")
        ep, route = handle.ep, handle.route
        if topk_weights is not None:
            _tensor(topk_weights, "topk_weights", torch.float32, (xt.shape[0], ep.topk))
            topk_weights = topk_weights.contiguous()
        if xt.shape[0] != handle.T:
            raise ValueError(f"x: {xt.shape[0]} tokens, the handle's routing has {handle.T}")
        # a cached dispatch returns recv_x alone; the first one also the
        # top-k ids and weights, and keeps the source tokens in the handle
        o = ep.ht_dispatch(route, xt, xs, topk_weights,
                           outputs=() if cached else ("recv_topk_idx", "recv_topk_weights",
                                                      "recv_src_token", "recv_src_rank"))
        rx = o["recv_x"] if byte_dt is None else o["recv_x"].view(byte_dt)
        recv_x = (rx, self._scales_out(o["recv_x_scales"], carried)) if fp8 else rx
        ev = _event_after(xt) if async_finish else _no_event()
        if cached:  # DeepEP returns no handle for a cached dispatch (the caller has it)
            return recv_x, None, None, None, None, ev
        handle.src_idx = o["recv_src_token"]
        handle.src_rank = o["recv_src_rank"]
        # a bounded route (num_worst_tokens): rows padded to the bound, no
        # host wait, so no per-expert list (DeepEP returns it empty too)
        if route.num_recv_real is not None:
            counts = []
        elif by_rank:
            # per expert from the callers' counts, as DeepEP's notify sums them
            counts = self._expert_counts(num_tokens_per_expert, expert_alignment)
        else:
            counts = [int(c) for c in route.expert_counts]
        if by_rank:
            return recv_x, None, None, counts, handle, ev
        return (recv_x, o["recv_topk_idx"].to(torch.int64), o["recv_topk_weights"],
                counts, handle, ev)

    @staticmethod
    def _scales_in(xt, xs):
        """The fp8 scales of a normal-mode dispatch as ferry's engine takes
        them: float32 [T, H/128], row-major. DeepEP moves any 4-byte scales
        per token (float32 or int32, e.g. one per token, or UE8M0 exponents
        packed four to an int32: [T, H/512]; any strides) and returns them
        row-major in the same dtype; ferry carries such scales bit for bit
        in the first columns of a float32 [T, H/128] (the int32 bits copied
        as int32). Returns (scales, None) or (carrier, (count, dtype))."""
        T, S = xt.shape[0], xt.shape[1] // 128
        want = (f"expected float32 or int32 [{T}, n] on {xt.device} (n scales per token, at "
                f"most hidden/128 = {S})")
        if not isinstance(xs, torch.Tensor) or xs.dtype not in (torch.float32, torch.int32):
            raise TypeError(f"x[1] (scales): {want}, got "
                            f"{xs.dtype if isinstance(xs, torch.Tensor) else type(xs).__name__}")
        if xs.dim() != 2 or xs.shape[0] != T or xs.device != xt.device:
            raise ValueError(f"x[1] (scales): {want}, got {_fmt_shape(tuple(xs.shape))} on "
                             f"{xs.device}")
        ns = xs.shape[1]
        if xs.dtype == torch.float32 and ns == S:
            # strided (DeepEP's column-major scales) is taken as it is
            return (xs if _elem_strides(xs) is not None else xs.contiguous()), None
        if ns > S or ns < 1:
            raise ValueError(f"x[1] (scales): {ns} scales per token; ferry's normal mode "
                             f"carries 1 to hidden/128 = {S}")
        carrier = torch.zeros((T, S), dtype=torch.int32, device=xt.device)
        carrier[:, :ns] = xs.view(torch.int32) if xs.dtype == torch.float32 else xs
        return carrier.view(torch.float32), (ns, xs.dtype)

    @staticmethod
    def _scales_out(recv, carried):
        """Received scales in the caller's count and dtype (_scales_in)."""
        if carried is None:
            return recv
        ns, dt = carried
        bits = recv.view(torch.int32)[:, :ns].contiguous()
        return bits if dt == torch.int32 else bits.view(torch.float32)

    def _rank_prefix(self, per_rank, device):
        """DeepEP's rank_prefix_matrix: int32 [N, N], [i][j] = tokens ranks
        0..i send to rank j, from an all-gather of every rank's per-rank
        counts over the group (collective, as the dispatch is), finished
        here: a collective left running would hand the matrix over before
        it arrived wherever the group's all-gather works on host copies."""
        N = self.group_size
        mine = per_rank.to(device=device, dtype=torch.int32).reshape(N).contiguous()
        if N == 1:
            return mine.view(1, 1).clone()
        if self._mpi is not None:  # on host copies
            from mpi4py import MPI
            src = mine.cpu().numpy()
            dst = torch.empty(N * N, dtype=torch.int32)
            self._mpi.Allgather([src, MPI.INT32_T], [dst.numpy(), MPI.INT32_T])
            return torch.cumsum(dst.view(N, N), 0, dtype=torch.int32).to(device)
        parts = [torch.empty_like(mine) for _ in range(N)]
        torch.distributed.all_gather(parts, mine, group=self.group)
        return torch.cumsum(torch.stack(parts), 0, dtype=torch.int32)

    def _expert_counts(self, per_expert, align):
        """Rows per local expert from every rank's num_tokens_per_expert (an
        all-reduce over the group), rounded up to align, as a list."""
        tot = per_expert.to(torch.int32).clone()
        if self.group_size > 1 and self._mpi is not None:
            from mpi4py import MPI
            t = tot.cpu()
            self._mpi.Allreduce(MPI.IN_PLACE, [t.numpy(), MPI.INT32_T], op=MPI.SUM)
            tot = t
        elif self.group_size > 1:
            torch.distributed.all_reduce(tot, group=self.group)
        El = tot.numel() // self.group_size
        mine = tot[self.rank * El:(self.rank + 1) * El].tolist()
        return [(c + align - 1) // align * align for c in mine]

    @_plain_torch
    def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's normal-mode combine: x [num_recv, H] bf16 (one row per
        row dispatch delivered, the local experts' outputs already weighted
        and summed) back to the tokens' ranks, summed there in rank order in
        fp32 and rounded once; bias (one [T, H] bf16 tensor or a tuple of
        two) is added in fp32 before that rounding. Returns (combined_x
        [T, H] bf16, combined_topk_weights [T, K] float32 or None,
        event)."""
        self._normal("combine")
        if not isinstance(handle, _HtHandle):
            raise TypeError(f"handle: expected the handle a normal-mode dispatch returned, got "
                            f"{type(handle).__name__}")
        if previous_event is not None:
            previous_event.current_stream_wait()
        ep, route = handle.ep, handle.route
        self._ht_sms_check(ep, self._config_sms(config, "combine"), "combine")
        _tensor(x, "x", torch.bfloat16, (route.num_recv, ep.hidden))
        # DeepEP takes strided bias; ht_combine checks the count, shapes,
        # dtype and device, naming bias[i]
        if bias is not None:
            bias = tuple(b.contiguous() if isinstance(b, torch.Tensor) else b
                         for b in (bias if isinstance(bias, tuple) else (bias,)))
        if topk_weights is not None:
            _tensor(topk_weights, "topk_weights", torch.float32, (route.num_recv, ep.topk))
            # DeepEP's combined_topk_weights: slot k summed over the rows of
            # every rank the token went to
            out, w = ep.ht_combine(route, x.contiguous(), topk_weights.contiguous(),
                                   weights_sum=True, bias=bias)
        else:
            out, w = ep.ht_combine(route, x.contiguous(), bias=bias), None
        return out, w, (_event_after(x) if async_finish else _no_event())

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Nothing to clean: ferry's flags count arrivals per round (a
        flag left from an earlier round or shape never reads as this
        round's), so buffers need no reset between shapes. The arguments
        are checked as DeepEP's are."""
        for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                        ("hidden", hidden), ("num_experts", num_experts)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"clean_low_latency_buffer: {name}: expected a positive int, "
                                 f"got {v!r}")

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """DeepEP's: mask (mask=True) or unmask a rank for the low-latency
        calls: from the next round on this rank sends it nothing, waits for
        nothing from it, and top-k slots on its experts count as -1 (no row
        there, nothing added by the combine). Every surviving rank masks the
        same ranks before the same round. Applies to every shape's context
        (and to contexts made later: note that making one is collective, so
        a shape first called after a rank died fails). Unmasking a rank
        after a round ran with it masked raises ferry.FerryError
        (FERRY_ERR_STATE): the pair's flags are out of step; make a new
        Buffer. CUDA: written on the current stream (capturable)."""
        self._low_latency("low_latency_update_mask_buffer")
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) or \
                not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask: {rank_to_mask!r}: expected a rank 0..."
                             f"{self.group_size - 1}")
        if rank_to_mask == self.rank:
            raise ValueError(f"rank_to_mask: {rank_to_mask} is this rank (a rank masks its "
                             f"peers, never itself)")
        mask = bool(mask)
        done = []  # all the contexts or none: a refusal takes back what changed
        try:
            for ep in self._ll_eps():
                if bool(int(ep.mask_query()[rank_to_mask])) == mask:
                    continue  # already so (set here, or by a wait with enable_shrink)
                ep.mask_rank(rank_to_mask, mask)
                done.append(ep)
        except Exception:
            for ep in done:  # no round ran since: taking it back is allowed
                try:
                    ep.mask_rank(rank_to_mask, not mask)
                except Exception:
                    pass  # the first error is the one to report
            raise
        if mask:
            self._masked.add(rank_to_mask)
        else:
            self._masked.discard(rank_to_mask)

    def low_latency_query_mask_buffer(self, mask_status):
        """DeepEP's: mask_status int32 [num_ranks] gets 1 where a rank is
        masked, else 0 (on its own device and current stream): the ranks
        masked here, and with enable_shrink those a context's wait masked."""
        self._low_latency("low_latency_query_mask_buffer")
        _tensor(mask_status, "mask_status", torch.int32, (self.group_size,))
        mask_status.zero_()
        for r in sorted(self._masked):
            mask_status[r] = 1
        if self.enable_shrink:
            for ep in self._ll_eps():  # a context's own finds
                m = ep.mask_query()
                m = torch.from_numpy(m) if not isinstance(m, torch.Tensor) else m
                mask_status.copy_(torch.maximum(mask_status, m.to(mask_status.device)))

    def low_latency_clean_mask_buffer(self):
        """DeepEP's: unmask every rank (low_latency_update_mask_buffer(r,
        False) for each masked r, with its rule: refused once a round ran
        with the mask). A rank that a timed-out wait masked (enable_shrink)
        cannot be readmitted into a context that ran rounds without it:
        FERRY_ERR_STATE naming the ranks (make a new Buffer), rather than a
        clean after which the query still reports them."""
        self._low_latency("low_latency_clean_mask_buffer")
        for r in sorted(self._masked):
            self.low_latency_update_mask_buffer(r, False)
        if self.enable_shrink:
            left = sorted({r for ep in self._ll_eps()
                           for r, m in enumerate(_as_list(ep.mask_query())) if m})
            if left:
                raise FerryError(-9, f"low_latency_clean_mask_buffer: rank(s) "
                                     f"{', '.join(map(str, left))} masked by a wait that timed "
                                     f"out (enable_shrink): ferry cannot readmit a rank into "
                                     f"contexts that ran rounds without it; make a new Buffer "
                                     f"(collective) to run with every rank again")

    def _ll_eps(self):
        """The low-latency contexts (the masks are theirs; the normal-mode
        engine masks no ranks)."""
        return [ep for k, ep in self._eps.items() if k[0] != "ht"]

    def _ep(self, num_experts, topk, hidden, T, fp8, device, round_scale=False, ue8m0=False):
        key = (num_experts, topk, hidden, T, fp8, device, round_scale, ue8m0)
        ep = self._eps.get(key)
        if ep is None:
            # passed to libferry as C ints: checked here to name DeepEP's arguments
            _lib.c_int(num_experts, "num_experts")
            _lib.c_int(T, "num_max_dispatch_tokens_per_rank")
            self._not_capturing("low_latency_dispatch",
                                dict(num_experts=num_experts, topk=topk, hidden=hidden,
                                     num_max_dispatch_tokens_per_rank=T, use_fp8=fp8))
            ep = EP(self.comm, num_experts=num_experts, topk=topk, hidden=hidden,
                    max_tokens=T, dtype="fp8" if fp8 else "bf16", device=device,
                    num_sms=self._kernel_sms("ll"),
                    fp8_round_scale=round_scale,
                    scales_layout=("ue8m0" if ue8m0 else "cols") if fp8 else "rows",
                    mask_on_timeout=self.enable_shrink)
            for r in sorted(self._masked):  # before its first round: allowed
                ep.mask_rank(r, True)
            self._eps[key] = ep
        return ep

    def _plan(self, x, num_experts, K, H, T, fp8, round_scale=False, ue8m0=False):
        """The context and its plan for this shape (created at the first
        call, collectively, like the contexts)."""
        key = (num_experts, K, H, T, fp8, x.get_device(), round_scale, ue8m0)
        plan = self._plans.get(key)
        if plan is None:
            self._not_capturing("low_latency_dispatch",
                                dict(num_experts=num_experts, topk=K, hidden=H,
                                     num_max_dispatch_tokens_per_rank=T, use_fp8=fp8))
            ep = self._ep(num_experts, K, H, T, fp8, "cuda", round_scale, ue8m0)
            plan = self._plans[key] = _Plan(ep, fp8, x.device)
        return plan

    @_plain_torch
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                             num_experts, cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8=True,
                             round_scale=False, use_ue8m0=False, async_finish=False,
                             return_recv_hook=False):
        r = self._ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                              cumulative_local_expert_recv_stats,
                              dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0,
                              return_recv_hook)
        if async_finish:
            r = (r[0], r[1], r[2], _event_after(x), r[4])
        return r

    def _ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                     cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                     use_fp8, round_scale, use_ue8m0, return_recv_hook):
        self._low_latency('low_latency_dispatch')
        wc = self._wait_cost(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats", x)
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0: True needs use_fp8=True and round_scale=True (UE8M0 "
                             "holds power-of-two scales only)")
        if use_ue8m0 and isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] % 512:
            raise ValueError(f"use_ue8m0: hidden must be a multiple of 512 (four scales "
                             f"per int32), got {x.shape[1]}")
        rs = bool(round_scale and use_fp8)
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            # DeepEP's: int32 [num_local_experts] on the GPU, the received
            # rows per local expert added in place every dispatch (EPLB)
            _tensor(stats, "cumulative_local_expert_recv_stats", torch.int32,
                    (num_experts // max(1, self.group_size),))
            if isinstance(x, torch.Tensor) and stats.device != x.device:
                raise ValueError(f"cumulative_local_expert_recv_stats: expected a tensor on "
                                 f"{x.device} (x's device), got one on {stats.device}")
        # the receive adds recv_count to the stats itself (in the kernel), and
        # writes the scales in DeepEP's layout (UE8M0 words with use_ue8m0)
        return self._low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                          num_experts, use_fp8, return_recv_hook, rs, wc, stats,
                                          bool(use_ue8m0))

    def _wait_cost(self, t, name, x):
        """DeepEP's wait-cost stats: int64 [num_ranks], contiguous, on x's
        device; ferry's receive adds per source rank the SM clock cycles it
        waited for that rank (one block's wait, as DeepEP counts one warp's
        per expert). None passes."""
        if t is None:
            return None
        _tensor(t, name, torch.int64, (self.group_size,))
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got a strided view")
        if isinstance(x, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} (x's device), got one "
                             f"on {t.device}")
        return t

    def _low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                              use_fp8, return_recv_hook, round_scale=False, wc=None,
                              stats=None, ue8m0=False):
        """wc: the wait-cost stats tensor (checked) or None; stats: the
        receive-count stats (checked) or None."""
        # the common case, checked in few steps: CUDA bf16 x [T, H], int64 topk_idx [T, K]
        if type(x) is torch.Tensor and type(topk_idx) is torch.Tensor and x.is_cuda and \
                x.dtype is torch.bfloat16 and topk_idx.dtype is torch.int64 and \
                x.dim() == 2 and topk_idx.dim() == 2 and x.shape[0] == topk_idx.shape[0] and \
                type(num_max_dispatch_tokens_per_rank) is int and type(num_experts) is int and \
                x.shape[0] <= num_max_dispatch_tokens_per_rank and \
                topk_idx.get_device() == x.get_device():
            return self._dispatch_fast(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                       num_experts, use_fp8, return_recv_hook, round_scale, wc,
                                       stats, ue8m0)
        _tensor(x, "x", torch.bfloat16)
        if x.dim() != 2:
            raise ValueError(f"x: expected shape (T, H) bfloat16, got {_fmt_shape(tuple(x.shape))} "
                             f"bfloat16")
        T, H = x.shape
        _tensor(topk_idx, "topk_idx")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != T:
            raise ValueError(f"topk_idx: expected shape ({T}, K) int64 (the rows of x), got "
                             f"{_fmt_shape(tuple(topk_idx.shape))} "
                             f"{str(topk_idx.dtype).replace('torch.', '')}")
        if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or \
                topk_idx.dtype is torch.bool:
            raise TypeError(f"topk_idx: expected an integer dtype (int64, as DeepEP's "
                            f"topk_idx_t), got {str(topk_idx.dtype).replace('torch.', '')}")
        if topk_idx.dtype != torch.int64:
            topk_idx = topk_idx.to(torch.int64)
        K = topk_idx.shape[1]
        try:
            num_max_dispatch_tokens_per_rank = operator.index(num_max_dispatch_tokens_per_rank)
            num_experts = operator.index(num_experts)
        except TypeError as e:
            raise TypeError(f"num_max_dispatch_tokens_per_rank, num_experts: expected ints "
                            f"({e})") from None
        dev = "cuda" if x.is_cuda else "cpu"
        ep = self._ep(num_experts, K, H, num_max_dispatch_tokens_per_rank, use_fp8, dev,
                      round_scale, ue8m0)
        El, cap = ep.num_local_experts, ep.capacity
        d = x.device
        recv_x = torch.empty((El, cap, H), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16,
                             device=d)
        scales = ep.new_expert_scales(torch, torch.float32, torch.int32, dict(device=d)) \
            if use_fp8 else None
        count = torch.empty(El, dtype=torch.int32, device=d)
        src_rank = torch.empty((El, cap), dtype=torch.int32, device=d)
        src_token = torch.empty((El, cap), dtype=torch.int32, device=d)
        topk_idx = topk_idx.contiguous()
        for plan in self._plans.values():  # a round the fast path left in the next set
            if plan.ep is ep and plan.pending[ep.next_set()]:
                self._settle(plan, ep.next_set(), plan.raw_stream())
        self._settle_slow(ep, ep.next_set())
        rnd = ep.dispatch_send(x.contiguous(), topk_idx, num_tokens=T)
        st = {"rnd": rnd, "T": T, "recvd": False}

        def recv():
            ep.dispatch_recv(rnd, recv_x, count, scales, src_rank, src_token, wait_cost=wc,
                             recv_stats=stats)
            st["recvd"] = True

        st["recv"] = recv
        hook = _recv_or_hook(recv, return_recv_hook)
        handle = _LLHandle(None, ep, rnd, src_rank, src_token, count, T,
                           num_max_dispatch_tokens_per_rank, H, num_experts)
        handle.topk_idx = topk_idx
        st["tok"] = weakref.ref(handle._tok)
        self._slow_pending(ep)[rnd & 1] = st
        out_x = (recv_x, scales) if use_fp8 else recv_x
        return out_x, count, handle, EventOverlap(), hook

    @staticmethod
    def _slow_pending(ep):
        """The rounds of ep that the path without a plan (CPU tensors, and
        CUDA tensors off the fast path) dispatched and did not combine, by
        buffer set."""
        p = ep.__dict__.get("_deep_ep_pending")
        if p is None:
            p = ep.__dict__["_deep_ep_pending"] = [None, None]
        return p

    def _settle_slow(self, ep, s):
        """_settle for the path without a plan: buffer set s is about to take
        a new round while the round there was never combined (its handle
        dropped or held): it is received if it was not, and combined from
        zeros into a scratch output; a held handle is marked, so that its
        combine, if it comes, dispatches its routing again first."""
        pend = self._slow_pending(ep)
        st = pend[s]
        if st is None:
            return
        pend[s] = None
        if not st["recvd"]:
            st["recv"]()
        El, cap, H, K, T = ep.num_local_experts, ep.capacity, ep.hidden, ep.topk, st["T"]
        d = torch.device(ep.device if ep.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        ep.combine_send(st["rnd"], torch.zeros((El, cap, H), dtype=torch.bfloat16, device=d))
        ep.combine_recv(st["rnd"], torch.zeros((T, K), dtype=torch.float32, device=d),
                        torch.empty((T, H), dtype=torch.bfloat16, device=d))
        tok = st["tok"]()
        if tok is not None:
            tok.settled = True

    def _redispatch_slow(self, handle):
        """A combine of a handle whose round has ended (combined before, or
        settled): its routing is dispatched again, zeros as x (the rows'
        places depend on the routing alone), and that round is combined."""
        ep, T = handle.ep, handle.ntok
        El, cap, H = ep.num_local_experts, ep.capacity, ep.hidden
        idx = handle.topk_idx
        self._settle_slow(ep, ep.next_set())
        d = idx.device
        rnd = ep.dispatch_send(torch.zeros((T, H), dtype=torch.bfloat16, device=d), idx,
                               num_tokens=T)
        fp8 = ep.dtype == "fp8"
        rx = torch.empty((El, cap, H), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                         device=d)
        sc = ep.new_expert_scales(torch, torch.float32, torch.int32, dict(device=d)) if fp8 else None
        cnt = torch.empty(El, dtype=torch.int32, device=d)
        sr = torch.empty((El, cap), dtype=torch.int32, device=d)
        stok = torch.empty((El, cap), dtype=torch.int32, device=d)
        ep.dispatch_recv(rnd, rx, cnt, sc, sr, stok)
        return rnd

    def _dispatch_fast(self, x, topk_idx, Tmax, num_experts, use_fp8, return_recv_hook,
                       round_scale=False, wc=None, stats=None, ue8m0=False):
        T, H = x.shape
        K = topk_idx.shape[1]
        plan = self._plan(x, num_experts, K, H, Tmax, use_fp8, round_scale, ue8m0)
        if not x.is_contiguous():
            x = x.contiguous()
        if not topk_idx.is_contiguous():
            topk_idx = topk_idx.contiguous()
        h = plan.ep.handle()
        din = plan.din
        din.num_tokens = T
        din.x = x.data_ptr()
        din.topk_idx = topk_idx.data_ptr()
        stream = din.stream = plan.raw_stream()
        ep = plan.ep
        # the round's number (and so its buffer set) is the next
        s = ep.next_set()
        if plan.pending[s]:
            self._settle(plan, s, stream)
        wcp = wc.data_ptr() if wc is not None else None
        rsp = stats.data_ptr() if stats is not None else None
        if return_recv_hook:
            plan.check(plan.send(h, din, plan.round))
            rnd = ep.last_round = plan.round.value
            out_x, cnt, sr, st, _, dout = plan.sets[rnd & 1]
            dout.stream, dout.wait_cost, dout.recv_stats = stream, wcp, rsp
            plan.wc_keep[rnd & 1] = (wc, stats)  # alive until the receive is enqueued
            hd = _LLHandle(plan, ep, rnd, sr, st, cnt, T, Tmax, H, num_experts)
            hd.topk_idx = topk_idx
            plan.pending[rnd & 1], plan.recvd[rnd & 1] = rnd, False
            plan.owner[rnd & 1] = weakref.ref(hd._tok)

            def recv():
                plan.check(plan.recv(h, rnd, dout))
                plan.recvd[rnd & 1] = True
                plan.wc_keep[rnd & 1] = None

            return out_x, cnt, hd, _no_event(), recv
        rnd = ep.last_round + 1
        out_x, cnt, sr, st, _, dout = plan.sets[rnd & 1]
        dout.stream, dout.wait_cost, dout.recv_stats = stream, wcp, rsp
        plan.check(plan.both(h, din, dout, plan.round))
        ep.last_round = plan.round.value
        if plan.round.value != rnd:
            raise FerryError(-1, f"ferry.deep_ep: round {plan.round.value} where {rnd} was "
                                 f"expected (rounds of this context were started elsewhere)")
        hd = _LLHandle(plan, ep, rnd, sr, st, cnt, T, Tmax, H, num_experts)
        hd.topk_idx = topk_idx
        plan.pending[rnd & 1], plan.recvd[rnd & 1] = rnd, True
        plan.owner[rnd & 1] = weakref.ref(hd._tok)
        return out_x, cnt, hd, _no_event(), None

    @staticmethod
    def _settle(plan, s, stream):
        """Buffer set s is about to take a new round while the round there
        was dispatched and never combined (DeepEP allows that: its handle
        dropped, or a combine that raised on a bad argument, or dispatches
        alone in a loop). The round is combined first, from scratch inputs
        into a scratch output, because ferry's flags count every round of a
        set, combine included; every rank makes the same calls, so every
        rank does the same. A handle still held is marked: its combine, if
        it comes, dispatches its routing again first (as a second combine
        does). One extra combine, only in this pattern (fp8 contexts
        allocate a bf16 [E_local, N*T, H] scratch input the first time)."""
        r0, owner = plan.pending[s], plan.owner[s]
        tok = owner() if owner is not None else None
        if torch.cuda.is_current_stream_capturing():
            raise FerryError(-1, f"ferry.deep_ep: round {r0} was dispatched and never "
                                 f"combined; its buffer set is needed for the next round: "
                                 f"combine it before capturing a CUDA graph")
        h = plan.ep.handle()
        out_x, _, _, _, out, dout = plan.sets[s]
        if not plan.recvd[s]:
            dout.stream = stream  # its stats: the dispatch's, as if its hook ran
            plan.check(plan.recv(h, r0, dout))
            plan.recvd[s] = True
            plan.wc_keep[s] = None
        y = plan.ybuf(s) if plan.fp8 else out_x  # any [E_local, N*T, H] bf16: not used
        plan.dcin.expert_y, plan.dcin.stream = y.data_ptr(), stream
        plan.dcout.topk_weights, plan.dcout.out = plan.wzero.data_ptr(), out.data_ptr()
        plan.dcout.stream = stream
        plan.check(plan.cboth(h, r0, plan.dcin, plan.dcout))
        plan.pending[s], plan.owner[s] = 0, None
        if tok is not None:
            tok.settled = True

    def _redispatch(self, handle, x, stream):
        """A second combine of a handle (DeepEP's test combines each handle
        twice): ferry's round ended with the first, so the handle's routing
        is dispatched again (zeros as x: only the rows' places matter, and
        they depend on the routing alone) and its new round is combined."""
        plan, ep = handle.plan, handle.plan.ep
        h = ep.handle()
        s = ep.next_set()
        if not plan.fp8 and x.data_ptr() == plan.sets[s][0].data_ptr():
            raise FerryError(-1, "ferry.deep_ep: a second combine of this handle dispatches "
                                 "its routing again into the buffer set x lives in (a "
                                 "dispatch's recv_x): pass a copy of it")
        if plan.pending[s]:
            self._settle(plan, s, stream)
        din = plan.din
        din.num_tokens = handle.ntok
        din.x = plan.xzero.data_ptr()
        din.topk_idx = handle.topk_idx.data_ptr()
        din.stream = stream
        dout = plan.sets[s][5]
        # not the caller's round: no stats
        dout.stream, dout.wait_cost, dout.recv_stats = stream, None, None
        plan.check(plan.both(h, din, dout, plan.round))
        rnd = ep.last_round = plan.round.value
        plan.pending[rnd & 1], plan.recvd[rnd & 1], plan.owner[rnd & 1] = rnd, True, None
        return rnd

    def _combine_fast(self, x, topk_weights, handle, out, return_recv_hook, wc=None):
        plan, rnd, T = handle.plan, handle.rnd, handle.ntok
        h = plan.ep.handle()
        if handle.combined or handle._tok.settled:  # a second combine of this handle
            rnd = self._redispatch(handle, x, plan.raw_stream())
        if not x.is_contiguous():
            x = x.contiguous()
        w = topk_weights
        if w.dtype is not torch.float32:
            w = w.float()
        if not w.is_contiguous():
            w = w.contiguous()
        if out is None:
            out = plan.sets[rnd & 1][4]
            if T != plan.T:
                out = out[:T]
        stream = plan.raw_stream()
        cin, cout = plan.cin, plan.couts[rnd & 1]
        cin.expert_y = x.data_ptr()
        cin.stream = stream
        cout.topk_weights = w.data_ptr()
        cout.out = out.data_ptr()
        cout.stream = stream
        cout.wait_cost = wc.data_ptr() if wc is not None else None
        if not return_recv_hook:  # one launch
            plan.check(plan.cboth(h, rnd, cin, cout))
            plan.combined(handle, rnd)
            return out, _no_event(), None
        plan.check(plan.csend(h, rnd, cin))
        plan.combined(handle, rnd)

        def recv():
            # x, w and out (maybe converted copies) stay alive until the
            # receive has been queued
            plan.check(plan.crecv(h, rnd, cout))
            del keep[:]

        keep = [x, w, out, wc]  # the stats tensor too: recv writes into it
        return out, _no_event(), recv

    @_plain_torch
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None):
        r = self._ll_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                             return_recv_hook, out, combine_wait_recv_cost_stats)
        if async_finish:
            r = (r[0], _event_after(x), r[2])
        return r

    def get_comm_stream(self):
        """DeepEP's communication stream: ferry runs on the caller's current
        stream, so that is the stream returned (None without CUDA)."""
        return torch.cuda.current_stream() if torch.cuda.is_available() else None

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

    # DeepEP's names for the calls across nodes (its arguments, in its
    # order: no num_worst_tokens): ferry's dispatch and combine pick the
    # path per peer, so they are the same calls
    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None,
                           num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                           num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment=1, config=None, previous_event=None,
                           async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's name: `dispatch` (ferry picks NVLink or the fabric per peer)."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                             is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                             expert_alignment, 0, config, previous_event, async_finish,
                             allocate_on_comm_stream)

    def internode_combine(self, x, handle, topk_weights=None, bias=None, config=None,
                          previous_event=None, async_finish=False,
                          allocate_on_comm_stream=False):
        """DeepEP's name: `combine`."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    def _ll_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                    return_recv_hook, out, combine_wait_recv_cost_stats):
        self._low_latency('low_latency_combine')
        if use_logfmt:
            raise NotImplementedError("use_logfmt: ferry.deep_ep does not support DeepEP's "
                                      "LogFMT combine (ferry's combine sends bf16)")
        wc = self._wait_cost(combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats", x)
        if zero_copy:
            # the experts wrote into get_next_low_latency_combine_buffer(handle):
            # that buffer is the input, x is not read
            x = self.get_next_low_latency_combine_buffer(handle)
        if type(handle) is _LLHandle and handle.plan is not None:
            plan, T = handle.plan, handle.ntok
            K = plan.ep.topk
            if type(x) is torch.Tensor and x.shape == plan.yshape and \
                    x.dtype is torch.bfloat16 and x.get_device() == plan.dev and \
                    type(topk_weights) is torch.Tensor and topk_weights.shape == (T, K) and \
                    topk_weights.get_device() == plan.dev and \
                    (out is None or (type(out) is torch.Tensor and out.shape == (T, plan.ep.hidden)
                                     and out.dtype is torch.bfloat16 and out.is_contiguous()
                                     and out.get_device() == plan.dev)):
                return self._combine_fast(x, topk_weights, handle, out, return_recv_hook, wc)
            # the checks below name what is wrong; what passes them is
            # made contiguous float32 and goes the same way
            ep, El, cap, H = plan.ep, *plan.yshape
            _tensor(x, "x", torch.bfloat16, (El, cap, H))
            _tensor(topk_idx, "topk_idx", None, (T, K))
            _tensor(topk_weights, "topk_weights", None, (T, K))
            if out is not None:
                _tensor(out, "out", torch.bfloat16, (T, H))
                if not out.is_contiguous():
                    raise ValueError("out: expected a contiguous tensor, got a strided view")
            for n, t in (("x", x), ("topk_weights", topk_weights), ("out", out)):
                if t is not None and t.get_device() != plan.dev:
                    raise ValueError(f"{n}: expected a tensor on cuda:{plan.dev} (the context's "
                                     f"device), got one on {t.device}")
            return self._combine_fast(x.contiguous(), topk_weights.float().contiguous(), handle,
                                      out, return_recv_hook, wc)
        if type(handle) is not _LLHandle:
            raise TypeError("handle: expected the handle low_latency_dispatch returned, got "
                            f"{type(handle).__name__}")
        ep, rnd, T = handle.ep, handle.rnd, handle.ntok
        El, cap, H, K = ep.num_local_experts, ep.capacity, ep.hidden, ep.topk
        _tensor(x, "x", torch.bfloat16, (El, cap, H))
        _tensor(topk_idx, "topk_idx", None, (T, K))
        _tensor(topk_weights, "topk_weights", None, (T, K))
        if out is None:
            out = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
        else:
            _tensor(out, "out", torch.bfloat16, (T, H))
        w = topk_weights.contiguous()
        if w.dtype != torch.float32:
            w = w.float()
        if handle.combined or handle._tok.settled:
            if handle.topk_idx is None:
                raise FerryError(-1, "ferry.deep_ep: this handle's round has ended and its "
                                     "routing was not kept: dispatch again")
            rnd = self._redispatch_slow(handle)
        else:
            pend = self._slow_pending(ep)
            if pend[rnd & 1] is not None and pend[rnd & 1]["rnd"] == rnd:
                if not pend[rnd & 1]["recvd"]:
                    pend[rnd & 1]["recv"]()
                pend[rnd & 1] = None
        ep.combine_send(rnd, x.contiguous())
        handle.combined = True

        def recv():
            ep.combine_recv(rnd, w, out, wait_cost=wc)

        hook = _recv_or_hook(recv, return_recv_hook)
        return out, EventOverlap(), hook

    def get_next_low_latency_combine_buffer(self, handle):
        """DeepEP's zero-copy combine: a bf16 [E_local, N*T, H] tensor to
        write the experts' outputs into; low_latency_combine(...,
        zero_copy=True) with this handle then reads it instead of x. One
        per context and buffer set (reused two rounds later), allocated at
        the first call."""
        if not (type(handle) is _LLHandle and handle.plan is not None):
            raise TypeError("handle: expected the handle of a low_latency_dispatch of CUDA "
                            "bfloat16 x with int64 topk_idx (zero copy uses the context's "
                            f"reusable buffers), got {type(handle).__name__}")
        return handle.plan.ybuf(handle.rnd & 1)

    def destroy(self):
        self._scratch = None  # get_local_buffer_tensor refuses from now on
        self._plans.clear()
        for ep in self._eps.values():
            ep.close()
        self._eps.clear()
        self.comm.close()
