"""deep_ep.Buffer's normal (high-throughput) mode: get_dispatch_layout,
dispatch and combine, intranode and internode, on ferry's routes."""
import warnings

import torch

from ._arrays import _stream_of
from ._core import FerryError, _lib_version, _torchext
from ._deep_ep_common import (EP, EventOverlap, _HT_MAX_TOKENS, _HtHandle,
                              _LAYOUT_KERNEL, _elem_strides, _event_after, _fmt_shape,
                              _layout_c, _layout_torch, _lib, _no_event, _plain_torch,
                              _record, _tensor)


#: the current stream's handle on a CUDA device (an index), without a Stream object
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream",
                      lambda i: torch.cuda.current_stream(i).cuda_stream)
#: torch.cuda.set_stream's call, without its checks (None: torch.cuda.stream then)
_SET_STREAM = getattr(torch._C, "_cuda_setStream", None)


def _dev_stream(dev):
    """The current stream's handle on CUDA device dev, or None (dev -1: the CPU)."""
    return _RAW_STREAM(dev) if dev >= 0 else None


def _set_stream(s):
    """s (a torch.cuda.Stream) the current stream of its device, which is
    the current device."""
    _SET_STREAM(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


#: most experts (slots) per token in a ferry context (FR_MAX_TOPK)
_MAX_TOPK = 16


class _On:
    """What _call needs of a context, for get_dispatch_layout (no context)."""
    needs_nonblocking_stream = False

    def __init__(self, device):
        self.device = device


_LAYOUT_ON = {True: _On("cuda"), False: _On("cpu")}


def _off_ep(ep, dev):
    """dev is not the context's device (type, and index on CUDA)."""
    return dev.type != ep.device or (ep._cuda_index is not None and dev.index != ep._cuda_index)


def _call_stream(ep, call, t):
    """The stream handle of call's launches for ferry: the comm stream's,
    else t's current stream on CUDA contexts (None on CPU)."""
    if call.stream is not None:
        return call.stream
    return _stream_of(t, None) if ep.device == "cuda" else None


def _ht_route(ep, routing, align, call, max_recv):
    """ep.route of routing, a contiguous int64 [T, K] tensor (checked by the
    caller), without its checks when it is on the context's device."""
    if _off_ep(ep, routing.device) or max_recv < 0:
        return ep.route(routing, align, stream=call.stream, max_recv=max_recv)
    st = _call_stream(ep, call, routing)
    return ep._route_run(ep._ep(), routing, routing.shape[0], routing.data_ptr(), align, st,
                         max_recv)


def _ht_combine(ep, route, y, w, call, weights_sum, bias, order):
    """ep.ht_combine of y (contiguous, dtype and shape checked by the
    caller) and the weights w (or None); without bias, when both are on
    the context's device and y has the route's rows, without its checks.
    Returns (out, weights or None)."""
    if w is not None:
        w = w.contiguous()
    dev = y.device
    if bias is not None or _off_ep(ep, dev) or (w is not None and w.device != dev) or \
            y.shape[0] != route.num_recv:
        out = ep.ht_combine(route, y, w, stream=call.stream, weights_sum=weights_sum,
                            bias=bias, sum_order=order)
        return out if w is not None else (out, None)
    pw = None if w is None else w.data_ptr() if route.num_recv else ep._given(y)
    st = _call_stream(ep, call, y)
    return ep._ht_combine_run(ep._ep(), route._handle(ep), route.num_tokens, y, y.data_ptr(),
                              pw, w is not None, st, weights_sum, (None, None),
                              1 if order == "slots" else 0)


def _ht_dispatch(ep, route, xt, xs, w, call, new, src_rank):
    """ep.ht_dispatch for the tensors dispatch checked (dtype and shape;
    x contiguous, scales float32 row-major or strided), without its
    checks: their device and x's shape against the route and the context
    are checked here (else ep.ht_dispatch, which names the argument). new: the outputs of a new routing (int64 top-k
    ids, weights when given, source tokens; the source ranks with
    src_rank, which only the handle across nodes reads)."""
    dev = xt.device
    if _off_ep(ep, dev) or (xs is not None and xs.device != dev) or \
            (w is not None and w.device != dev) or \
            tuple(xt.shape) != (route.num_tokens, ep.hidden) or _lib_version() < (0, 1, 2):
        outs = ("recv_topk_idx", "recv_topk_weights", "recv_src_token") + \
            (("recv_src_rank",) if src_rank else ())
        return ep.ht_dispatch(route, xt, xs, w, stream=call.stream, outputs=outs if new else (),
                              topk_idx_dtype="int64")
    T = xt.shape[0]
    px, ps, pw = xt.data_ptr(), None, None
    sst = (0, 0)
    if xs is not None:
        ps = xs.data_ptr() if T else ep._given(xt)
        if not xs.is_contiguous():
            sst = _elem_strides(xs)
    if w is not None:
        pw = w.data_ptr() if T else ep._given(xt)
    st = _call_stream(ep, call, xt)
    o = ep._ht_dispatch_run(ep._ep(), route._handle(ep), route.num_recv, xt, px, ps, sst, pw,
                            st, xt.dtype, xs is not None, True,
                            (new, new and w is not None, src_rank, new))
    return dict(zip(EP._HT_OUTS, o))


def _ht_route_dispatch(ep, routing, align, xt, xs, w, call, src_rank):
    """A new routing's route and dispatch in one call of ferry._torchext
    (the tensors checked as for _ht_route and _ht_dispatch; w contiguous):
    (route, outputs as _ht_dispatch's), or None where that does not apply
    (no module, another device, no tokens: the two calls then)."""
    ext = ep._ext(xt)
    dev = xt.device
    T = xt.shape[0]
    if ext is None or not T or _off_ep(ep, dev) or routing.device != dev or \
            (xs is not None and xs.device != dev) or (w is not None and w.device != dev):
        return None
    sst = _elem_strides(xs) if xs is not None and not xs.is_contiguous() else (0, 0)
    route, o = _route_dispatch_run(ep, ext, routing, align, xt, xs, sst, w,
                                   _call_stream(ep, call, xt), src_rank)
    return route, dict(zip(EP._HT_OUTS, o))


def _route_dispatch_run(ep, ext, routing, align, xt, xs, sst, w, st, src_rank):
    """ferry._torchext's route_dispatch on checked arguments (T > 0, all on
    the context's device; sst: the scales' element strides or (0, 0)):
    (route, the six outputs in EP._HT_OUTS's order)."""
    T = xt.shape[0]
    r = ext.route_dispatch(ep._ep().value, T, routing.data_ptr(), align, st,
                           ep.num_local_experts, xt, xt.dtype, xt.data_ptr(),
                           None if xs is None else xs.data_ptr(), sst[0], sst[1],
                           None if w is None else w.data_ptr(), st,
                           (xs is not None) | 2 | 4 | (w is not None) << 3 | src_rank << 4 | 32,
                           ep.topk, ep.hidden)
    route = ep._route_made(r, T)
    ep._check(r[4])
    return route, r[5:]


class _Call:
    """One normal-mode call's streams (Buffer._call). `with call:` makes
    the comm stream current (ferry's launches and the call's own torch
    work go there; outputs are made there); call.stream is its handle for
    ferry's calls (None: the current stream); settle() after each of
    ferry's launches (on_host: a context of a copying fabric provider,
    whose calls finish on the host; there it waits for the comm stream,
    so that no kernel of the call's own, e.g. one whose first launch
    loads its module, starts while a ferry kernel waits for the
    provider's copies, docs/architecture.md "Kernel loading");
    finish(made, read) returns the call's event."""
    __slots__ = ("comm", "_compute", "async_finish", "on_host", "like", "_ctx", "_csid")

    def __init__(self, comm, compute, async_finish, on_host, like, csid=None):
        self.comm, self._compute, self.async_finish = comm, compute, async_finish
        self.on_host, self.like, self._ctx = on_host, like, None
        # the compute stream's id where ferry._torchext made the waits
        # (call_begin): its Stream object only made if needed
        self._csid = csid

    @property
    def compute(self):
        if self._compute is None and self._csid is not None:
            c = self.comm
            self._compute = torch.cuda.Stream(stream_id=self._csid, device_index=c.device_index,
                                              device_type=c.device_type)
        return self._compute

    @property
    def stream(self):
        return self.comm.cuda_stream if self.comm is not None else None

    def __enter__(self):
        c = self.comm
        if c is not None:
            if _SET_STREAM is not None and c.device_index == torch.cuda.current_device():
                # the comm stream current, then the compute stream again on
                # leaving (the stream that was current on this device): what
                # torch.cuda.stream does, without its Python
                _set_stream(c)
                self._ctx = True
            else:  # torch.cuda.stream keeps the current device as it is
                self._ctx = torch.cuda.stream(c)
                self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            if self._ctx is True:
                c = self.comm
                if self._csid is not None:
                    _SET_STREAM(stream_id=self._csid, device_index=c.device_index,
                                device_type=c.device_type)
                else:
                    _set_stream(self.compute)
            else:
                self._ctx.__exit__(*exc)
            self._ctx = None
            if exc[0] is not None:  # whatever was queued, the caller's stream after it
                if self.on_host:
                    self.comm.synchronize()
                else:
                    self.compute.wait_stream(self.comm)
        return False

    def settle(self):
        if self.on_host:
            self.comm.synchronize()

    def finish(self, made=(), read=()):
        """The event the call returns. made: the tensors it made (on the
        comm stream) that outlive it; read: the caller's tensors it read
        there."""
        if self.comm is None:
            return _event_after(self.like) if self.async_finish else _no_event()
        if self._csid is not None:  # one call of ferry._torchext (not on_host)
            c = self.comm
            _torchext().call_end(self._csid, c.stream_id, c.device_index, c.device_type, made,
                                 read, self.async_finish)
            if not self.async_finish:
                return _no_event()
            ev = torch.cuda.Event()
            ev.record(c)
            return EventOverlap(ev)
        _record(made, self.compute)
        if self.on_host:  # finished on the host (_call)
            self.comm.synchronize()
            return _no_event()
        if not self.async_finish:
            self.compute.wait_stream(self.comm)
            return _no_event()
        _record(read, self.comm)
        ev = torch.cuda.Event()
        ev.record(self.comm)
        return EventOverlap(ev)


#: a call on the caller's stream, finished by it (no event): it keeps no state
_PLAIN = _Call(None, None, False, False, None)


class _Normal:
    """The normal (high-throughput) mode of deep_ep.Buffer."""

    #: (context, its tuple for ferry._torchext's new_plain, across nodes, the
    #: runtime that said so) of the last dispatch of a new routing made in one
    #: call (_new_plain), or None
    _plain_ctx = None
    #: (num_experts, group size, device index or -1, the runtime whose one
    #: node it was) of get_dispatch_layout's plain call in one call of
    #: ferry._torchext (layout_plain), or None
    _layout_ctx = None

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

    def _ht_ep(self, num_experts, topk, hidden, device="cuda", sms=None, forward="auto"):
        key = ("ht", num_experts, topk, hidden, device) + ((forward,) if forward != "auto"
                                                           else ())
        ep = self._eps.get(key)
        if ep is None:
            self._not_capturing("dispatch", key[1:])
            n = sms if sms is not None else self._kernel_sms("ht")
            ep = EP(self.comm, num_experts=num_experts, topk=topk, hidden=hidden,
                    max_tokens=_HT_MAX_TOKENS, dtype="bf16", device=device, mode="ht",
                    num_sms=n, forward=forward)
            self._eps[key] = ep
        else:
            self._ht_sms_check(ep, sms, "dispatch")
        return ep

    def _comm_stream(self, index):
        """The Buffer's communication stream on CUDA device index (DeepEP's
        comm stream): made at first use, non-blocking, at the highest
        priority (as DeepEP's), so that its blocks are scheduled before
        those of the caller's compute queued beside them."""
        comm = self._comm_streams.get(index)
        if comm is None:
            comm = self._comm_streams[index] = torch.cuda.Stream(device=index, priority=-1)
        return comm

    def _call(self, ep, like, previous_event, async_finish, allocate_on_comm_stream):
        """How a normal-mode call runs (_Call), as DeepEP's do: on the
        Buffer's comm stream, after previous_event (or the current
        stream); the call returns once its kernels are queued. With
        async_finish the returned event is recorded on the comm stream and
        every tensor the call reads or makes is recorded for the streams
        that use it (the caching allocator's record_stream), else the
        current stream waits for the comm stream (a stream wait, not the
        host). A call with none of previous_event, async_finish and
        allocate_on_comm_stream runs on the current stream itself: the
        same order as the comm stream between its two stream waits,
        without their host cost. CPU contexts and CUDA graph captures run
        on the caller's stream. A context whose fabric provider copies GPU
        memory with CUDA calls (needs_nonblocking_stream) finishes each
        call on the host."""
        if previous_event is None:
            if not async_finish and not allocate_on_comm_stream and \
                    not ep.needs_nonblocking_stream:
                return _PLAIN
        elif not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event: expected the EventOverlap of Buffer.capture() "
                            f"or of an earlier call, got {type(previous_event).__name__}")
        if ep.device != "cuda" or not like.is_cuda or torch.cuda.is_current_stream_capturing():
            if previous_event is not None:
                previous_event.current_stream_wait()
            return _Call(None, None, async_finish, False, like)
        on_host = ep.needs_nonblocking_stream
        ext = _torchext()
        if ext is not None and not on_host and _SET_STREAM is not None:
            di = like.get_device()
            if di == torch.cuda.current_device():
                # the waits in one call of ferry._torchext (call_begin),
                # the rest as below
                comm = self._comm_stream(di)
                pe = previous_event.event if previous_event is not None else None
                if pe is None or type(pe) is torch.cuda.Event:
                    csid = ext.call_begin(comm.stream_id, di, comm.device_type,
                                          None if pe is None else pe.cuda_event)
                    return _Call(comm, None, async_finish, False, like, csid)
        compute = torch.cuda.current_stream(like.device)
        comm = self._comm_stream(like.get_device())
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(compute)
        # GPU memory on the fabric path through a provider that copies with
        # CUDA calls in the fabric thread (shm, tcp): every call is finished
        # on the host, whatever the caller's stream (docs/architecture.md,
        # "Streams": calls queued back to back across nodes stalled there)
        return _Call(comm, compute, async_finish, on_host, like)

    @_plain_torch
    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                            async_finish=False, allocate_on_comm_stream=False):
        """DeepEP's: (num_tokens_per_rank [N] int32, num_tokens_per_rdma_rank
        [nodes] int32 (the tokens going to some rank of each node, nodes as
        buf.runtime numbers them; None on one node, as DeepEP), num_tokens_
        per_expert [E] int32, is_token_in_rank [T, N] bool, event), on
        topk_idx's device and stream. dispatch does not read them (ferry
        works its route out itself)."""
        lc = self._layout_ctx
        if lc is not None and type(num_experts) is int and num_experts == lc[0] and \
                lc[3] is self.runtime:
            # one node: one call of ferry._torchext, which takes topk_idx as
            # the path below would (else None); on the current stream, or
            # (previous_event, async_finish or allocate_on_comm_stream) on
            # the comm stream between _call's waits and records
            ext = _torchext()
            dev = lc[2]
            if ext is not None and (dev < 0 or torch.cuda.current_device() == dev):
                if previous_event is None and not async_finish and \
                        not allocate_on_comm_stream:
                    r = ext.layout_plain(lc, topk_idx, _dev_stream(dev))
                    if r is not None:
                        if r[0]:
                            raise FerryError(r[0], f"get_dispatch_layout: {r[1]}")
                        return r[1], None, r[2], r[3], _no_event()
                elif dev >= 0 and type(topk_idx) is torch.Tensor and topk_idx.is_cuda:
                    call = self._layout_call(topk_idx, previous_event, async_finish,
                                             allocate_on_comm_stream)
                    if call.comm is not None:
                        with call:
                            r = ext.layout_plain(lc, topk_idx, call.stream)
                            if r is not None:
                                if r[0]:
                                    raise FerryError(r[0], f"get_dispatch_layout: {r[1]}")
                                out = (r[1], None, r[2], r[3])
                                return out + (call.finish(made=out, read=(topk_idx,)),)
        _tensor(topk_idx, "topk_idx", torch.int64, ("T", "K"))
        if type(num_experts) is not int or num_experts != self.__dict__.get("_layout_E"):
            N = self.group_size  # an int checked once per value
            if not isinstance(num_experts, int) or num_experts < 1 or num_experts % N:
                raise ValueError(f"num_experts = {num_experts!r}: expected a positive multiple "
                                 f"of the group size {N}")
            _lib.c_int(num_experts, "num_experts")
            if type(num_experts) is int:
                self._layout_E = num_experts
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            # the current stream, no event: what _call gives, without its cost
            out = self._layout(topk_idx, num_experts) + (_no_event(),)
            if self._layout_ctx is None and type(num_experts) is int and \
                    self.runtime.get_num_rdma_ranks() == 1 and \
                    (_LAYOUT_KERNEL or not topk_idx.is_cuda) and _torchext() is not None:
                self._layout_ctx = (num_experts, self.group_size,
                                    topk_idx.device.index if topk_idx.is_cuda else -1,
                                    self.runtime)
            return out
        call = self._layout_call(topk_idx, previous_event, async_finish, allocate_on_comm_stream)
        with call:
            out = self._layout(topk_idx, num_experts)
            return out + (call.finish(made=out, read=(topk_idx,)),)

    def _layout_call(self, topk_idx, previous_event, async_finish, allocate_on_comm_stream):
        """get_dispatch_layout's streams: a GPU topk_idx's on the Buffer's
        comm stream, as the calls' (_call)."""
        return self._call(_LAYOUT_ON[topk_idx.is_cuda], topk_idx, previous_event, async_finish,
                          allocate_on_comm_stream)

    def _layout(self, topk_idx, num_experts):
        """get_dispatch_layout's four tensors, on the current stream."""
        N = self.group_size
        rt = self.runtime
        per_node = None
        # nodes of equal size in rank order: the kernel counts them too
        nodes = rt.get_num_rdma_ranks()
        rpn = rt._ranks_per_node() if nodes > 1 else 0
        if topk_idx.is_cuda and not _LAYOUT_KERNEL:
            per_rank, per_expert, is_token_in_rank = _layout_torch(topk_idx, num_experts, N)
        else:
            per_rank, per_expert, is_token_in_rank, per_node = _layout_c(
                topk_idx, num_experts, N, rpn)
        if nodes > 1 and per_node is None:
            hit = torch.zeros((is_token_in_rank.shape[0], nodes),
                              dtype=torch.int32, device=topk_idx.device)
            hit.index_add_(1, rt._nodes_on(topk_idx.device), is_token_in_rank.to(torch.int32))
            per_node = (hit > 0).sum(0, dtype=torch.int32)
        return per_rank, per_node, per_expert, is_token_in_rank

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
        if handle is None and not num_worst_tokens and self._plain_ctx is not None:
            r = self._new_plain(x, num_tokens_per_rank, is_token_in_rank,
                                num_tokens_per_expert, topk_idx, topk_weights,
                                expert_alignment, config, previous_event, async_finish,
                                allocate_on_comm_stream)
            if r is not None:
                return r
        # passed to libferry as C ints (max_recv, expert_alignment of the route)
        if num_worst_tokens:
            num_worst_tokens = _lib.c_int(int(num_worst_tokens), "num_worst_tokens")
            if num_worst_tokens < 0:
                raise ValueError(f"num_worst_tokens: {num_worst_tokens}: the bound on rows "
                                 f"received, or 0 (exact counts)")
        else:
            num_worst_tokens = 0
        if expert_alignment != 1 or type(expert_alignment) is not int:
            expert_alignment = _lib.c_int(int(expert_alignment or 1), "expert_alignment")
        if num_worst_tokens and isinstance(handle, _HtHandle) and \
                num_worst_tokens != handle.route.num_recv:
            raise ValueError(f"num_worst_tokens: {num_worst_tokens}, but the handle's routing "
                             f"receives {handle.route.num_recv} rows (a cached dispatch keeps "
                             f"the handle's routing)")
        fp8 = isinstance(x, tuple)
        xt, xs = (x[0], x[1]) if fp8 else (x, None)
        byte_dt = None
        if fp8 and isinstance(xt, torch.Tensor) and xt.dtype in (torch.int8, torch.uint8):
            # other 1-byte rows with their scales (vLLM's block-quantized
            # int8 models): moved bit for bit as fp8 rows are, returned in
            # their dtype, as DeepEP (which checks the size, not the dtype)
            byte_dt, xt = xt.dtype, xt.view(torch.float8_e4m3fn)
        _tensor(xt, "x", torch.float8_e4m3fn if fp8 else torch.bfloat16, ("T", "H"))
        cached = handle is not None
        if cached and not isinstance(handle, _HtHandle):
            raise TypeError(f"handle: expected the handle a normal-mode dispatch returned, got "
                            f"{type(handle).__name__}")
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
            if num_tokens_per_rank is not None and (
                    not isinstance(num_tokens_per_rank, torch.Tensor) or
                    num_tokens_per_rank.numel() != N):
                raise ValueError(f"num_tokens_per_rank: expected the {N} counts "
                                 f"get_dispatch_layout returned, got {num_tokens_per_rank!r}")
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
                K = N if N <= _MAX_TOPK else _MAX_TOPK
                by_rank = True
            else:
                _tensor(topk_idx, "topk_idx", torch.int64, (T, None))
                K = topk_idx.shape[1]
            ep = self._ht_ep(E, K, xt.shape[1], "cuda" if xt.is_cuda else "cpu",
                             self._config_sms(config, "dispatch"))
        else:
            ep = handle.ep
        if topk_weights is not None:
            _tensor(topk_weights, "topk_weights", torch.float32, (xt.shape[0], ep.topk))
        if cached and xt.shape[0] != handle.T:
            raise ValueError(f"x: {xt.shape[0]} tokens, the handle's routing has {handle.T}")
        call = self._call(ep, xt, previous_event, async_finish, allocate_on_comm_stream)
        with call:
            read = (xt, xs, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank)
            xs, carried = self._scales_in(xt, xs) if fp8 else (None, None)
            xt = xt.contiguous()
            if topk_weights is not None:
                topk_weights = topk_weights.contiguous()
            o = None
            if not cached:
                routing = self._rank_routing(is_token_in_rank.to(xt.device), E) if by_rank \
                    else topk_idx.contiguous()
                align = 1 if by_rank else expert_alignment
                rt = self.runtime
                internode = rt.get_num_rdma_ranks() > 1
                # route and dispatch in one call where they can be
                ro = None if num_worst_tokens or call.on_host else _ht_route_dispatch(
                    ep, routing, align, xt, xs, topk_weights, call, internode)
                if ro is None:
                    route = _ht_route(ep, routing, align, call, num_worst_tokens)
                    call.settle()
                else:
                    route, o = ro
                    if not by_rank and byte_dt is None:  # the next ones: _new_plain
                        self._plain_made(ep, xt, internode)
                in_rank = is_token_in_rank
                if num_tokens_per_rank is None or in_rank is None:
                    per_rank, _, _, in_rank = self._layout(routing, E)
                    num_tokens_per_rank = per_rank if num_tokens_per_rank is None else \
                        num_tokens_per_rank
                handle = self._ht_handle(ep, route, T, in_rank, num_tokens_per_rank, internode)
            route = handle.route
            # a cached dispatch returns recv_x alone; the first one also the
            # top-k ids and weights, and keeps the source tokens in the handle
            if o is None:
                o = _ht_dispatch(ep, route, xt, xs, topk_weights, call, not cached,
                                 not cached and handle.internode)
                call.settle()
            rx = o["recv_x"] if byte_dt is None else o["recv_x"].view(byte_dt)
            rs = self._scales_out(o["recv_x_scales"], carried) if fp8 else None
            recv_x = (rx, rs) if fp8 else rx
            if cached:  # DeepEP returns no handle for a cached dispatch (the caller has it)
                return recv_x, None, None, None, None, call.finish((rx, rs), read)
            handle.src_idx = o["recv_src_token"]
            handle.src_rank = o["recv_src_rank"]
            ridx = o["recv_topk_idx"]  # int64, as DeepEP returns it
            made = (rx, rs, ridx, o["recv_topk_weights"], handle.src_idx, handle.src_rank,
                    handle.in_rank, handle._prefix_of[1])
            # a bounded route (num_worst_tokens): rows padded to the bound, no
            # host wait, so no per-expert list (DeepEP returns it empty too)
            if route.num_recv_real is not None:
                counts = []
                made += (route.num_recv_real, route.expert_counts)
            elif by_rank:
                # per expert from the callers' counts, as DeepEP's notify sums them
                counts = self._expert_counts(num_tokens_per_expert, expert_alignment)
            else:
                counts = route.expert_counts.tolist()
            ev = call.finish(made, read)
            if by_rank:
                return recv_x, None, None, counts, handle, ev
            return recv_x, ridx, o["recv_topk_weights"], counts, handle, ev

    def _new_plain(self, x, per_rank, in_rank, per_expert, topk_idx, w, align, config,
                   previous_event, async_finish, allocate_on_comm_stream):
        """dispatch of a new routing without a bound in one call of
        ferry._torchext (new_plain), on the context the last such call used
        (_plain_ctx, set by the full path), where every argument is one the
        full path takes as it is: checked in C++ (torch tensors on the
        context's device, contiguous, bf16 rows or fp8 ones with float32
        scales [T, H/128] row-major or strided, top-k ids and weights [T,
        K], the layout's counts given). Its streams are _call's, as the full
        path's: the outputs made on the comm stream where there is one.
        Returns dispatch's 6-tuple, or None: the full path then (which
        converts, makes another context, warns or raises)."""
        ep, ctx, internode, rt = self._plain_ctx
        ext = _torchext()
        if ext is None or not ep._h or rt is not self.runtime:
            return None  # switched off, the context closed, or other nodes
        sms = self._config_sms(config, "dispatch") if config is not None else None
        dev = ctx[5]
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            if ep.needs_nonblocking_stream:  # finished on the host: _call's
                return None
            call, st, alloc = _PLAIN, _dev_stream(dev), None
        else:
            xt = x[0] if type(x) is tuple and x else x
            if type(xt) is not torch.Tensor:
                return None
            call = self._call(ep, xt, previous_event, async_finish, allocate_on_comm_stream)
            if call.on_host:
                return None
            comm = call.comm
            if comm is None:
                st, alloc = _dev_stream(dev), None
            else:
                st, alloc = comm.cuda_stream, (comm.stream_id, comm.device_index,
                                               comm.device_type)
        try:
            r = ext.new_plain(ctx, x, topk_idx, w, per_expert, per_rank, in_rank, align, st,
                              alloc)
            if r is None:
                return None
            T = topk_idx.shape[0]
            route = ep._route_made(r, T)
            ep._check(r[4])
        except BaseException:
            if call.comm is not None:  # whatever was queued, the caller's stream after it
                call.compute.wait_stream(call.comm)
            raise
        # as the full path: a config asking for other SMs warned about once
        self._ht_sms_check(ep, sms, "dispatch")
        handle = self._ht_handle(ep, route, T, in_rank, per_rank, internode)
        handle.src_rank, handle.src_idx = r[9], r[10]
        rx, rs = r[5], r[6]
        if call is _PLAIN:
            ev = _no_event()
        else:
            xt, xs = x if rs is not None else (x, None)
            ev = call.finish((rx, rs, r[7], r[8], r[10], r[9], in_rank, per_rank),
                             (xt, xs, topk_idx, w, in_rank, per_rank))
        return (rx if rs is None else (rx, rs), r[7], r[8], route.expert_counts.tolist(),
                handle, ev)

    def _ht_handle(self, ep, route, T, in_rank, per_rank, internode):
        """A new routing's handle (its source rows set by the dispatch)."""
        handle = _HtHandle(ep, route, T, None, in_rank, internode=internode)
        # rank_prefix_matrix needs every rank's counts: gathered when
        # first read (collective then; DeepEP's own callers never read it)
        handle._prefix_of = (self, per_rank)
        if internode:
            handle.ep_nodes = list(self.runtime._node_of)
        return handle

    def _plain_made(self, ep, xt, internode):
        """The full path made a new routing's plain dispatch in one call of
        ferry._torchext on ep: the next ones go through _new_plain."""
        dev = xt.device.index if ep.device == "cuda" else -1
        self._plain_ctx = (ep, (
            ep._ep().value, self.group_size, ep.num_local_experts, ep.topk, ep.hidden,
            -1 if dev is None else dev, 2 | 4 | 32 | internode << 4), internode, self.runtime)

    @staticmethod
    def _rank_routing(in_rank, E):
        """The routing of a dispatch without top-k: each token to the first
        expert of every rank is_token_in_rank [T, N] names, as a top-k of
        N slots (-1 elsewhere); above _MAX_TOPK ranks, the named ranks
        gathered into _MAX_TOPK slots (a host wait to check that no token
        names more: ValueError naming is_token_in_rank)."""
        T, N = in_rank.shape
        first = torch.arange(N, dtype=torch.int64, device=in_rank.device) * (E // N)
        if N <= _MAX_TOPK:
            return torch.where(in_rank, first.view(1, N),
                               torch.full_like(first, -1).view(1, N)).contiguous()
        most = int(in_rank.sum(1).max()) if T else 0
        if most > _MAX_TOPK:
            raise ValueError(f"is_token_in_rank: a token goes to {most} ranks; ferry's "
                             f"dispatch without top-k takes at most {_MAX_TOPK} per token")
        # the named ranks first (value 1), then -1 for the slots left
        val, rk = torch.topk(in_rank.to(torch.int32), _MAX_TOPK, dim=1)
        return torch.where(val > 0, first[rk], torch.full_like(rk, -1)).contiguous()

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
        if not isinstance(handle, _HtHandle):
            raise TypeError(f"handle: expected the handle a normal-mode dispatch returned, got "
                            f"{type(handle).__name__}")
        ep, route = handle.ep, handle.route
        self._ht_sms_check(ep, self._config_sms(config, "combine"), "combine")
        _tensor(x, "x", torch.bfloat16, (route.num_recv, ep.hidden))
        if topk_weights is not None:
            _tensor(topk_weights, "topk_weights", torch.float32, (route.num_recv, ep.topk))
        call = self._call(ep, x, previous_event, async_finish, allocate_on_comm_stream)
        with call:
            read = (x, topk_weights) + (bias if isinstance(bias, tuple) else (bias,))
            # DeepEP takes strided bias; ht_combine checks the count, shapes,
            # dtype and device, naming bias[i]
            if bias is not None:
                bias = tuple(b.contiguous() if isinstance(b, torch.Tensor) else b
                             for b in (bias if isinstance(bias, tuple) else (bias,)))
            # with weights, DeepEP's combined_topk_weights: slot k summed over
            # the rows of every rank the token went to
            out, w = _ht_combine(ep, route, x.contiguous(), topk_weights, call,
                                 topk_weights is not None, bias, "ranks")
            call.settle()
            return out, w, call.finish((out, w), read)

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
