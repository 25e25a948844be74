#!/usr/bin/env python3
"""The module `deep_ep` (python/compat on ferry.deep_ep) called the way
vLLM's and SGLang's DeepEP backends call it, on CPU ranks (torch CPU
tensors, gloo), each round checked against a reference:

  - vLLM (model_executor/layers/fused_moe/prepare_finalize/deepep_ll.py,
    deepep_ht.py; device_communicators/all2all.py): annotations evaluated
    at import (deep_ep.Buffer, deep_ep.EventOverlap, deep_ep.Config | None),
    ElasticBuffer beside the V1 Buffer (vLLM's has_deep_ep_v2 probe; its
    V1 backends keep using Buffer), the
    Buffer made from a keyword dict and kept in a WeakValueDictionary,
    get_low_latency_rdma_size_hint by keyword, the low-latency dispatch
    with its hook and the combine into `out`, the normal mode's layout,
    dispatch and combine with every keyword vLLM passes, set_num_sms and
    the dispatch/combine configs for the group sizes vLLM asks for;
  - SGLang (srt/layers/moe/token_dispatcher/deepep.py): `from deep_ep
    import Buffer, Config`, its buffer sizing (Config's size hints, the
    low-latency size hint by position, Config(**json)), Buffer.num_sms,
    one Buffer with low_latency_mode=True for both modes (--deepep-mode
    auto: normal-mode prefill, then clean_low_latency_buffer, then
    low-latency decode), its attribute reads, Buffer.capture as
    previous_event source, the keyword names of its calls, its NVFP4
    dispatch (sgl-deep-ep's use_nvfp4 and x_global_scale, the codes'
    shape as its masked GEMM unpacks them, dequantised rows);
  - the fp8 scales they pass to normal-mode dispatch (one per token;
    UE8M0 packed int32, column-major; float32 column-major), moved bit for
    bit and returned row-major in their dtype, as DeepEP does.
The calls are written as those engines write them (argument names,
positions, tuple unpacking); the engines' code is not used.
Usage: test_engine_calls.py [--cuda] [nranks ...] (--cuda: CUDA tensors on
the current GPU, several ranks sharing it). Exit 77 (skipped) without torch.
"""
import os
import sys
import traceback
import weakref

try:
    import torch
except ImportError:
    print("skipped: torch is not installed (scripts/setup.sh installs it)")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "compat"))  # the module deep_ep
from ranks import gather_all, ranks_main, torch_init  # noqa: E402
from test_torch_cuda import (check_round, combine_error, combine_ref,  # noqa: E402
                             expert_fn, expert_outputs, make_inputs)

CUDA = "--cuda" in sys.argv[1:]


def ht_check(msgs, what, rank, N, E, x, idx, w, rx, ridx, rw, counts, align):
    """Normal-mode dispatch results: rows by source rank then token, local
    expert ids (-1 elsewhere), weights (0 elsewhere), counts per local
    expert rounded up to align, as a list of ints."""
    El = E // N
    xs, ids, ws = gather_all(N, x, idx, w)
    rx, ridx, rw = rx.cpu(), ridx.cpu(), rw.cpu()
    rows = [(s, t) for s in range(N) for t in range(ids[s].shape[0])
            if ((ids[s][t] >= rank * El) & (ids[s][t] < rank * El + El)).any()]
    if rx.shape[0] != len(rows):
        msgs.append(f"{what}: {rx.shape[0]} rows, want {len(rows)}")
        return
    bad = 0
    for j, (s, t) in enumerate(rows):
        loc = [int(e) - rank * El if rank * El <= int(e) < rank * El + El else -1
               for e in ids[s][t]]
        wl = [float(ws[s][t][k]) if loc[k] >= 0 else 0.0 for k in range(len(loc))]
        bad += not torch.equal(rx[j], xs[s][t]) or ridx[j].tolist() != loc or rw[j].tolist() != wl
    want = [-(-sum(1 for s, t in rows if (ids[s][t] == rank * El + le).any()) // align) * align
            for le in range(El)]
    if bad or counts != want or not all(type(c) is int for c in counts) or \
            ridx.dtype != torch.int64:
        msgs.append(f"{what}: {bad} wrong rows, counts {counts} want {want}, ids {ridx.dtype}")


def ht_experts(rank, N, E, rx, ridx, rw):
    """The experts' weighted outputs per received row (bf16)."""
    El = E // N
    y = torch.zeros(rx.shape, dtype=torch.float32, device=rx.device)
    for j in range(rx.shape[0]):
        for k in range(ridx.shape[1]):
            if int(ridx[j, k]) >= 0:
                y[j] += float(rw[j, k]) * expert_fn(rank * El + int(ridx[j, k]),
                                                    rx[j:j + 1].float()).float()[0]
    return y.to(torch.bfloat16)


def stateless_group(rank, N):
    """The EP group vLLM's elastic EP passes (stateless_coordinator.py:
    stateless_init_torch_distributed_process_group, backend gloo): a
    ProcessGroup made outside torch.distributed's registry, so that
    dist.get_rank(group) and dist.get_backend(group) fail on it. Built as
    vLLM's init_gloo_process_group builds it, on a PrefixStore of the
    default group's store."""
    from datetime import timedelta
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import PrefixStore, ProcessGroup
    store = PrefixStore("stateless-ep", c10d._get_default_store())
    pg = ProcessGroup(store, rank, N)
    backend = c10d.ProcessGroupGloo(store, rank, N, timeout=timedelta(seconds=60))
    pg._set_default_backend(ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    try:
        torch.distributed.get_rank(pg)
        raise RuntimeError("the stateless group is in torch's registry: the test would not "
                           "test what it should")
    except ValueError:
        pass
    return pg


def vllm_calls(deep_ep, rank, N, group=None):
    msgs, dev = [], torch.device("cuda" if CUDA else "cpu")
    group = torch.distributed.group.WORLD if group is None else group

    # at import, vLLM evaluates these annotations; its has_deep_ep_v2 probe
    # looks for ElasticBuffer (the deepep_v2 backend), while its V1 backends
    # (deepep_high_throughput, deepep_low_latency) take Buffer, which must
    # stay DeepEP's V1 class beside it
    def _annotated(buffer: deep_ep.Buffer, event: deep_ep.EventOverlap) -> deep_ep.Config | None:
        return None
    if not hasattr(deep_ep, "ElasticBuffer"):
        msgs.append("deep_ep.ElasticBuffer missing: vLLM's deepep_v2 backend would not see it")
    elif deep_ep.Buffer is deep_ep.ElasticBuffer or issubclass(deep_ep.Buffer, deep_ep.ElasticBuffer):
        msgs.append("deep_ep.Buffer is the V2 class: vLLM's V1 backends need DeepEP's V1 Buffer")

    # low latency (all2all.py, deepep_ll.py); vLLM's hidden sizes start at 2048
    E, K, H, T = 4 * N, 4, 2048, 8
    El = E // N
    handle_cache = weakref.WeakValueDictionary()
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=T, hidden=H, num_ranks=N, num_experts=E)
    buffer_kwargs = dict(group=group, num_nvl_bytes=1024 * 1024, num_rdma_bytes=num_rdma_bytes,
                         low_latency_mode=True, num_qps_per_rank=El,
                         allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                         explicitly_destroy=True, enable_shrink=False)
    buf = handle_cache.setdefault(("ll", T, H), deep_ep.Buffer(**buffer_kwargs))
    for rnd, use_fp8 in ((1, True), (2, False), (3, True)):
        a1, topk_ids, topk_weights = make_inputs(rank, 300 + rnd, T, H, E, K, dev)
        xs, ids = gather_all(N, a1, topk_ids)
        expert_x, expert_num_tokens, handle, _, hook = buf.low_latency_dispatch(
            a1, topk_ids, T, E, use_fp8=use_fp8, round_scale=False, use_ue8m0=False,
            async_finish=False, return_recv_hook=True)
        hook()
        if use_fp8 != isinstance(expert_x, tuple) or not isinstance(expert_num_tokens,
                                                                   torch.Tensor):
            msgs.append(f"ll dispatch fp8={use_fp8}: {type(expert_x).__name__} results")
            continue
        q = expert_x[0] if use_fp8 else expert_x
        if q.dim() != 3 or not q.is_contiguous() or tuple(q.shape) != (El, N * T, H):
            msgs.append(f"ll dispatch fp8={use_fp8}: expert_x {tuple(q.shape)}, want 3-D "
                        f"contiguous {(El, N * T, H)}")
        err = check_round(rank, N, E, K, xs, ids, expert_x, expert_num_tokens,
                          (handle.src_rank, handle[0]), use_fp8)
        if err:
            msgs.append(f"ll dispatch fp8={use_fp8}: {err}")
        fused_expert_output = expert_outputs(rank, El, expert_x, expert_num_tokens, use_fp8, dev)
        output = torch.empty((a1.shape[0], H), dtype=torch.bfloat16, device=dev)
        do_recv_hook = rnd != 2
        _, _, recv_hook = buf.low_latency_combine(
            fused_expert_output, topk_ids, topk_weights, handle, async_finish=False,
            zero_copy=False, return_recv_hook=do_recv_hook, out=output)
        if do_recv_hook:
            recv_hook()
        elif recv_hook is not None:
            msgs.append("ll combine without return_recv_hook returned a hook")
        err = combine_error(output, combine_ref(a1, topk_ids, topk_weights, use_fp8))
        if err:
            msgs.append(f"ll combine into out fp8={use_fp8}: {err}")
    buf.destroy()

    # high throughput (deepep_ht.py)
    E, K, H, T = 4 * N, 3, 512, 12
    buf = deep_ep.Buffer(**dict(group=group, num_nvl_bytes=1024 * 1024, num_rdma_bytes=0,
                                low_latency_mode=False, num_qps_per_rank=1,
                                explicitly_destroy=True))
    sms = deep_ep.Buffer.num_sms
    deep_ep.Buffer.set_num_sms(20)
    ok_sizes = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]
    dcfg = deep_ep.Buffer.get_dispatch_config(N) if N in ok_sizes else None
    ccfg = deep_ep.Buffer.get_combine_config(N) if N in ok_sizes else None
    if not callable(buf.capture):
        msgs.append("Buffer.capture is not callable (vLLM's previous-event source)")
    if dcfg is not None and dcfg.num_sms != 20:
        msgs.append(f"get_dispatch_config after set_num_sms(20): num_sms {dcfg.num_sms}")
    previous_event = None
    import warnings
    caught = []
    for rnd in (1, 2):
        if rnd == 2 and dcfg is not None:
            # dual-batch overlap (ubatch_utils.py): fewer SMs for the
            # communication from now on; the context keeps its own, with
            # one warning
            deep_ep.Buffer.set_num_sms(8)
            dcfg, ccfg = (deep_ep.Buffer.get_dispatch_config(N),
                          deep_ep.Buffer.get_combine_config(N))
        token_data, rank_topk_ids, rank_topk_weights = make_inputs(rank, 320 + rnd, T, H, E, K,
                                                                   dev)
        (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens,
         is_token_in_rank, event) = buf.get_dispatch_layout(
            topk_idx=rank_topk_ids, num_experts=E, previous_event=previous_event,
            async_finish=False, allocate_on_comm_stream=False)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            (x, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle,
             event) = buf.dispatch(
                x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
                num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                is_token_in_rank=is_token_in_rank,
                num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=rank_topk_ids,
                topk_weights=rank_topk_weights, expert_alignment=1, config=dcfg,
                previous_event=previous_event, async_finish=True, allocate_on_comm_stream=False)
        caught += [str(m.message) for m in w if issubclass(m.category, RuntimeWarning)]
        if event.event is not None:
            event.current_stream_wait()
        ht_check(msgs, f"vLLM normal dispatch {rnd}", rank, N, E, token_data, rank_topk_ids,
                 rank_topk_weights, x, expert_topk_ids, expert_topk_weights,
                 expert_num_tokens_per_expert_list, 1)
        fused_expert_output = ht_experts(rank, N, E, x, expert_topk_ids, expert_topk_weights)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            combined_x, _, event = buf.combine(
                x=fused_expert_output, handle=handle, topk_weights=None, config=ccfg,
                previous_event=previous_event, async_finish=True, allocate_on_comm_stream=False)
        caught += [str(m.message) for m in w if issubclass(m.category, RuntimeWarning)]
        if event.event is not None:
            event.current_stream_wait()
        err = combine_error(combined_x, combine_ref(token_data, rank_topk_ids,
                                                    rank_topk_weights, False))
        if err:
            msgs.append(f"vLLM normal combine {rnd}: {err}")
    want = 1 if dcfg is not None else 0
    if len(caught) != want or (want and "config.num_sms = 8" not in caught[0]):
        msgs.append(f"set_num_sms(8) after the context was made with 20: warnings {caught}, "
                    f"want {want} naming config.num_sms = 8")
    ht = [ep for k, ep in buf._eps.items() if k[0] == "ht"]
    if dcfg is not None and [ep.num_sms for ep in ht] != [20]:
        msgs.append(f"normal-mode context SMs {[ep.num_sms for ep in ht]}, want [20] "
                    f"(get_dispatch_config after set_num_sms(20))")
    deep_ep.Buffer.num_sms = sms
    buf.destroy()
    return msgs


def sglang_calls(rank, N):
    msgs, dev, group = [], torch.device("cuda" if CUDA else "cpu"), torch.distributed.group.WORLD
    from deep_ep import Buffer, Config

    # DeepEPBuffer.get_deepep_buffer, auto mode: one buffer for both modes
    E, K, H, T = 4 * N, 4, 512, 16
    hidden_bytes = H * 2
    normal_dispatch_config = Config(**{"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6,
                                       "num_max_nvl_chunked_recv_tokens": 256,
                                       "num_max_rdma_chunked_send_tokens": 6,
                                       "num_max_rdma_chunked_recv_tokens": 128})
    normal_combine_config = Buffer.get_combine_config(group.size())
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (normal_dispatch_config, normal_combine_config):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()),
                            num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()),
                             num_rdma_bytes)
    num_rdma_bytes = max(Buffer.get_low_latency_rdma_size_hint(T, H, group.size(), E),
                         num_rdma_bytes)
    if not (isinstance(num_nvl_bytes, int) and num_nvl_bytes > 0 and num_rdma_bytes > 0):
        msgs.append(f"buffer sizes from the hints: {num_nvl_bytes}, {num_rdma_bytes}")
    num_qps_per_rank = max(normal_dispatch_config.num_sms, E // group.size())
    # without --deepep-config: DeepEPConfig.num_sms is Buffer.num_sms, then
    # max(num_sms, E // N) for the QPs (auto mode) and a comparison with
    # half the GPU's SMs (its warning): an int, DeepEP's 20, until set
    num_sms = Buffer.num_sms
    try:
        _ = (max(num_sms, E // group.size()), num_sms < 132 // 2, num_sms // 2)
        if num_sms != 20:
            msgs.append(f"Buffer.num_sms unset: {num_sms!r}, want DeepEP's default 20")
    except TypeError as e:
        msgs.append(f"Buffer.num_sms unset ({num_sms!r}): SGLang's arithmetic fails: {e}")
    buffer_kwargs = dict(low_latency_mode=True, num_qps_per_rank=num_qps_per_rank,
                         allow_mnnvl=True)
    buffer_kwargs["use_fabric"] = True  # SGLang on CUDA 13 with multi-node NVLink
    buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, **buffer_kwargs)
    if not buffer.use_fabric:
        msgs.append("use_fabric=True: not kept as buffer.use_fabric")
    if not buffer.low_latency_mode or buffer.group_size != N:
        msgs.append(f"attributes: low_latency_mode {buffer.low_latency_mode}, "
                    f"group_size {buffer.group_size}")
    # unset, ferry's kernels keep ferry's default; set, the normal mode's
    # take it and the low-latency ones do not (as DeepEP's: SGLang's auto
    # mode with a --deepep-config of 8 SMs must not slow its decode), which
    # ferry_ll_sms sets
    want = (buffer._sms, buffer._sms)
    got = (buffer._kernel_sms("ht"), buffer._kernel_sms("ll"))
    class Six:  # an integer that is not an int (numpy's, say)
        def __index__(self):
            return 6
    Buffer.set_num_sms(Six())
    got += (buffer._kernel_sms("ht"), buffer._kernel_sms("ll"))
    for bad in (True, 6.0, 0):
        try:
            Buffer.set_num_sms(bad)
            msgs.append(f"set_num_sms({bad!r}): accepted")
        except ValueError as e:
            if not str(e).startswith("new_num_sms:"):
                msgs.append(f"set_num_sms({bad!r}): message does not name it: {e}")
    buffer.ferry_ll_sms = 5
    got += (buffer._kernel_sms("ll"),)
    del buffer.ferry_ll_sms
    Buffer.num_sms = num_sms  # as read above: unset again
    got += (buffer._kernel_sms("ht"),)
    want += (6, buffer._sms, 5, buffer._sms)
    if got != want:
        msgs.append(f"SMs of new contexts (ht, ll; set_num_sms(6): ht, ll; ferry_ll_sms 5; "
                    f"unset again: ht): {got}, want {want}")

    # normal mode (prefill) on it
    for rnd, align in ((1, 1), (2, 128)):
        hidden_states, topk_ids, topk_weights = make_inputs(rank, 340 + rnd, T, H, E, K, dev)
        previous_event = None
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
         is_token_in_rank, previous_event) = buffer.get_dispatch_layout(
            topk_ids, E, previous_event=previous_event, async_finish=False,
            allocate_on_comm_stream=previous_event is not None)
        (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle,
         event) = buffer.dispatch(
            hidden_states, topk_idx=topk_ids, topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            previous_event=previous_event, async_finish=False,
            allocate_on_comm_stream=False, expert_alignment=align,
            config=normal_dispatch_config)
        if isinstance(recv_x, tuple):
            msgs.append("SGLang normal dispatch: bf16 x came back as a tuple")
            continue
        ht_check(msgs, f"SGLang normal dispatch align={align}", rank, N, E, hidden_states,
                 topk_ids, topk_weights, recv_x, recv_topk_ids, recv_topk_weights,
                 num_recv_tokens_per_expert, align)
        y = ht_experts(rank, N, E, recv_x, recv_topk_ids, recv_topk_weights)
        combined_x, _, event = buffer.combine(y, handle, async_finish=False,
                                              previous_event=event,
                                              allocate_on_comm_stream=False,
                                              config=normal_combine_config)
        event.current_stream_wait()
        err = combine_error(combined_x, combine_ref(hidden_states, topk_ids, topk_weights, False))
        if err:
            msgs.append(f"SGLang normal combine align={align}: {err}")
    # --deepep-config's num_sms reaches the kernels through config=, as in
    # DeepEP (SGLang never calls set_num_sms)
    got = sorted(ep.num_sms for k, ep in buffer._eps.items() if k[0] == "ht")
    if got != [24]:
        msgs.append(f"normal-mode contexts made with {got} SMs, want [24] "
                    f"(normal_dispatch_config.num_sms)")

    # then decode: clean, and the low-latency calls on the same buffer
    buffer.clean_low_latency_buffer(T, H, E)
    El = E // N
    for rnd, return_recv_hook in ((1, True), (2, False)):
        hidden_states, topk_ids, topk_weights = make_inputs(rank, 360 + rnd, T, H, E, K, dev)
        xs, ids = gather_all(N, hidden_states, topk_ids)
        packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
            hidden_states, topk_ids, T, E, use_fp8=True, async_finish=not return_recv_hook,
            return_recv_hook=return_recv_hook, round_scale=False, use_ue8m0=False)
        hook() if return_recv_hook else event.current_stream_wait()
        num_local_experts, num_tokens_static, hidden_dim = packed_recv_hidden[0].shape
        if (num_local_experts, num_tokens_static, hidden_dim) != (El, N * T, H):
            msgs.append(f"SGLang ll dispatch: {packed_recv_hidden[0].shape}")
        err = check_round(rank, N, E, K, xs, ids, packed_recv_hidden, packed_recv_count,
                          (handle.src_rank, handle[0]), True)
        if err:
            msgs.append(f"SGLang ll dispatch hook={return_recv_hook}: {err}")
        hs = expert_outputs(rank, El, packed_recv_hidden, packed_recv_count, True, dev)
        combined, event, hook = buffer.low_latency_combine(
            x=hs, topk_idx=topk_ids, topk_weights=topk_weights, handle=handle,
            async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
        hook() if return_recv_hook else event.current_stream_wait()
        err = combine_error(combined, combine_ref(hidden_states, topk_ids, topk_weights, True))
        if err:
            msgs.append(f"SGLang ll combine hook={return_recv_hook}: {err}")
    # NVFP4 models: sgl-deep-ep's keywords, the encode scale a 0-dim float32
    # the same on every rank (the input global scale of SGLang's quant config)
    from test_nvfp4 import calc_diff, dequantize, unswizzle
    hidden_states, topk_ids, topk_weights = make_inputs(rank, 370, T, H, E, K, dev)
    amax = torch.tensor([float(hidden_states.float().abs().max()) if hidden_states.numel()
                         else 1e-4])  # a rank may have no tokens
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    gs = (448.0 * 6.0 / amax[0]).to(torch.float32).reshape(()).to(dev)
    ref_x, ref_cnt, _, _, _ = buffer.low_latency_dispatch(hidden_states, topk_ids, T, E,
                                                          use_fp8=False)
    packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
        hidden_states, topk_ids, T, E, use_fp8=False, use_nvfp4=True, x_global_scale=gs,
        async_finish=True, return_recv_hook=False)
    event.current_stream_wait()
    a_q, a_sf = packed_recv_hidden
    m, k_by_2, num_experts = a_q.shape  # as SGLang's masked NVFP4 GEMM unpacks it
    if (m, k_by_2, num_experts) != (N * T, H // 2, El) or a_sf.dtype != torch.float8_e4m3fn:
        msgs.append(f"SGLang nvfp4 dispatch: {tuple(a_q.shape)}, scales {a_sf.dtype}")
    elif not torch.equal(packed_recv_count.cpu(), ref_cnt.cpu()):
        msgs.append("SGLang nvfp4 dispatch: counts differ from the bf16 dispatch's")
    else:
        codes, srows = a_q.permute(2, 0, 1).cpu(), unswizzle(a_sf.cpu(), El, N * T)
        for le in range(El):
            n = int(packed_recv_count[le])
            if n and not calc_diff(dequantize(codes[le, :n], srows[le, :n, :H // 16],
                                              gs.cpu()), ref_x[le, :n].float().cpu()) < 0.1:
                msgs.append(f"SGLang nvfp4 dispatch: expert {le} dequantised rows differ")
    buffer.destroy()
    return msgs


def normal_scales(deep_ep, rank, N):
    """The fp8 scales engines pass to normal-mode dispatch, each moved bit
    for bit to the rows that received their token and returned row-major in
    the caller's dtype (as DeepEP does): one per token (vLLM's per-token
    quantisation), UE8M0 exponents packed four to an int32 and laid out
    column-major with the token count padded (SGLang with DeepGEMM on
    Blackwell), float32 per 128 channels column-major (Hopper); and int8
    rows with float32 scales per 128 channels (vLLM's block-quantized int8
    models), returned as int8."""
    msgs, dev = [], torch.device("cuda" if CUDA else "cpu")
    E, K, H, T = 4 * N, 3, 1024, 12
    El = E // N
    buf = deep_ep.Buffer(torch.distributed.group.WORLD, low_latency_mode=False)
    g = torch.Generator().manual_seed(77 + rank)
    f8 = torch.float8_e4m3fn
    for kind, ns, dt, cols, xdt in (
            ("per token", 1, torch.float32, False, f8),
            ("UE8M0 packed, column-major", H // 512, torch.int32, True, f8),
            ("per 128 channels, column-major", H // 128, torch.float32, True, f8),
            ("int8 rows, per 128 channels", H // 128, torch.float32, False, torch.int8)):
        x, idx, w = make_inputs(rank, 400 + ns, T, H, E, K, dev)
        t = x.shape[0]
        x8 = torch.randint(0, 256, (t, H), generator=g, dtype=torch.uint8).to(dev)
        bits = torch.randint(-2**31, 2**31 - 1, (t, ns), generator=g, dtype=torch.int32)
        if cols:  # column-major, the token count padded to 4 (TMA alignment)
            base = torch.zeros((ns, -(-t // 4) * 4), dtype=torch.int32)
            base[:, :t] = bits.T
            sc = base.to(dev).T[:t]
        else:
            sc = bits.to(dev)
        sc = sc if dt == torch.int32 else sc.view(torch.float32)
        nr, nrdma, ne, inr, _ = buf.get_dispatch_layout(idx, E)
        (rx, rsc), ridx, rw, counts, handle, _ = buf.dispatch(
            (x8.view(xdt), sc), topk_idx=idx, topk_weights=w,
            num_tokens_per_rank=nr, num_tokens_per_rdma_rank=nrdma, is_token_in_rank=inr,
            num_tokens_per_expert=ne)
        xs8, bs, ids = gather_all(N, x8, bits, idx)
        rows = [(s, tt) for s in range(N) for tt in range(ids[s].shape[0])
                if ((ids[s][tt] >= rank * El) & (ids[s][tt] < rank * El + El)).any()]
        if rx.dtype != xdt:
            msgs.append(f"rows {kind}: came back as {rx.dtype}, want {xdt}")
        got = rsc.cpu()
        if rsc.dtype != dt or tuple(rsc.shape) != (len(rows), ns) or not rsc.is_contiguous():
            msgs.append(f"scales {kind}: got {rsc.dtype} {tuple(rsc.shape)} strides "
                        f"{rsc.stride()}, want {dt} ({len(rows)}, {ns}) row-major")
            continue
        gb = got if dt == torch.int32 else got.view(torch.int32)
        rxc = rx.view(torch.uint8).cpu()
        bad = sum(not torch.equal(gb[j], bs[s][tt]) or not torch.equal(rxc[j], xs8[s][tt])
                  for j, (s, tt) in enumerate(rows))
        if bad:
            msgs.append(f"scales {kind}: {bad} of {len(rows)} rows with wrong bits")
        buf.combine(torch.zeros((len(rows), H), dtype=torch.bfloat16, device=dev), handle)
    x, idx, w = make_inputs(rank, 410, T, H, E, K, dev)
    nr, _, ne, inr, _ = buf.get_dispatch_layout(idx, E)
    x8 = torch.zeros((x.shape[0], H), dtype=torch.float8_e4m3fn, device=dev)
    for sc, exc, what in ((torch.zeros((x.shape[0], H // 64), device=dev), ValueError, "scales"),
                          (torch.zeros((x.shape[0], 2), dtype=torch.float64, device=dev),
                           TypeError, "float32 or int32")):
        try:
            buf.dispatch((x8, sc), topk_idx=idx, num_tokens_per_rank=nr, is_token_in_rank=inr,
                         num_tokens_per_expert=ne)
            msgs.append(f"scales {tuple(sc.shape)} {sc.dtype}: taken")
        except exc as e:
            if "x[1] (scales)" not in str(e) or what not in str(e):
                msgs.append(f"scales {tuple(sc.shape)} {sc.dtype}: {e!r}")
    buf.destroy()
    return msgs


def masks_beside_normal(deep_ep, rank, N):
    """The mask calls on a Buffer that also ran normal mode (SGLang's auto
    mode, vLLM's fault tolerance with enable_shrink): they concern the
    low-latency contexts only, and must not fail on the normal-mode one
    (whose engine masks no ranks)."""
    msgs, dev = [], torch.device("cuda" if CUDA else "cpu")
    E, K, H, T = 4 * N, 3, 512, 8
    buf = deep_ep.Buffer(torch.distributed.group.WORLD, low_latency_mode=True,
                         enable_shrink=True)
    x, idx, w = make_inputs(rank, 420, T, H, E, K, dev)
    nr, nrdma, ne, inr, _ = buf.get_dispatch_layout(idx, E)
    rx, ridx, rw, counts, handle, _ = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=nr, num_tokens_per_rdma_rank=nrdma,
        is_token_in_rank=inr, num_tokens_per_expert=ne)
    buf.combine(ht_experts(rank, N, E, rx, ridx, rw), handle)
    st = torch.full((N,), 7, dtype=torch.int32, device=dev)
    try:
        buf.low_latency_query_mask_buffer(st)
        if st.tolist() != [0] * N:
            msgs.append(f"query: {st.tolist()}, want zeros")
        if N > 1:  # masked and unmasked before any low-latency round: allowed
            peer = (rank + 1) % N
            buf.low_latency_update_mask_buffer(peer, True)
            buf.low_latency_query_mask_buffer(st)
            if st.tolist() != [int(r == peer) for r in range(N)]:
                msgs.append(f"query after masking rank {peer}: {st.tolist()}")
            buf.low_latency_update_mask_buffer(peer, False)
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(st)
        if st.tolist() != [0] * N:
            msgs.append(f"query after clean: {st.tolist()}, want zeros")
    except Exception as e:
        msgs.append(f"mask calls after a normal-mode round: {e!r}")
    buf.destroy()
    return msgs


def error_recovery(deep_ep, rank, N):
    """A call that raises leaves the Buffer usable: a low-latency combine
    with top-k weights of the wrong shape raises before anything starts;
    dispatches go on with that round's handle still held (its round is
    combined from scratch when its buffer set is needed); the held handle
    combines right later; a float topk_idx is a TypeError in both modes,
    a normal-mode dispatch with weights of the wrong shape a ValueError,
    and the next calls of both modes work."""
    msgs, dev = [], torch.device("cuda" if CUDA else "cpu")
    E, K, H, T = 4 * N, 3, 1024, 8
    El = E // N
    buf = deep_ep.Buffer(torch.distributed.group.WORLD, 0, 0, low_latency_mode=True,
                         num_qps_per_rank=El, explicitly_destroy=True)

    def expect(exc, what, fn, *a, **k):
        try:
            fn(*a, **k)
        except exc:
            return
        except Exception as e:
            msgs.append(f"{what}: {type(e).__name__} ({e}), want {exc.__name__}")
            return
        msgs.append(f"{what}: accepted, want {exc.__name__}")

    def ll_round(rnd):
        x, idx, w = make_inputs(rank, 500 + rnd, T, H, E, K, dev)
        recv, count, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        # the experts' outputs now: recv is reused two rounds later
        y = expert_outputs(rank, El, recv, count, False, dev)
        return x, idx, w, recv, y, handle

    def ll_combine(what, x, idx, w, recv, y, handle):
        out, _, _ = buf.low_latency_combine(y, idx, w, handle)
        err = combine_error(out, combine_ref(x, idx, w, False))
        if err:
            msgs.append(f"{what}: combine {err}")

    a = ll_round(1)
    x, idx, w = a[0], a[1], a[2]
    expect(ValueError, "combine with weights [T, 1]", buf.low_latency_combine,
           a[4], idx, w[:, :1], a[5])
    expect(TypeError, "low_latency_dispatch with a float topk_idx", buf.low_latency_dispatch,
           x, idx.float() + 0.7, T, E, use_fp8=False)
    b = ll_round(2)
    c = ll_round(3)  # takes round 1's buffer set: round 1 is settled
    ll_combine("round 3", *c)
    ll_combine("round 2", *b)
    # round 1's handle, still held: its routing goes again
    ll_combine("round 1 after rounds 2 and 3", *a)
    # a handle combined twice: the second dispatches its routing again
    ll_combine("round 2 combined again", *b)
    # a bad call of each kind, then the round it spoiled, done right
    d = ll_round(4)
    expect(ValueError, "low_latency_combine with x of the wrong shape",
           buf.low_latency_combine, d[4][:, :1], idx, w, d[5])
    expect(TypeError, "low_latency_combine with a handle of another kind",
           buf.low_latency_combine, d[4], idx, w, (1, 2, 3))
    expect(TypeError, "low_latency_dispatch with float32 x", buf.low_latency_dispatch,
           x.float(), idx, T, E, use_fp8=False)
    expect(ValueError, "low_latency_dispatch with topk_idx of other rows",
           buf.low_latency_dispatch, x, idx[:1], T, E, use_fp8=False)
    ll_combine("round 4 after bad calls", *d)
    e = ll_round(5)
    ll_combine("round 5", *e)
    buf.destroy()

    nb = deep_ep.Buffer(torch.distributed.group.WORLD, low_latency_mode=False,
                        explicitly_destroy=True)
    x, idx, w = make_inputs(rank, 600, T, H, E, K, dev)
    idx = idx.to(dev)
    nr, _, ne, inr, _ = nb.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=nr, is_token_in_rank=inr, num_tokens_per_expert=ne)
    expect(TypeError, "dispatch with a float topk_idx", nb.dispatch, x,
           topk_idx=idx.float(), topk_weights=w, **args)
    expect(ValueError, "dispatch with weights [T, 1]", nb.dispatch, x, topk_idx=idx,
           topk_weights=w[:, :1].contiguous(), **args)
    expect(TypeError, "get_dispatch_layout with a float topk_idx", nb.get_dispatch_layout,
           idx.float(), E)
    expect(ValueError, "dispatch with num_worst_tokens out of range", nb.dispatch, x,
           topk_idx=idx, topk_weights=w, num_worst_tokens=2**40, **args)
    rx, ridx, rw, counts, handle, _ = nb.dispatch(x, topk_idx=idx, topk_weights=w, **args)
    expect(ValueError, "combine with x of the wrong rows", nb.combine,
           torch.cat([rx, rx[:1]]) if rx.shape[0] else rx[:0, :1], handle)
    expect(TypeError, "combine with a handle of another kind", nb.combine, rx, (1, 2))
    expect(TypeError, "a cached dispatch with a handle of another kind", nb.dispatch, x,
           handle=(1, 2))
    out, _, _ = nb.combine(rx, handle)
    want = (x.float() * inr.sum(1, keepdim=True).float()).to(torch.bfloat16)
    if not torch.equal(out, want):
        msgs.append("normal mode after the errors: combine differs from x times the "
                    "token's ranks")
    nb.destroy()
    return msgs


def rank_main(rank, N, port, q):
    try:
        torch_init(rank, N, port)
        import deep_ep
        if getattr(deep_ep, "backend", None) != "ferry":
            raise RuntimeError(f"deep_ep from {deep_ep.__file__} is not ferry's")
        msgs = [f"vLLM: {m}" for m in vllm_calls(deep_ep, rank, N)]
        if not CUDA:  # vLLM's elastic EP: the same calls on a stateless gloo group
            msgs += [f"vLLM, stateless EP group: {m}"
                     for m in vllm_calls(deep_ep, rank, N, stateless_group(rank, N))]
        msgs += [f"SGLang: {m}" for m in sglang_calls(rank, N)]
        msgs += [f"normal-mode fp8 scales: {m}" for m in normal_scales(deep_ep, rank, N)]
        msgs += [f"masks beside normal mode: {m}" for m in masks_beside_normal(deep_ep, rank, N)]
        msgs += [f"after an error: {m}" for m in error_recovery(deep_ep, rank, N)]
        torch.distributed.destroy_process_group()
        q.put((rank, msgs))
    except Exception:
        q.put((rank, [traceback.format_exc()]))


def main():
    sizes = [int(a) for a in sys.argv[1:] if a != "--cuda"] or [1, 2, 3]
    return ranks_main(rank_main, sizes, f"deep_ep called as vLLM's and SGLang's DeepEP "
                      f"backends call it ({'CUDA' if CUDA else 'CPU'} tensors)", gpu=CUDA)


if __name__ == "__main__":
    sys.exit(main())
