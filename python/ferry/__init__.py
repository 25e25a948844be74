"""ferry: MoE dispatch and combine across ranks, from Python.

A thin binding over libferry (ctypes). Arrays are passed by pointer, with
no copies: numpy arrays, torch tensors (CPU or CUDA), CuPy arrays, or
anything with __array_interface__ / __cuda_array_interface__. bf16 data
is torch.bfloat16, or raw bf16 bits in a uint16 array (numpy has no
bfloat16). CUDA work goes on the caller's current stream unless a stream
is given.

    import ferry
    comm = ferry.Comm()                  # from FERRY_*/mpirun/torchrun/srun
    # comm = ferry.Comm(group)           # or a torch.distributed group
    ep = ferry.EP(comm, num_experts=256, topk=8, hidden=7168, max_tokens=128,
                  dtype="fp8", device="cpu")
    bufs = ep.alloc(np)                  # expert_x, scales, counts, ...
    r = ep.dispatch_send(x, topk_idx)
    ep.dispatch_recv(r, **bufs)
    ep.combine_send(r, expert_y)
    ep.combine_recv(r, topk_weights, out)
"""
import ctypes as C

from . import _lib

__all__ = ["FerryError", "Comm", "EP", "version", "cuda_available"]

_L = None


def _lib_handle():
    global _L
    if _L is None:
        _L = _lib.load()
    return _L


class FerryError(RuntimeError):
    """A ferry call failed. .status is the code (negative), .name its name."""

    def __init__(self, status, message):
        self.status = status
        self.name = _lib.STATUS.get(status, str(status))
        super().__init__(f"{self.name}: {message}")


def version():
    return _lib_handle().ferry_version_string().decode()


def cuda_available():
    buf = C.create_string_buffer(256)
    ok = _lib_handle().ferry_cuda_available(buf, 256)
    return bool(ok), buf.value.decode()


# ---------------------------------------------------------------- arrays

def _info(a, name):
    """(pointer, device, dtype name, shape) of an array-like, no copy."""
    if a is None:
        return None
    mod = type(a).__module__.split(".")[0]
    if mod == "torch":
        if not a.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
        dev = "cuda" if a.is_cuda else "cpu"
        return a.data_ptr(), dev, str(a.dtype).replace("torch.", ""), tuple(a.shape)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        if cai.get("strides") not in (None,):
            raise ValueError(f"{name}: must be C-contiguous")
        return cai["data"][0], "cuda", _typestr(cai["typestr"]), tuple(cai["shape"])
    ai = getattr(a, "__array_interface__", None)
    if ai is not None:
        if ai.get("strides") is not None and not getattr(a, "flags", {"C_CONTIGUOUS": True})["C_CONTIGUOUS"]:
            raise ValueError(f"{name}: must be C-contiguous")
        return ai["data"][0], "cpu", _typestr(ai["typestr"]), tuple(ai["shape"])
    raise TypeError(f"{name}: expected a numpy/torch/CuPy array, got {type(a).__name__}")


def _typestr(t):
    return {"<u2": "uint16", "<i8": "int64", "<f4": "float32", "<i4": "int32",
            "|u1": "uint8", "<u1": "uint8"}.get(t, t)


def _stream_of(a, stream):
    if stream is not None:
        return stream if isinstance(stream, int) else getattr(stream, "cuda_stream", stream)
    if a is not None and type(a).__module__.split(".")[0] == "torch" and a.is_cuda:
        import torch
        return torch.cuda.current_stream(a.device).cuda_stream
    return None


# ---------------------------------------------------------------- comm

class Comm:
    """Who the ranks are. Comm() reads the environment (FERRY_RANK/
    FERRY_WORLD_SIZE/FERRY_ROOT, Open MPI, torchrun, Slurm); Comm(group)
    uses a torch.distributed process group's allgather."""

    def __init__(self, group=None):
        lib = _lib_handle()
        self._h = C.c_void_p()
        err = C.create_string_buffer(512)
        self._cb = None
        if group is None:
            rc = lib.ferry_comm_init_env(C.byref(self._h), err, 512)
        else:
            import torch
            import torch.distributed as dist
            backend = dist.get_backend(group)
            dev = torch.device("cuda", torch.cuda.current_device()) \
                if backend == "nccl" else torch.device("cpu")
            n = dist.get_world_size(group)

            def allgather(inp, out, length, ctx):
                try:
                    src = torch.frombuffer((C.c_char * length).from_address(inp),
                                           dtype=torch.uint8).to(dev)
                    dst = torch.empty(n * length, dtype=torch.uint8, device=dev)
                    dist.all_gather_into_tensor(dst, src, group=group)
                    host = dst.cpu().numpy()  # keep it alive across the copy
                    C.memmove(out, host.ctypes.data, n * length)
                    return 0
                except Exception:  # reported by ferry as a bootstrap error
                    return -1

            self._cb = _lib.ALLGATHER_FN(allgather)
            rc = lib.ferry_comm_init_allgather(dist.get_rank(group), n, self._cb, None,
                                               C.byref(self._h), err, 512)
        if rc != 0:
            raise FerryError(rc, err.value.decode())

    @property
    def rank(self):
        return _lib_handle().ferry_comm_rank(self._h)

    @property
    def size(self):
        return _lib_handle().ferry_comm_size(self._h)

    def barrier(self):
        rc = _lib_handle().ferry_comm_barrier(self._h)
        if rc:
            raise FerryError(rc, _lib_handle().ferry_comm_last_error(self._h).decode())

    def close(self):
        if self._h:
            _lib_handle().ferry_comm_destroy(self._h)
            self._h = C.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- EP

class EP:
    """An expert-parallel context (collective to create and to close)."""

    def __init__(self, comm, num_experts, topk, hidden, max_tokens, dtype="bf16",
                 device="cpu", num_sms=0):
        if dtype not in _lib.DTYPES:
            raise ValueError(f"dtype={dtype!r}: use 'bf16' or 'fp8'")
        if device not in _lib.DEVICES:
            raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
        lib = _lib_handle()
        self.comm = comm
        cfg = _lib.EpConfig(C.sizeof(_lib.EpConfig), _lib.FERRY_EP_CONFIG_MAGIC,
                            _lib.VERSION_CODE, num_experts, topk, hidden, max_tokens,
                            _lib.DTYPES[dtype], _lib.DEVICES[device], num_sms)
        self._h = C.c_void_p()
        rc = lib.ferry_ep_create(comm._h, C.byref(cfg), C.byref(self._h))
        if rc != 0:
            raise FerryError(rc, lib.ferry_comm_last_error(comm._h).decode())
        lay = _lib.Layout()
        lay.size = C.sizeof(_lib.Layout)
        self._check(lib.ferry_ep_get_layout(self._h, C.byref(lay)))
        self.num_experts, self.topk, self.hidden = num_experts, topk, hidden
        self.max_tokens, self.dtype, self.device = max_tokens, dtype, device
        self.num_ranks = lay.num_ranks
        self.rank = lay.rank
        self.num_local_experts = lay.num_local_experts
        self.capacity = lay.expert_capacity
        self.num_scales = lay.num_scales
        self._keep = {}

    def _check(self, rc):
        if rc != 0:
            raise FerryError(rc, _lib_handle().ferry_ep_last_error(self._h).decode())

    def _want(self, a, name, dtypes, shape=None):
        inf = _info(a, name)
        if inf is None:
            return None
        ptr, dev, dt, shp = inf
        if dev != self.device:
            raise ValueError(f"{name}: on {dev}, but the context is on {self.device}")
        if dt not in dtypes:
            raise TypeError(f"{name}: dtype {dt}, expected {' or '.join(dtypes)}")
        if shape is not None and shp != tuple(shape):
            raise ValueError(f"{name}: shape {shp}, expected {tuple(shape)}")
        return ptr

    def alloc(self, xp=None):
        """Output buffers of dispatch_recv, as numpy (default) or torch arrays."""
        El, cap, H = self.num_local_experts, self.capacity, self.hidden
        if xp is None or xp.__name__ == "numpy":
            import numpy as np
            ex = np.zeros((El, cap, H if self.dtype == "fp8" else H), dtype=np.uint8 if self.dtype == "fp8" else np.uint16)
            sc = np.zeros((El, cap, max(1, self.num_scales)), dtype=np.float32)
            return dict(expert_x=ex, expert_x_scales=sc if self.dtype == "fp8" else None,
                        expert_num_tokens=np.zeros(El, dtype=np.int32),
                        expert_src_rank=np.zeros((El, cap), dtype=np.int32),
                        expert_src_token=np.zeros((El, cap), dtype=np.int32))
        import torch
        dev = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else "cpu"
        ex = torch.empty((El, cap, H), dtype=torch.float8_e4m3fn if self.dtype == "fp8" else torch.bfloat16, device=dev)
        sc = torch.empty((El, cap, max(1, self.num_scales)), dtype=torch.float32, device=dev)
        return dict(expert_x=ex, expert_x_scales=sc if self.dtype == "fp8" else None,
                    expert_num_tokens=torch.zeros(El, dtype=torch.int32, device=dev),
                    expert_src_rank=torch.empty((El, cap), dtype=torch.int32, device=dev),
                    expert_src_token=torch.empty((El, cap), dtype=torch.int32, device=dev))

    _X = ("uint16", "bfloat16")
    _X8 = ("uint8", "float8_e4m3fn")

    def dispatch_send(self, x, topk_idx, x_scales=None, num_tokens=None, stream=None):
        """Send tokens x [T, H] (bf16; fp8 with x_scales [T, H/128]) to the
        ranks of their experts; topk_idx [T, K] int64, -1 = none. Returns the
        round. num_tokens: an int, or (CUDA) an int32 device array."""
        T = _info(topk_idx, "topk_idx")[3][0] if topk_idx is not None else 0
        nt_dev = None
        if num_tokens is not None and not isinstance(num_tokens, int):
            nt_dev = self._want(num_tokens, "num_tokens", ("int32",))
        elif isinstance(num_tokens, int):
            T = num_tokens
        px = self._want(x, "x", self._X8 if x_scales is not None else self._X)
        pi = self._want(topk_idx, "topk_idx", ("int64",))
        ps = self._want(x_scales, "x_scales", ("float32",))
        din = _lib.DispatchIn(C.sizeof(_lib.DispatchIn), T, px, ps, pi,
                              _stream_of(x, stream), nt_dev)
        r = C.c_uint64()
        self._check(_lib_handle().ferry_dispatch_send(self._h, C.byref(din), C.byref(r)))
        self._keep[r.value] = (x, topk_idx, x_scales)  # alive until the round ends
        return r.value

    def dispatch_recv(self, round, expert_x, expert_num_tokens, expert_x_scales=None,
                      expert_src_rank=None, expert_src_token=None, stream=None):
        dout = _lib.DispatchOut(
            C.sizeof(_lib.DispatchOut),
            self._want(expert_x, "expert_x", self._X8 if self.dtype == "fp8" else self._X),
            self._want(expert_x_scales, "expert_x_scales", ("float32",)),
            self._want(expert_num_tokens, "expert_num_tokens", ("int32",)),
            self._want(expert_src_rank, "expert_src_rank", ("int32",)),
            self._want(expert_src_token, "expert_src_token", ("int32",)),
            _stream_of(expert_x, stream))
        self._check(_lib_handle().ferry_dispatch_recv(self._h, round, C.byref(dout)))

    def combine_send(self, round, expert_y, stream=None):
        """expert_y [E_local, capacity, H] bf16, the experts' outputs."""
        cin = _lib.CombineIn(C.sizeof(_lib.CombineIn),
                             self._want(expert_y, "expert_y", self._X),
                             _stream_of(expert_y, stream))
        self._check(_lib_handle().ferry_combine_send(self._h, round, C.byref(cin)))
        k = self._keep.get(round, ())
        self._keep[round] = tuple(k) + (expert_y,)

    def combine_recv(self, round, topk_weights, out, stream=None):
        """out [T, H] bf16 = sum_k topk_weights[t, k] * y_k[t] (fp32 sum)."""
        cout = _lib.CombineOut(C.sizeof(_lib.CombineOut),
                               self._want(topk_weights, "topk_weights", ("float32",)),
                               self._want(out, "out", self._X), _stream_of(out, stream))
        self._check(_lib_handle().ferry_combine_recv(self._h, round, C.byref(cout)))
        self._keep.pop(round, None)

    def dispatch(self, x, topk_idx, x_scales=None, num_tokens=None, stream=None, **out):
        r = self.dispatch_send(x, topk_idx, x_scales, num_tokens, stream)
        self.dispatch_recv(r, stream=stream, **out)
        return r

    def combine(self, round, expert_y, topk_weights, out, stream=None):
        self.combine_send(round, expert_y, stream)
        self.combine_recv(round, topk_weights, out, stream)

    def sync(self, stream=None):
        """Wait for the stream (CUDA) and raise what the GPU reported."""
        self._check(_lib_handle().ferry_ep_sync(self._h, stream))

    def close(self):
        if self._h:
            rc = _lib_handle().ferry_ep_destroy(self._h)
            self._h = C.c_void_p()
            self._keep.clear()
            if rc:
                raise FerryError(rc, "ferry_ep_destroy failed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
