"""ctypes view of include/ferry.h (kept in step with it by tests)."""
import ctypes as C
import operator
import os

FERRY_EP_CONFIG_MAGIC = 0x46455031
VERSION_CODE = 100

DTYPES = {"bf16": 0, "fp8": 1, "nvfp4": 2}
DEVICES = {"cpu": 0, "cuda": 1}
MODES = {"ll": 0, "ht": 1}
#: expert_x_scales layouts (ferry_scales_layout_t)
SCALES = {"rows": 0, "cols": 1, "ue8m0": 2}

STATUS = {
    0: "FERRY_OK", -1: "FERRY_ERR_INVALID", -2: "FERRY_ERR_UNSUPPORTED",
    -3: "FERRY_ERR_NOMEM", -4: "FERRY_ERR_SYSTEM", -5: "FERRY_ERR_FABRIC",
    -6: "FERRY_ERR_TIMEOUT", -7: "FERRY_ERR_PEER", -8: "FERRY_ERR_PROTOCOL",
    -9: "FERRY_ERR_STATE", -10: "FERRY_ERR_BOOTSTRAP", -11: "FERRY_ERR_INTERNAL",
}


class EpConfig(C.Structure):
    _fields_ = [("size", C.c_size_t), ("magic", C.c_uint32), ("version", C.c_uint32),
                ("num_experts", C.c_int), ("topk", C.c_int), ("hidden", C.c_int),
                ("max_tokens", C.c_int), ("dispatch_dtype", C.c_int), ("device", C.c_int),
                ("num_sms", C.c_int), ("mode", C.c_int), ("ring_tokens", C.c_int),
                ("fp8_round_scale", C.c_int), ("scales_layout", C.c_int),
                ("mask_on_timeout", C.c_int), ("forward", C.c_int), ("dp_size", C.c_int)]


class Layout(C.Structure):
    _fields_ = [("size", C.c_size_t), ("num_ranks", C.c_int), ("rank", C.c_int),
                ("num_local_experts", C.c_int), ("expert_capacity", C.c_int),
                ("token_bytes", C.c_size_t), ("num_scales", C.c_int),
                ("expert_x_bytes", C.c_size_t), ("expert_scales_bytes", C.c_size_t),
                ("expert_y_bytes", C.c_size_t), ("shm_bytes", C.c_size_t),
                ("host_bytes", C.c_size_t), ("needs_nonblocking_stream", C.c_int)]


class DispatchIn(C.Structure):
    _fields_ = [("size", C.c_size_t), ("num_tokens", C.c_int), ("x", C.c_void_p),
                ("x_scales", C.c_void_p), ("topk_idx", C.c_void_p), ("stream", C.c_void_p),
                ("num_tokens_dev", C.c_void_p), ("x_global_scale", C.c_void_p)]


class DispatchOut(C.Structure):
    _fields_ = [("size", C.c_size_t), ("expert_x", C.c_void_p), ("expert_x_scales", C.c_void_p),
                ("expert_num_tokens", C.c_void_p), ("expert_src_rank", C.c_void_p),
                ("expert_src_token", C.c_void_p), ("stream", C.c_void_p),
                ("wait_cost", C.c_void_p), ("recv_stats", C.c_void_p)]


class CombineIn(C.Structure):
    _fields_ = [("size", C.c_size_t), ("expert_y", C.c_void_p), ("stream", C.c_void_p),
                ("signals", C.c_void_p), ("signal_value", C.c_uint32),
                ("signal_block", C.c_int32), ("sent_rows", C.c_void_p),
                ("format", C.c_int32), ("reserved", C.c_int32), ("num_sms", C.c_int32)]


class EpStats(C.Structure):
    """ferry_ep_stats_t."""
    _fields_ = [("size", C.c_size_t)] + [
        (n, C.c_uint64) for n in ("writes", "requests", "completions", "arrivals", "eagain",
                                  "post_ns", "provider_ns", "provider_calls", "polls",
                                  "poll_ns", "retry_ns", "doorbells")] + [
        ("doorbell_to_post_p50_us", C.c_double), ("doorbell_to_post_p99_us", C.c_double),
        ("bytes", C.c_uint64), ("batched", C.c_uint64),
        ("seen_to_post_p50_us", C.c_double), ("seen_to_post_p99_us", C.c_double),
        ("doorbells_stamped", C.c_uint64)]


#: ferry_combine_format_t
COMBINE_FORMATS = {"bf16": 0, "logfmt": 1}


class CombineOut(C.Structure):
    _fields_ = [("size", C.c_size_t), ("topk_weights", C.c_void_p), ("out", C.c_void_p),
                ("stream", C.c_void_p), ("wait_cost", C.c_void_p)]


class RouteIn(C.Structure):
    _fields_ = [("size", C.c_size_t), ("num_tokens", C.c_int), ("topk_idx", C.c_void_p),
                ("expert_alignment", C.c_int), ("stream", C.c_void_p),
                ("max_recv", C.c_int), ("num_recv_out", C.c_void_p),
                ("expert_counts_out", C.c_void_p)]


class HtDispatchIn(C.Structure):
    _fields_ = [("size", C.c_size_t), ("x", C.c_void_p), ("x_scales", C.c_void_p),
                ("topk_weights", C.c_void_p), ("stream", C.c_void_p),
                ("x_scales_stride", C.c_int64 * 2)]


class HtDispatchOut(C.Structure):
    _fields_ = [("size", C.c_size_t), ("recv_x", C.c_void_p), ("recv_x_scales", C.c_void_p),
                ("recv_topk_idx", C.c_void_p), ("recv_topk_weights", C.c_void_p),
                ("recv_src_rank", C.c_void_p), ("recv_src_token", C.c_void_p),
                ("recv_topk_idx_i64", C.c_void_p)]


class HtCombineIn(C.Structure):
    _fields_ = [("size", C.c_size_t), ("y", C.c_void_p), ("topk_weights", C.c_void_p),
                ("stream", C.c_void_p), ("weights_sum", C.c_int), ("bias", C.c_void_p * 2),
                ("sum_order", C.c_int)]


class HtCombineOut(C.Structure):
    _fields_ = [("size", C.c_size_t), ("out", C.c_void_p), ("topk_weights", C.c_void_p)]


class LayoutArgs(C.Structure):
    _fields_ = [("size", C.c_size_t), ("device", C.c_int), ("num_tokens", C.c_int),
                ("topk", C.c_int), ("num_experts", C.c_int), ("num_ranks", C.c_int),
                ("topk_idx", C.c_void_p), ("tokens_per_rank", C.c_void_p),
                ("tokens_per_expert", C.c_void_p), ("token_in_rank", C.c_void_p),
                ("stream", C.c_void_p), ("ranks_per_node", C.c_int),
                ("tokens_per_node", C.c_void_p)]


def _int_range(ctype):
    bits = 8 * C.sizeof(ctype)
    if ctype(-1).value == -1:
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return 0, (1 << bits) - 1


#: the C integer types Python ints are passed as: ctypes type -> (the C
#: name in messages, lowest, highest)
INT_TYPES = {t: (n,) + _int_range(t) for t, n in (
    (C.c_int, "int"), (C.c_uint32, "uint32_t"), (C.c_int64, "int64_t"),
    (C.c_uint64, "uint64_t"), (C.c_size_t, "size_t"))}


def c_int(value, name, ctype=C.c_int):
    """value as a Python int for a C parameter or field of type ctype (ctypes
    would wrap one out of range silently): any integer (numpy's too, via
    __index__); else TypeError, and ValueError when outside the C type's
    range, both naming the argument."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None
    cname, lo, hi = INT_TYPES[ctype]
    if not lo <= v <= hi:
        raise ValueError(f"{name}: {v} is out of range: it is passed to libferry as a C "
                         f"{cname} ({lo}..{hi})")
    return v


ALLGATHER_FN = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_void_p, C.c_size_t, C.c_void_p)


def _find_library():
    env = os.environ.get("FERRY_LIB")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (os.path.join(here, "libferry.so"),
                 os.path.join(here, "..", "..", "build", "libferry.so")):
        if os.path.exists(cand):
            return cand
    raise OSError("libferry.so not found: install the package with "
                  "`pip install ./python` or set FERRY_LIB")


def load():
    # libinfinipath, which libfabric's psm provider links, installs at load
    # a SIGSEGV/SIGABRT/... handler that calls backtrace() (which
    # allocates): a process that crashes inside malloc then deadlocks
    # instead of dying. These variables turn it off, read at load time
    # only; a value already set is kept.
    os.environ.setdefault("IPATH_NO_BACKTRACE", "1")
    os.environ.setdefault("HFI_NO_BACKTRACE", "1")
    path = _find_library()
    try:
        lib = C.CDLL(path)
    except OSError as e:
        if "libfabric" in str(e):
            raise OSError(f"{path} needs libfabric (libfabric.so.1), which is not installed or "
                          f"not on the library path: install it (Debian/Ubuntu: apt install "
                          f"libfabric1; RHEL/Fedora: dnf install libfabric; AWS: the EFA "
                          f"installer's), or point LD_LIBRARY_PATH at one ({e})") from None
        raise
    vp, cp, sz, i = C.c_void_p, C.c_char_p, C.c_size_t, C.c_int
    u64 = C.c_uint64
    sigs = {
        "ferry_strerror": (cp, [i]),
        "ferry_version_string": (cp, []),
        "ferry_comm_init_env": (i, [C.POINTER(vp), cp, sz]),
        "ferry_comm_init_allgather": (i, [i, i, ALLGATHER_FN, vp, C.POINTER(vp), cp, sz]),
        "ferry_comm_rank": (i, [vp]),
        "ferry_comm_size": (i, [vp]),
        "ferry_comm_last_error": (cp, [vp]),
        "ferry_comm_barrier": (i, [vp]),
        "ferry_comm_destroy": (i, [vp]),
        "ferry_ep_create": (i, [vp, C.POINTER(EpConfig), C.POINTER(vp)]),
        "ferry_ep_destroy": (i, [vp]),
        "ferry_ep_last_error": (cp, [vp]),
        "ferry_ep_get_layout": (i, [vp, C.POINTER(Layout)]),
        "ferry_dispatch_send": (i, [vp, C.POINTER(DispatchIn), C.POINTER(u64)]),
        "ferry_dispatch_recv": (i, [vp, u64, C.POINTER(DispatchOut)]),
        "ferry_combine_send": (i, [vp, u64, C.POINTER(CombineIn)]),
        "ferry_combine_recv": (i, [vp, u64, C.POINTER(CombineOut)]),
        "ferry_dispatch": (i, [vp, C.POINTER(DispatchIn), C.POINTER(DispatchOut),
                               C.POINTER(u64)]),
        "ferry_combine": (i, [vp, u64, C.POINTER(CombineIn), C.POINTER(CombineOut)]),
        "ferry_ep_sync": (i, [vp, vp]),
        "ferry_ep_mask_rank": (i, [vp, i, i, vp]),
        "ferry_ep_mask_query": (i, [vp, vp, vp]),
        "ferry_ep_get_nodes": (i, [vp, vp, vp, vp]),
        "ferry_ep_get_stats": (i, [vp, C.POINTER(EpStats)]),
        "ferry_route_create": (i, [vp, C.POINTER(RouteIn), C.POINTER(vp)]),
        "ferry_route_counts": (i, [vp, C.POINTER(i), vp]),
        "ferry_route_destroy": (i, [vp]),
        "ferry_ht_dispatch": (i, [vp, vp, C.POINTER(HtDispatchIn), C.POINTER(HtDispatchOut)]),
        "ferry_ht_combine": (i, [vp, vp, C.POINTER(HtCombineIn), C.POINTER(HtCombineOut)]),
        "ferry_cuda_available": (i, [cp, sz]),
        "ferry_dispatch_layout": (i, [C.POINTER(LayoutArgs), cp, sz]),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype = res
        f.argtypes = args
    return lib
