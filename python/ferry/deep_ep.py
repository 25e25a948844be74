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
import weakref

import torch

from . import Comm, EP, FerryError  # noqa: F401  (EP: for the mode modules)
from . import _elem_strides, _fmt_shape, _group_info, _is_mpi_comm, _lib, _lib_handle  # noqa: F401
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


def _ll_recv_tensors(ep, fp8, dev):
    """A low-latency dispatch's outputs for context `ep` on device `dev`:
    recv_x [E_local, capacity, H] (fp8 or bf16), its scales (DeepEP's
    column-major layout, written so by the kernel; None without fp8), the
    per-expert counts, and each row's source rank and token."""
    El, cap, H = ep.num_local_experts, ep.capacity, ep.hidden
    rx = torch.empty((El, cap, H), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                     device=dev)
    sc = ep.new_expert_scales(torch, torch.float32, torch.int32, dict(device=dev)) \
        if fp8 else None
    cnt = torch.empty(El, dtype=torch.int32, device=dev)
    sr = torch.empty((El, cap), dtype=torch.int32, device=dev)
    st = torch.empty((El, cap), dtype=torch.int32, device=dev)
    return rx, sc, cnt, sr, st


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
            rx, sc, cnt, sr, st = _ll_recv_tensors(ep, fp8, dev)
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
        self._prefix, self.in_rank = prefix, in_rank
        self._prefix_of = None  # (the Buffer, this rank's tokens per rank): prefix's source
        self.internode = internode
        self.src_idx = None   # set by the dispatch that made the route
        self.src_rank = None  # each received row's source rank (same)
        self._gbl = self._rdma = None  # the prefix sums, made when first read

    @property
    def prefix(self):
        """rank_prefix_matrix: int32 [N, N], [i][j] = tokens ranks 0..i send
        to rank j. It needs every rank's counts, which no call needs: they
        are gathered when it is first read (collective: every rank of the
        group reads it, as DeepEP's tests do), not by the dispatch."""
        if self._prefix is None and self._prefix_of is not None:
            buf, mine = self._prefix_of
            self._prefix = buf._rank_prefix(mine, mine.device)
        return self._prefix

    def _recv_prefix(self):
        """recv_gbl_rank_prefix_sum: int32 [N], rows this rank received from
        ranks 0..i (rows arrive by source rank)."""
        if self._gbl is None and self.src_rank is not None:
            N = self.ep.num_ranks
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


from ._deep_ep_ll import _LowLatency  # noqa: E402  (after the names they use)
from ._deep_ep_normal import _Normal  # noqa: E402


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

    def get_comm_stream(self):
        """DeepEP's communication stream: the stream of this Buffer's on the
        current device where normal-mode calls run (after previous_event or
        the current stream; see dispatch), None without CUDA. Low-latency
        calls run on the current stream."""
        if not torch.cuda.is_available():
            return None
        return self._comm_stream(torch.device("cuda", torch.cuda.current_device()))

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
        for ep in self._eps.values():
            ep.close()
        self._eps.clear()
        self.comm.close()
