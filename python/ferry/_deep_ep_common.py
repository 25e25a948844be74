"""What deep_ep.Buffer's two modes share (the low-latency calls in
_deep_ep_ll, the normal mode's in _deep_ep_normal): the event object, the
tensor checks, the handles, the layout helpers and the settings. It
imports neither mode, and deep_ep (the Buffer) imports both."""
import ctypes as C
import functools
import operator
import threading

import torch

from . import EP, FerryError  # noqa: F401  (EP: for the mode modules)
from . import _elem_strides, _fmt_shape, _lib, _lib_handle  # noqa: F401  (_elem_strides: same)
from ._core import _env_int, _env_word, _torchext
from ._arrays import _stream_of


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
        if len(ts) != len(shape):
            raise ValueError(_mismatch(t, name, dtype, shape))
        for n, m in zip(shape, ts):  # a loop: cheaper than any() over a generator
            if n is not None and type(n) is not str and n != m:
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


def _record(tensors, stream):
    """t.record_stream(stream) for each CUDA tensor of tensors (anything
    else skipped): in one call of ferry._torchext where it is in use (12
    tensors: 2.9 us, against 5.4 us from Python, on the H100 machine)."""
    ext = _torchext()
    if ext is not None:
        ext.record(stream.stream_id, stream.device_index, stream.device_type, tensors)
        return
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


def _capture():
    """An EventOverlap holding an event recorded on the current stream
    (Buffer.capture)."""
    ev = torch.cuda.Event()
    ev.record()
    return EventOverlap(ev)


def _no_event():
    global _EVENT
    if _EVENT is None:
        _EVENT = EventOverlap()
    return _EVENT


def _event_after(x):
    """async_finish: a real CUDA event recorded on the current stream after
    ferry's launches, for CUDA tensors; CPU calls have finished (no event)."""
    if isinstance(x, torch.Tensor) and x.is_cuda:
        return _capture()
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
    if ep.dtype == "nvfp4":  # DeepEP's physical buffers, viewed by the caller
        rx = torch.empty((El, cap, H // 2), dtype=torch.uint8, device=dev)
        sc = ep.new_expert_scales(torch, torch.float32, torch.int32, dict(device=dev))
        cnt = torch.empty(El, dtype=torch.int32, device=dev)
        sr = torch.empty((El, cap), dtype=torch.int32, device=dev)
        st = torch.empty((El, cap), dtype=torch.int32, device=dev)
        return rx, sc, cnt, sr, st
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
_HT_MAX_TOKENS = _env_int("FERRY_DEEP_EP_MAX_TOKENS", 65536, 1, 1 << 20)


#: CUDA tensors: get_dispatch_layout through ferry_dispatch_layout's kernel
#: (1, the default: 15 us against 160 us for the PyTorch ops at T=4096 on
#: an H200, tools/bench_layout.py) or PyTorch ops (0); the host code serves
#: CPU tensors either way
_LAYOUT_KERNEL = _env_word("FERRY_DEEP_EP_LAYOUT_KERNEL", "1", ("0", "1")) == "1"


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


_LAYOUT_ARGS_SIZE = C.sizeof(_lib.LayoutArgs)
_TLS = threading.local()


def _errbuf():
    """This thread's buffer for a library message (ferry_dispatch_layout's)."""
    b = getattr(_TLS, "errbuf", None)
    if b is None:
        b = _TLS.errbuf = C.create_string_buffer(512)
    return b


def _layout_c(topk_idx, num_experts, N, ranks_per_node=0):
    """(per rank, per expert, is_token_in_rank, per node or None) from
    ferry_dispatch_layout: the host loop, or memsets and one kernel on the
    current stream; indices outside 0..E-1 count nowhere. ranks_per_node >
    0: nodes are blocks of that many consecutive ranks, counted too."""
    T, K = topk_idx.shape
    dev = topk_idx.device
    idx = topk_idx if topk_idx.is_contiguous() else topk_idx.contiguous()
    cuda = idx.is_cuda
    ext = _torchext()
    if ext is not None and (not cuda or torch.cuda.current_device() == dev.index):
        r = ext.layout(idx, num_experts, N, ranks_per_node,
                       _stream_of(idx, None) if cuda else None,
                       _lib.DEVICES["cuda" if cuda else "cpu"])
        if r[0] != 0:
            raise FerryError(r[0], f"get_dispatch_layout: {r[1]}")
        return r[1], r[2], r[3], r[4]
    # the counts in one allocation, back to back (one memset on CUDA)
    M = -(-N // ranks_per_node) if ranks_per_node > 0 else 0
    counts = torch.empty(N + num_experts + M, dtype=torch.int32, device=dev)
    # narrow: two plain views (split_with_sizes costs several times more)
    per_rank, per_expert = counts.narrow(0, 0, N), counts.narrow(0, N, num_experts)
    per_node = counts.narrow(0, N + num_experts, M) if M else None
    in_rank = torch.empty((T, N), dtype=torch.bool, device=dev)
    args = _lib.LayoutArgs(_LAYOUT_ARGS_SIZE, _lib.DEVICES["cuda" if cuda else "cpu"], T, K,
                           num_experts, N, idx.data_ptr(), per_rank.data_ptr(),
                           per_expert.data_ptr(), in_rank.data_ptr(),
                           _stream_of(idx, None) if cuda else None, ranks_per_node,
                           per_node.data_ptr() if per_node is not None else None)
    msg = _errbuf()
    # the memsets and the kernel run on the current device: topk_idx's
    if cuda and torch.cuda.current_device() != dev.index:
        with torch.cuda.device(dev):
            rc = _lib_handle().ferry_dispatch_layout(C.byref(args), msg, len(msg))
    else:
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
