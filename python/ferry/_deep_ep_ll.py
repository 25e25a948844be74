"""deep_ep.Buffer's low-latency mode: low_latency_dispatch / _combine,
the mask calls, the contexts per shape and their CUDA-graph plans."""
import operator
import weakref

import torch

from ._deep_ep_common import (EP, EventOverlap, FerryError, _LLHandle, _Plan, _as_list, _event_after,
                      _fmt_shape, _ll_recv_tensors, _lib, _no_event, _plain_torch, _recv_or_hook, _tensor)


class _LowLatency:
    """The low-latency mode of deep_ep.Buffer."""

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
        dtype = "nvfp4" if fp8 == "nvfp4" else "fp8" if fp8 else "bf16"
        ep = self._eps.get(key)
        if ep is None:
            # passed to libferry as C ints: checked here to name DeepEP's arguments
            _lib.c_int(num_experts, "num_experts")
            _lib.c_int(T, "num_max_dispatch_tokens_per_rank")
            self._not_capturing("low_latency_dispatch",
                                dict(num_experts=num_experts, topk=topk, hidden=hidden,
                                     num_max_dispatch_tokens_per_rank=T, use_fp8=fp8))
            ep = EP(self.comm, num_experts=num_experts, topk=topk, hidden=hidden,
                    max_tokens=T, dtype=dtype, device=device,
                    num_sms=self._kernel_sms("ll"),
                    fp8_round_scale=round_scale,
                    scales_layout=("ue8m0" if ue8m0 else "cols") if dtype == "fp8" else "rows",
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
                             return_recv_hook=False, use_nvfp4=False, x_global_scale=None):
        if use_nvfp4:
            # sgl-deep-ep's NVFP4 dispatch (its keywords; positions as
            # DeepEP v1.2.1's): recv_x is (codes uint8 [N*T, H/2, E_local],
            # scales float8_e4m3fn [32, 4, N*T/128, 4, H/64, E_local]), views
            # of [E_local, N*T, H/2] and the 128 x 4 swizzle
            if use_fp8:
                raise ValueError("use_nvfp4: True needs use_fp8=False (one dispatch dtype, as "
                                 "sgl-deep-ep asserts)")
            if use_ue8m0 or round_scale:
                raise ValueError("use_nvfp4: its scales are e4m3 from x_global_scale; "
                                 "use_ue8m0 and round_scale are for fp8")
            if x_global_scale is None:
                raise ValueError("x_global_scale: required with use_nvfp4=True (a float32 "
                                 "tensor, element 0 the encode scale, the same on every rank)")
            _tensor(x_global_scale, "x_global_scale", torch.float32)
            use_fp8 = "nvfp4"
        elif x_global_scale is not None:
            raise ValueError("x_global_scale: only with use_nvfp4=True")
        r = self._ll_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                              cumulative_local_expert_recv_stats,
                              dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0,
                              return_recv_hook, x_global_scale)
        if async_finish:
            r = (r[0], r[1], r[2], _event_after(x), r[4])
        return r

    def _ll_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                     cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                     use_fp8, round_scale, use_ue8m0, return_recv_hook, gs=None):
        self._low_latency('low_latency_dispatch')
        wc = self._wait_cost(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats", x)
        if use_ue8m0 and not (use_fp8 and round_scale):
            raise ValueError("use_ue8m0: True needs use_fp8=True and round_scale=True (UE8M0 "
                             "holds power-of-two scales only)")
        if use_ue8m0 and isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] % 512:
            raise ValueError(f"use_ue8m0: hidden must be a multiple of 512 (four scales "
                             f"per int32), got {x.shape[1]}")
        rs = bool(round_scale and use_fp8 is True)
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
                                          bool(use_ue8m0), gs)

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
                              stats=None, ue8m0=False, gs=None):
        """wc: the wait-cost stats tensor (checked) or None; stats: the
        receive-count stats (checked) or None."""
        # the common case, checked in few steps: CUDA bf16 x [T, H], int64 topk_idx [T, K]
        if type(x) is torch.Tensor and type(topk_idx) is torch.Tensor and x.is_cuda and \
                x.dtype is torch.bfloat16 and topk_idx.dtype is torch.int64 and \
                x.dim() == 2 and topk_idx.dim() == 2 and x.shape[0] == topk_idx.shape[0] and \
                type(num_max_dispatch_tokens_per_rank) is int and type(num_experts) is int and \
                x.shape[0] <= num_max_dispatch_tokens_per_rank and \
                topk_idx.get_device() == x.get_device() and use_fp8 != "nvfp4":
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
        recv_x, scales, count, src_rank, src_token = _ll_recv_tensors(ep, use_fp8, x.device)
        topk_idx = topk_idx.contiguous()
        for plan in self._plans.values():  # a round the fast path left in the next set
            if plan.ep is ep and plan.pending[ep.next_set()]:
                self._settle(plan, ep.next_set(), plan.raw_stream())
        self._settle_slow(ep, ep.next_set())
        if gs is not None and gs.device != x.device:
            raise ValueError(f"x_global_scale: expected a tensor on {x.device} (x's device), "
                             f"got one on {gs.device}")
        rnd = ep.dispatch_send(x.contiguous(), topk_idx, num_tokens=T,
                               x_global_scale=gs.reshape(-1)[:1] if gs is not None else None)
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
        if ep.dtype == "nvfp4":
            out_x = (recv_x.permute(1, 2, 0),
                     scales.view(torch.float8_e4m3fn).permute(3, 4, 1, 5, 2, 0))
        else:
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
        ep, T, H = handle.ep, handle.ntok, handle.ep.hidden
        idx = handle.topk_idx
        self._settle_slow(ep, ep.next_set())
        d = idx.device
        gs = torch.ones(1, dtype=torch.float32, device=d) if ep.dtype == "nvfp4" else None
        rnd = ep.dispatch_send(torch.zeros((T, H), dtype=torch.bfloat16, device=d), idx,
                               num_tokens=T, x_global_scale=gs)
        rx, sc, cnt, sr, stok = _ll_recv_tensors(ep, ep.dtype == "fp8", d)
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

    @staticmethod
    def _handle_ep(handle):
        """The context of a low_latency_dispatch handle (None for anything
        else: the callers' checks then name the handle)."""
        plan = getattr(handle, "plan", None)
        return plan.ep if plan is not None else getattr(handle, "ep", None)

    def _overlap(self, ep, overlap, src_signals, src_signal_expect_value, packed_recv_count,
                 comp_signal, block_m, threshold):
        """sgl-deep-ep's overlapped combine arguments as ferry's signals:
        (signals tensor, pointer, value, rows per signal) or None. Blackwell
        form: src_signals [E_local] (one per local expert), raised when it
        reads src_signal_expect_value; Hopper form (DeepEP's single-batch
        overlap): comp_signal [E_local * ceil(N*T / block_m)] (one per
        block of block_m rows of an expert), raised when it reads
        threshold. Without overlap the signals are not read (as
        sgl-deep-ep's kernel without overlap). Checked by EP._signal_args."""
        if not overlap:
            return None
        if src_signals is not None and comp_signal is not None:
            raise TypeError("low_latency_combine: src_signals (Blackwell form) and comp_signal "
                            "(Hopper form) given together: pass one")
        if src_signals is not None:
            sig, value, block = src_signals, src_signal_expect_value, 0
            names = ("src_signals", "src_signal_expect_value", "block_m")
        elif comp_signal is not None:
            block = _lib.c_int(int(block_m), "block_m")
            if block <= 0:
                raise ValueError(f"block_m = {block_m}: the rows per comp_signal entry, > 0")
            sig, value = comp_signal, threshold
            names = ("comp_signal", "threshold", "block_m")
            if packed_recv_count is not None:
                _tensor(packed_recv_count, "packed_recv_count", torch.int32,
                        (ep.num_local_experts,))
        else:
            return None  # overlap without signals: sgl-deep-ep's kernel then waits for none
        return (sig,) + ep._signal_args(sig, value, block, names)

    def _combine_fast(self, x, topk_weights, handle, out, return_recv_hook, wc=None, sig=None,
                      fmt=0, sms=0):
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
        cin.format = fmt
        cin.num_sms = sms
        if sig is not None or cin.signals:
            cin.signals, cin.signal_value, cin.signal_block = sig[1:] if sig is not None else \
                (None, 0, 0)
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

        keep = [x, w, out, wc, sig]  # the stats tensor too: recv writes into it
        return out, _no_event(), recv

    @_plain_torch
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                            zero_copy=False, async_finish=False, return_recv_hook=False,
                            out=None, combine_wait_recv_cost_stats=None, overlap=False,
                            src_signals=None, src_signal_expect_value=0,
                            packed_recv_count=None, comp_signal=None, block_m=64, threshold=0,
                            num_sms=None):
        """DeepEP's low-latency combine, with sgl-deep-ep's overlapped form:
        overlap=True with src_signals (uint32 [E_local], an expert's rows
        go once its entry reads src_signal_expect_value) or with
        comp_signal (int32 [E_local * ceil(N*T / block_m)], a block of
        block_m rows goes once its entry reads threshold). The signals are
        device memory the down GEMM raises while the combine runs beside it
        (call the combine on another stream); ferry never resets them.
        packed_recv_count is checked, not needed (ferry keeps the counts);
        num_sms caps the SMs the combine's kernels take on GPU ranks (the
        GEMM keeps the rest; None: the context's)."""
        sms = EP._num_sms_arg(num_sms, "num_sms")
        sig = None
        if overlap:
            ep = self._handle_ep(handle)
            if ep is None:
                raise TypeError("handle: expected the handle low_latency_dispatch returned, "
                                f"got {type(handle).__name__}")
            sig = self._overlap(ep, overlap, src_signals, src_signal_expect_value,
                                packed_recv_count, comp_signal, block_m, threshold)
            if sig is not None and isinstance(x, torch.Tensor) and not x.is_contiguous():
                raise ValueError("x: the overlapped combine reads x where the GEMM writes it, "
                                 "so x must be contiguous (a copy would be taken before the "
                                 "signals rise)")
            if sig is not None and zero_copy:
                raise ValueError("overlap with zero_copy: pass x (the overlapped combine "
                                 "reads the experts' outputs where the GEMM writes them)")
        r = self._ll_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                             return_recv_hook, out, combine_wait_recv_cost_stats, sig, sms)
        if async_finish:
            r = (r[0], _event_after(x), r[2])
        return r

    def _ll_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                    return_recv_hook, out, combine_wait_recv_cost_stats, sig=None, sms=0):
        self._low_latency('low_latency_combine')
        fmt = 1 if use_logfmt else 0
        if fmt:
            lep = self._handle_ep(handle)
            if lep is not None and lep.hidden % 512:
                raise ValueError(f"use_logfmt: hidden = {lep.hidden}; DeepEP's LogFMT takes a "
                                 f"multiple of 512")
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
                return self._combine_fast(x, topk_weights, handle, out, return_recv_hook, wc, sig,
                                          fmt, sms)
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
                                      out, return_recv_hook, wc, sig, fmt, sms)
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
        fk = dict(format="logfmt") if fmt else {}
        if sms:
            fk["num_sms"] = sms
        if sig is None:
            ep.combine_send(rnd, x.contiguous(), **fk)
        else:
            ep.combine_send(rnd, x.contiguous(), signals=sig[0], signal_value=sig[2],
                            signal_block=sig[3], **fk)
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
