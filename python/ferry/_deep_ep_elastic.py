"""DeepEP 2's deep_ep.ElasticBuffer (its V2 EP API) on ferry's
high-throughput engine: dispatch and combine with an EPHandle, no NCCL
device API, no NVSHMEM, no compiler at run time.

Rows arrive in one canonical order whatever the timing (by source rank,
then source token, as ferry's engine lays them out), so `deterministic`
costs nothing: every dispatch is deterministic. What is served and what
is not is listed in docs/python.md ("ElasticBuffer").
"""
import torch

from ._deep_ep_common import EventOverlap as _V1Event
from ._deep_ep_common import _plain_torch, _record, _tensor
from ._deep_ep_normal import _ht_combine, _ht_dispatch, _ht_route, _ht_route_dispatch

_ALIGN_BYTES = 2 << 20
_MAX_TOPK_CONTEXT = 16  # most slots per token in a ferry context (FR_MAX_TOPK)  # DeepEP 2's buffer sizes are 2 MiB multiples


def _align(v, a):
    return (v + a - 1) // a * a


class EventOverlap:
    """DeepEP 2's EventOverlap: event (a CUDA event, or None: nothing to
    wait for), extra_tensors kept alive with it, and a hook run once after
    the first wait (register_hook_after_wait)."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait = None

    def current_stream_wait(self, release_handle=False):
        if self.event is None:
            raise ValueError("EventOverlap.current_stream_wait: no event (the call was not "
                             "asynchronous, or the event was released)")
        self.event.current_stream_wait() if hasattr(self.event, "current_stream_wait") \
            else torch.cuda.current_stream().wait_event(self.event)
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook):
        if self.hook_after_wait is not None:
            raise ValueError("EventOverlap.register_hook_after_wait: a hook is already "
                             "registered")
        self.hook_after_wait = hook

    def __call__(self, release_handle=False):
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.event is not None:
            self.current_stream_wait(self._release_handle_by_call)
        self._release_handle_by_call = False


class EPHandle:
    """What a dispatch returns for its combine and for cached dispatches
    (DeepEP 2's fields; plain attributes a caller may read and set).
    ferry's own: _ep (the context), _route (its route). The tensors of
    _LAZY that a dispatch does not need itself are made when one of them
    is first read (no combine reads them): their launches cost a dispatch
    nothing until then (_build)."""

    def __init__(self, do_expand, num_experts, expert_alignment, num_max_tokens_per_rank,
                 num_sms, topk_idx, num_recv_tokens, num_expanded_tokens,
                 num_recv_tokens_per_expert_list, psum_num_recv_tokens_per_scaleup_rank=None,
                 psum_num_recv_tokens_per_expert=None, num_unaligned_recv_tokens_per_expert=None,
                 recv_src_metadata=None, dst_buffer_slot_idx=None, token_metadata_at_forward=None,
                 channel_linked_list=None):
        d = self.__dict__
        d["_make"] = None  # set by the dispatch: makes the _LAZY tensors
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        d["psum_num_recv_tokens_per_scaleup_rank"] = psum_num_recv_tokens_per_scaleup_rank
        d["psum_num_recv_tokens_per_expert"] = psum_num_recv_tokens_per_expert
        d["num_unaligned_recv_tokens_per_expert"] = num_unaligned_recv_tokens_per_expert
        d["recv_src_metadata"] = recv_src_metadata
        d["dst_buffer_slot_idx"] = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self._ep = self._route = None
        self._exp_pos = None  # expanded: [R, K] row of each (row, slot), -1 elsewhere

    def _build(self):
        """The _LAZY tensors, made now if they are still to be made."""
        make = self.__dict__["_make"]
        if make is not None:
            self.__dict__["_make"] = None
            self.__dict__.update(make())


_LAZY = ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
         "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx")


def _lazy_field(name):
    def get(self):
        self._build()
        return self.__dict__[name]

    def put(self, v):
        self._build()  # the others keep the dispatch's values
        self.__dict__[name] = v
    return property(get, put, doc=f"DeepEP 2's {name} (made when first read)")


for _n in _LAZY:
    setattr(EPHandle, _n, _lazy_field(_n))


_EXPERIMENTAL = ("engram_write", "engram_fetch", "pp_set_config", "pp_send", "pp_recv",
                 "create_agrs_session", "destroy_agrs_session", "agrs_new_session",
                 "agrs_set_config", "agrs_get_inplace_tensor", "all_gather")
_EXPERIMENTAL_STATIC = ("get_engram_storage_size_hint", "get_pp_buffer_size_hint",
                        "get_agrs_num_max_session_bytes", "get_agrs_buffer_size_hint")


def _refused(name):
    def f(*a, **k):
        raise NotImplementedError(
            f"ferry.deep_ep.ElasticBuffer.{name}: DeepEP 2's experimental Engram, pipeline-"
            f"parallel and all-gather/reduce-scatter methods are not served by ferry "
            f"(docs/python.md, 'ElasticBuffer')")
    f.__name__ = name
    return f


def _on_stream(st, dev, fn, args):
    """fn(*args) on stream st (a CUDA stream, or None: CPU), then the current
    stream ordered after it and the tensors made there kept for it."""
    if st is None:
        return fn(*args)
    cur = torch.cuda.current_stream(dev)
    if st == cur:
        return fn(*args)
    with torch.cuda.stream(st):
        out = fn(*args)
    cur.wait_stream(st)
    _record(tuple(out.values()), cur)
    return out


def _handle_tensors(o, kept, u, E, El, K, A, maxT, N, cpu_sync, do_expand, dev, slots,
                    dst=None):
    """An EPHandle's tensors from a dispatch's outputs, with few launches
    (each costs the host one on a GPU). An exact route (cpu_sync) has every
    received row real and its unaligned per-expert counts u on the host:
    the per-expert sums are made there and copied once. A bounded route's
    rows past the real count are padding (source -1) and its counts are
    made on the device."""
    src, tok, ridx = o["recv_src_rank"], o["recv_src_token"], o["recv_topk_idx"]
    R = src.shape[0]
    valid = None if cpu_sync else src >= 0
    key = None  # a local expert per (row, slot), El elsewhere
    if cpu_sync:
        import numpy as np
        a = (u + (A - 1)) // A * A
        start = np.cumsum(a) - a
        host = torch.from_numpy(np.concatenate(
            [u, start + u if do_expand else np.cumsum(a), start, np.cumsum(u) - u])
            .astype(np.int32))
        dv = host.to(dev, non_blocking=True) if dev.type == "cuda" else host
        unaligned, psum_exp = dv[:El], dv[El:2 * El]
        start, ustart = dv[2 * El:3 * El], dv[3 * El:]
    else:
        key = torch.where(ridx >= 0, ridx, El).reshape(-1)
        cnt = torch.zeros(El + 1, dtype=torch.int32, device=dev)
        cnt.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
        unaligned = cnt[:El].clone()
        aligned = (unaligned + (A - 1)) // A * A
        start = torch.cumsum(aligned, 0, dtype=torch.int32) - aligned  # S_e
        ustart = torch.cumsum(unaligned, 0, dtype=torch.int32) - unaligned
        psum_exp = start + unaligned if do_expand else \
            torch.cumsum(aligned, 0, dtype=torch.int32)
    # columns 2.. are DeepEP's "uninitialized" unless expanded; a bounded
    # route's are -1, its padding rows -1 throughout
    meta = torch.empty((R, K + 2), dtype=torch.int32, device=dev) if cpu_sync else \
        torch.full((R, K + 2), -1, dtype=torch.int32, device=dev)
    col0 = torch.add(tok, src, alpha=maxT)
    # column 1: source rank x K + the highest slot of an expert here
    slot = slots.get((K, dev))
    if slot is None:
        slot = slots[(K, dev)] = torch.arange(K, dtype=torch.int32, device=dev)
    hi = torch.where(ridx >= 0, slot, -1).amax(1).to(torch.int32) if K else \
        torch.full((R,), -1, dtype=torch.int32, device=dev)
    col1 = torch.add(hi, src, alpha=K)
    meta[:, 0] = col0 if valid is None else torch.where(valid, col0, -1)
    meta[:, 1] = col1 if valid is None else torch.where(valid, col1, -1)
    # rows per source rank, inclusive prefix sum (not bincount: on a
    # GPU it reads the largest value on the host)
    per_src = torch.zeros(N, dtype=torch.int32, device=dev)
    if valid is None:
        per_src.index_add_(0, src, torch.ones(R, dtype=torch.int32, device=dev))
    else:
        per_src.index_add_(0, src.clamp(min=0), valid.to(torch.int32))
    psum_rank = torch.cumsum(per_src, 0, dtype=torch.int32)
    exp_pos = None
    if do_expand:
        if key is None:
            key = torch.where(ridx >= 0, ridx, El).reshape(-1)
        order = torch.sort(key, stable=True).indices
        p = torch.arange(key.numel(), dtype=torch.int32, device=dev)
        ks = key[order]
        kc = ks.clamp(max=El - 1)
        pos_sorted = torch.where(ks < El, start[kc] + p - ustart[kc], -1).to(torch.int32)
        pos = torch.empty_like(pos_sorted)
        pos[order] = pos_sorted
        exp_pos = pos.view(R, K)
        meta[:, 2:] = exp_pos
    if dst is None:  # -1 // El is -1: no mask needed
        dst = torch.div(kept, El, rounding_mode="floor").to(torch.int32)
    return {"psum_num_recv_tokens_per_scaleup_rank": psum_rank,
            "psum_num_recv_tokens_per_expert": psum_exp,
            "num_unaligned_recv_tokens_per_expert": unaligned, "recv_src_metadata": meta,
            "dst_buffer_slot_idx": dst, "_exp_pos": exp_pos}


class ElasticBuffer:
    """deep_ep.ElasticBuffer of DeepEP 2.1.0 on ferry (see the module)."""
    _legacy = None  # ferry.deep_ep.Buffer

    def __init__(self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0,
                 hidden=0, num_topk=0, use_fp8_dispatch=False, deterministic=False,
                 allow_hybrid_mode=True, allow_multiple_reduction=True,
                 prefer_overlap_with_compute=True, sl_idx=3, num_allocated_qps=0,
                 num_cpu_timeout_secs=300, num_gpu_timeout_secs=100, explicitly_destroy=False):
        if num_cpu_bytes:
            raise NotImplementedError("ElasticBuffer: num_cpu_bytes (the Engram segment) is "
                                      "not served by ferry")
        if num_bytes is None and (num_max_tokens_per_rank <= 0 or hidden <= 0):
            raise ValueError(f"ElasticBuffer: without num_bytes, num_max_tokens_per_rank "
                             f"({num_max_tokens_per_rank}) and hidden ({hidden}) must be "
                             f"positive")
        if num_bytes is not None and (num_bytes <= 0 or num_bytes % _ALIGN_BYTES):
            raise ValueError(f"num_bytes: {num_bytes}: must be a positive multiple of 2 MiB")
        for name, v in (("num_cpu_timeout_secs", num_cpu_timeout_secs),
                        ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: {v!r}: must be a positive number of seconds")
        # the normal mode of ferry.deep_ep.Buffer (set by ferry.deep_ep,
        # which imports this module) makes the contexts and streams
        self._buf = self._legacy(group, low_latency_mode=False,
                                 explicitly_destroy=explicitly_destroy)
        self.group = group
        self.rank_idx, self.num_ranks = self._buf.rank, self._buf.group_size
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.deterministic = bool(deterministic)
        self.num_max_tokens_per_rank = int(num_max_tokens_per_rank)
        self.hidden, self.num_topk = int(hidden), int(num_topk)
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.num_bytes = num_bytes if num_bytes is not None else self._size(
            self.num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch)
        self.sl_idx = sl_idx
        self.num_allocated_qps = num_allocated_qps or 17
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        rt = self._buf.runtime
        self.num_rdma_ranks = rt.get_num_rdma_ranks()
        self.num_nvlink_ranks = self.num_ranks // self.num_rdma_ranks
        # ferry's rows come by source rank: one scale-up domain of every rank
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.runtime = self._buf.runtime
        self._destroyed = False
        self._slots = {}  # (K, device) -> arange(K) int32, for the handles' metadata

    # ---------------------------------------------------------------- sizes

    @staticmethod
    def _size(N, T, H, K, fp8):
        """A buffer size of DeepEP 2's form (2 MiB multiples): what ferry's
        context for these sizes holds at most (rings per channel and peer,
        independent of T), reported for callers that size by it."""
        K = K or 32
        row = H * (1 if fp8 else 2) + (H // 128) * 4 + K * 8 + 16
        return _align(max(1, N) * max(1, T) * row, _ALIGN_BYTES)

    @staticmethod
    def get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk=0,
                             use_fp8_dispatch=False, allow_hybrid_mode=True,
                             allow_multiple_reduction=True):
        if num_max_tokens_per_rank <= 0 or hidden <= 0:
            raise ValueError("get_buffer_size_hint: num_max_tokens_per_rank and hidden must be "
                             "positive")
        N = group.size() if group is not None else torch.distributed.get_world_size()
        return ElasticBuffer._size(N, num_max_tokens_per_rank, hidden, num_topk,
                                   use_fp8_dispatch)

    # ------------------------------------------------------------ the rest

    @staticmethod
    def capture():
        """An event recorded on the current stream (previous_event)."""
        ev = torch.cuda.Event()
        ev.record()
        return _V1Event(ev)

    def get_comm_stream(self):
        return self._buf._comm_stream(torch.cuda.current_device())

    def get_physical_domain_size(self):
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self):
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts, num_topk, num_scaleout_topk=0, rdma_gbs=0,
                                nvlink_gbs=0, sm_read_gbs=200, sm_write_gbs=50):
        """ferry's default SMs for its normal-mode kernels on this group
        (the GPU's multiprocessors over the group's ranks on it, at most
        24): its own kernels' need, not DeepEP 2's bandwidth model."""
        return self._buf._kernel_sms("ht")

    def get_theoretical_num_qps(self, num_sms):
        return min(num_sms, 9, self.num_allocated_qps)

    def barrier(self, use_comm_stream=True, with_cpu_sync=False, sequential=True):
        """Every rank's GPU work queued so far is done before any rank
        returns (a host barrier of the group after a device sync)."""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if self._buf._mpi is not None:
            self._buf._mpi.Barrier()
        else:
            torch.distributed.barrier(group=self.group)

    def destroy(self):
        if self._destroyed:
            return
        self._destroyed = True
        self._buf.destroy()

    def __del__(self):
        try:
            if not self._destroyed and not self.explicitly_destroy:
                self._buf.destroy()
        except Exception:
            pass

    def _live(self, what):
        if self._destroyed:
            raise ValueError(f"ElasticBuffer.{what}: the buffer was destroyed")

    # -------------------------------------------------------------- dispatch

    @_plain_torch
    def dispatch(self, x, topk_idx=None, topk_weights=None,
                 cumulative_local_expert_recv_stats=None, num_experts=None,
                 num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0,
                 previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None,
                 do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False,
                 use_tma_aligned_col_major_sf=False):
        """DeepEP 2's dispatch (docs/python.md, 'ElasticBuffer'). Returns
        (recv_x, recv_topk_idx, recv_topk_weights, handle, event)."""
        self._live("dispatch")
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("dispatch: previous_event needs allocate_on_comm_stream=True (as "
                             "DeepEP 2's)")
        if do_zero_padding and not do_expand:
            raise ValueError("dispatch: do_zero_padding needs do_expand=True")
        fp8 = isinstance(x, tuple)
        xt, xs = (x[0], x[1]) if fp8 else (x, None)
        _tensor(xt, "x", torch.float8_e4m3fn if fp8 else torch.bfloat16, ("T", "H"))
        T, H = xt.shape
        N = self.num_ranks
        cached = handle is not None
        if cached:
            if not isinstance(handle, EPHandle) or handle._route is None:
                raise TypeError("handle: expected the EPHandle of an ElasticBuffer.dispatch")
            if topk_idx is not None:
                raise ValueError("dispatch: a cached dispatch (handle) takes no topk_idx")
            if do_cpu_sync:
                raise ValueError("dispatch: a cached dispatch (handle) does no CPU sync")
            if do_expand != handle.do_expand and handle._exp_pos is None:
                raise ValueError("dispatch: do_expand on a handle made without it")
            ep, route = handle._ep, handle._route
            E, maxT, A = handle.num_experts, handle.num_max_tokens_per_rank, \
                handle.expert_alignment
            K = handle.topk_idx.shape[1]
            if T != handle.topk_idx.shape[0]:
                raise ValueError(f"x: {T} tokens, the handle's routing has "
                                 f"{handle.topk_idx.shape[0]}")
        else:
            if topk_idx is None:
                raise TypeError("dispatch: topk_idx is required without a handle")
            if num_experts is None:
                raise TypeError("dispatch: num_experts is required without a handle")
            E = int(num_experts)
            if E <= 0 or E % N:
                raise ValueError(f"num_experts: {E}: must be a positive multiple of the "
                                 f"group size {N}")
            _tensor(topk_idx, "topk_idx", torch.int64, (T, None))
            K = topk_idx.shape[1]
            if not 1 <= K <= _MAX_TOPK_CONTEXT:
                raise ValueError(f"topk_idx: {K} slots per token; ferry takes 1.."
                                 f"{_MAX_TOPK_CONTEXT}")
            maxT = int(num_max_tokens_per_rank or self.num_max_tokens_per_rank)
            A = int(expert_alignment or 1)
            if A < 1:
                raise ValueError(f"expert_alignment: {A}: must be at least 1")
            do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
            # flat: every rank's rows straight to the token's rank, summed
            # in DeepEP 2's order without hybrid mode, as the logical domain
            # (1, N) says (forwarding would sum per node first)
            ep = self._buf._ht_ep(E, K, H, "cuda" if xt.is_cuda else "cpu",
                                  num_sms if num_sms else None, "off")
        if maxT <= 0 or T > maxT:
            raise ValueError(f"x: {T} tokens, above num_max_tokens_per_rank = {maxT}")
        if topk_weights is not None:
            _tensor(topk_weights, "topk_weights", torch.float32, (T, K))
        El = E // N
        call = self._buf._call(ep, xt, previous_event, async_with_compute_stream,
                               allocate_on_comm_stream)
        with call:
            if fp8:
                xs, carried = self._buf._scales_in(xt, xs)
            xt = xt.contiguous()
            if topk_weights is not None:
                topk_weights = topk_weights.contiguous()
            o = None
            if not cached:
                kept = topk_idx.clone() if do_handle_copy else topk_idx
                # an exact route's counts come to the host unaligned (the
                # handle's sums are made there); a bounded one's stay on
                # the device, aligned. An exact one and its dispatch are one
                # call of ferry._torchext where they can be.
                routing = topk_idx.contiguous()
                ro = _ht_route_dispatch(ep, routing, 1, xt, xs, topk_weights, call, True) \
                    if do_cpu_sync and not call.on_host else None
                if ro is None:
                    route = _ht_route(ep, routing, 1 if do_cpu_sync else A, call,
                                      0 if do_cpu_sync else N * maxT)
                    call.settle()
                else:
                    route, o = ro
            if o is None:
                o = _ht_dispatch(ep, route, xt, xs, topk_weights, call, True, True)
                call.settle()
            rx, rsf = o["recv_x"], (self._buf._scales_out(o["recv_x_scales"], carried)
                                    if fp8 else None)
            ridx, rw = o["recv_topk_idx"], o["recv_topk_weights"]
            if not cached:
                handle = self._new_handle(ep, route, kept, o, E, El, K, A, maxT, N,
                                          do_cpu_sync, do_expand, num_sms, xt.device,
                                          call.comm, do_handle_copy)
            made = (rx, rsf, ridx, rw)
            if cumulative_local_expert_recv_stats is not None:
                _tensor(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats",
                        torch.int32, (El,))
                st = handle.num_unaligned_recv_tokens_per_expert
                cumulative_local_expert_recv_stats.add_(st)
                made += (handle.recv_src_metadata, handle.psum_num_recv_tokens_per_scaleup_rank,
                         handle.psum_num_recv_tokens_per_expert, st)
            if do_expand:
                rx, rsf, rw = self._expand(handle, rx, rsf, rw, do_zero_padding)
                ridx = None
            if fp8 and use_tma_aligned_col_major_sf:
                R = rsf.shape[0]
                cm = torch.empty_strided(rsf.shape, (1, _align(R, 4)), dtype=rsf.dtype,
                                         device=rsf.device)
                cm.copy_(rsf)
                rsf = cm
            recv_x = (rx, rsf) if fp8 else rx
            made = (rx, rsf, ridx, rw) + made[4:]
            ev = call.finish(made, (xt, xs, topk_idx, topk_weights))
        return recv_x, ridx, rw, handle, EventOverlap(ev.event if ev is not None else None)

    def _new_handle(self, ep, route, kept, o, E, El, K, A, maxT, N, cpu_sync, do_expand,
                    num_sms, dev, comm, copied):
        """The EPHandle of a new routing. Its host values now; its tensors
        (_handle_tensors) from the dispatch's outputs on the dispatch's
        stream (comm, or the current stream), now with do_expand (the
        dispatch needs them) or in a CUDA graph capture, else when first
        read (EPHandle._build), the reader's current stream then waiting
        for that stream. copied: kept is the handle's copy of topk_idx."""
        src = o["recv_src_rank"]
        R = src.shape[0]
        if cpu_sync:
            import numpy as np
            c = route.expert_counts
            u = np.asarray(c, dtype=np.int64)
            # as Python ints through tolist (a loop over numpy scalars costs
            # the host about 25 us at 128 experts)
            elist = c.tolist() if A == 1 else [(v + A - 1) // A * A for v in c.tolist()]
            n_exp = sum(elist)
        else:
            u = None
            elist = []
            n_exp = _align(N * maxT * min(K, El) + (A - 1) * El, A)
        h = EPHandle(do_expand, E, A, maxT, num_sms, kept, R, n_exp, elist)
        h._ep, h._route = ep, route
        slots = self._slots
        st = None
        if dev.type == "cuda":
            st = comm if comm is not None else torch.cuda.current_stream(dev)
        args = (o, kept, u, E, El, K, A, maxT, N, cpu_sync, do_expand, dev, slots)
        if do_expand or (st is not None and torch.cuda.is_current_stream_capturing()):
            # now: the dispatch needs them, or a graph replays the dispatch
            # (its handle's tensors replayed with it)
            t = _handle_tensors(*args)
            h._exp_pos = t.pop("_exp_pos")
            h.__dict__.update(t)
        else:
            # later, from what the caller cannot change: the handle's own
            # copy of recv_topk_idx (one launch), the source ranks and
            # tokens (the caller never sees them), topk_idx's copy
            # (do_handle_copy) or, without one, its destinations now
            o = {"recv_src_rank": src, "recv_src_token": o["recv_src_token"],
                 "recv_topk_idx": o["recv_topk_idx"].clone()}
            dst = None if copied else \
                torch.div(kept, El, rounding_mode="floor").to(torch.int32)
            args = (o,) + args[1:] + (dst,)
            h.__dict__["_make"] = lambda: _on_stream(st, dev, _handle_tensors, args)
        return h

    @staticmethod
    def _expand(h, rx, rsf, rw, zero):
        """Rows by local expert (DeepEP 2's do_expand): each (row, slot)
        with an expert here at its place in that expert's segment."""
        pos = h._exp_pos
        R, K = pos.shape
        n = h.num_expanded_tokens
        dev = rx.device
        rows = torch.arange(R, dtype=torch.int64, device=dev).unsqueeze(1).expand(R, K)
        at = torch.where(pos >= 0, pos.long(), torch.full_like(rows, n))  # n: a spare row
        src = torch.full((n + 1,), -1, dtype=torch.int64, device=dev)
        src.scatter_(0, at.reshape(-1), rows.reshape(-1))
        src = src[:n]
        take = src.clamp(min=0)
        ex = rx.index_select(0, take)
        esf = rsf.index_select(0, take) if rsf is not None else None
        ew = None
        if rw is not None:
            flat = torch.zeros(n + 1, dtype=rw.dtype, device=dev)
            flat.scatter_(0, at.reshape(-1), rw.reshape(-1))
            ew = flat[:n]
        if zero:
            pad = (src < 0).unsqueeze(1)
            ex.masked_fill_(pad, 0) if ex.dtype != torch.float8_e4m3fn else \
                ex.view(torch.uint8).masked_fill_(pad, 0)
            if esf is not None:
                esf.masked_fill_(pad, 0)
            if ew is not None:
                ew.masked_fill_(pad.squeeze(1), 0)
        return ex, esf, ew

    # --------------------------------------------------------------- combine

    @_plain_torch
    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0,
                previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False):
        """DeepEP 2's combine. Returns (combined_x, combined_topk_weights,
        event)."""
        self._live("combine")
        if not isinstance(handle, EPHandle) or handle._route is None:
            raise TypeError("handle: expected the EPHandle of an ElasticBuffer.dispatch")
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("combine: previous_event needs allocate_on_comm_stream=True (as "
                             "DeepEP 2's)")
        ep, route = handle._ep, handle._route
        R = handle.num_recv_tokens
        K = handle.topk_idx.shape[1]
        _tensor(x, "x", torch.bfloat16, (None, ep.hidden))
        if handle.do_expand:
            if x.shape[0] < handle.num_expanded_tokens:
                raise ValueError(f"x: {x.shape[0]} rows, the handle's expanded dispatch made "
                                 f"{handle.num_expanded_tokens}")
            if topk_weights is not None:
                if not self.allow_multiple_reduction:
                    raise ValueError("combine: an expanded combine takes no topk_weights "
                                     "without allow_multiple_reduction (as DeepEP 2's)")
                _tensor(topk_weights, "topk_weights", torch.float32,
                        (handle.num_expanded_tokens,))
        else:
            if x.shape[0] != R:
                raise ValueError(f"x: {x.shape[0]} rows, the handle's dispatch received {R}")
            if topk_weights is not None:
                _tensor(topk_weights, "topk_weights", torch.float32, (R, K))
        call = self._buf._call(ep, x, previous_event, async_with_compute_stream,
                               allocate_on_comm_stream)
        one = handle.do_expand and not self.allow_multiple_reduction
        if one:
            bl = self._biases(bias, handle.topk_idx.shape[0], ep.hidden, x.device)
        with call:
            if one:
                cx, cw = self._combine_per_slot(handle, x, bl, ep, route, call), None
                made = (cx,)
            else:
                y, w = x, topk_weights
                if handle.do_expand:
                    y, w = self._reduce_expanded(handle, x, topk_weights)
                cx, cw = _ht_combine(ep, route, y.contiguous(), w, call, False, bias, "slots")
                call.settle()
                made = (cx, cw, y, w)
            ev = call.finish(made, (x, topk_weights))
        return cx, cw, EventOverlap(ev.event if ev is not None else None)

    @staticmethod
    def _biases(bias, T, H, dev):
        """The combine's bias as a tuple of its [T, H] bf16 tensors (none, one
        or two), checked as the combine checks them."""
        bl = () if bias is None else tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
        if len(bl) > 2:
            raise ValueError(f"bias: {len(bl)} tensors, at most 2")
        for i, b in enumerate(bl):
            _tensor(b, f"bias[{i}]", torch.bfloat16, (T, H))
            if b.device != dev:
                raise ValueError(f"bias[{i}]: on {b.device}, x on {dev}")
        return bl

    @staticmethod
    def _combine_per_slot(h, x, bl, ep, route, call):
        """An expanded combine without allow_multiple_reduction (DeepEP 2's
        single reduction): every slot's row comes back alone and the source
        sums the biases (bl) and then its slots in slot order in fp32,
        rounding once. One combine per slot: in slot j's, a received row
        carries its slot-j expert's row, or zeros where slot j's expert is
        elsewhere (or masked), so each token's result is its one slot-j row,
        exact."""
        pos = h._exp_pos
        R, K = pos.shape
        n = x.shape[0]
        at = torch.where(pos >= 0, pos.long(), torch.full_like(pos, n, dtype=torch.int64))
        xe = torch.cat((x, torch.zeros((1, x.shape[1]), dtype=x.dtype, device=x.device)))
        acc = torch.zeros((route.num_tokens, x.shape[1]), dtype=torch.float32, device=x.device)
        for b in bl:
            acc += b.float()
        for j in range(K):
            cj, _ = _ht_combine(ep, route, xe.index_select(0, at[:, j]), None, call, False,
                                None, "slots")
            call.settle()
            acc += cj.float()
        return acc.to(torch.bfloat16)

    @staticmethod
    def _reduce_expanded(h, x, w):
        """An expanded combine's rows reduced per received row: each row's
        slots here summed in slot order in fp32, rounded once to bf16 (DeepEP
        2's reduction on the expert's rank), and their weights per slot."""
        pos = h._exp_pos
        R, K = pos.shape
        n = x.shape[0]
        at = torch.where(pos >= 0, pos.long(), torch.full_like(pos, n, dtype=torch.int64))
        zero = torch.zeros((1, x.shape[1]), dtype=x.dtype, device=x.device)
        xe = torch.cat((x, zero))
        acc = torch.zeros((R, x.shape[1]), dtype=torch.float32, device=x.device)
        for j in range(K):
            acc += xe.index_select(0, at[:, j]).float()
        wt = None
        if w is not None:
            we = torch.cat((w, torch.zeros(1, dtype=w.dtype, device=w.device)))
            wt = we[at]
        return acc.to(torch.bfloat16), wt


for _n in _EXPERIMENTAL:
    setattr(ElasticBuffer, _n, _refused(_n))
for _n in _EXPERIMENTAL_STATIC:
    setattr(ElasticBuffer, _n, staticmethod(_refused(_n)))
