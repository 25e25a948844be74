"""EP (an expert-parallel context: low-latency rounds and the
high-throughput calls) and Route (a high-throughput routing)."""
import ctypes as C
import numbers
import sys
import weakref

from . import _lib
from ._arrays import (_BF16, _F32, _FP8, _I32, _I64, _SIG, _U8, _current_cuda_device,
                      _elem_strides, _fmt_shape, _info, _stream_of, _torch_like)
from ._comm import Comm
from ._core import FerryError, _lib_handle, _lib_version, _torchext, version

class EP:
    """An expert-parallel context (collective to create and to close).

    Every array is checked against the context before its pointer reaches
    libferry: device, dtype, shape and C-contiguity (outputs also writable);
    a mismatch raises TypeError (not an array, wrong dtype) or ValueError
    (shape, layout, device), naming the argument. Methods after close()
    raise ValueError; closing twice is harmless. fp8_round_scale=True (fp8
    only): block scales rounded up to powers of two (DeepEP's
    round_scale). scales_layout (fp8, low latency): how expert_x_scales is
    laid out, "rows" (default: float32 [E_local, capacity, S], C-contiguous),
    "cols" (float32 [E_local, capacity, S] column-major in the last two
    dims, as DeepEP returns them: a transposed view of a contiguous
    [E_local, S, capacity]) or "ue8m0" (int32 [E_local, capacity, S/4],
    column-major the same way, four exponent bytes per word: DeepEP's
    use_ue8m0; needs fp8_round_scale and hidden a multiple of 512).
    dtype="nvfp4" (low latency): dispatch_send quantises bf16 x
    with x_global_scale (ferry.h, FERRY_DTYPE_NVFP4); expert_x is uint8
    [E_local, capacity, H/2] (channel 2c in the low nibble of byte c),
    expert_x_scales uint8 [E_local, ceil(capacity/128), H/64, 32, 4, 4]
    (e4m3 bytes in the 128 x 4 block-scaled layout); alloc() makes both.
    mask_on_timeout=True (low latency): a peer that sends nothing within
    FERRY_TIMEOUT_MS (or is seen dead) is masked (mask_rank) instead of
    failing the round, which completes without it (DeepEP's shrink mode);
    mask_query() says which. forward (high throughput across nodes):
    "auto" (default: forward when the ranks span nodes, FERRY_HT_FORWARD
    may say otherwise), "on" (a token crosses the fabric once per
    destination node and a rank there passes it on) or "off" (once per
    destination rank); nodes() says what each rank's node is and whether
    this context forwards. dp_size: DP groups of that many
    consecutive ranks (pplx-kernels' dp_size; 1, the default: none).
    Members hold the group's tokens and call with the same arguments
    (max_tokens and each call's T are the group's); member m sends tokens
    [m*T//G, (m+1)*T//G) and every member's combine output holds every
    token's result. Receivers see each member as a source with its share
    (source token ids index that share)."""

    _FORWARD = {"auto": 0, "off": 1, "on": 2}

    def __init__(self, comm, num_experts, topk, hidden, max_tokens, dtype="bf16",
                 device="cpu", num_sms=0, mode="ll", ring_tokens=0, fp8_round_scale=False,
                 scales_layout="rows", mask_on_timeout=False, forward="auto", dp_size=1):
        if dtype not in _lib.DTYPES:
            raise ValueError(f"dtype={dtype!r}: use 'bf16', 'fp8' or 'nvfp4'")
        if mode not in _lib.MODES:
            raise ValueError(f"mode={mode!r}: use 'll' (low latency) or 'ht' (high throughput)")
        if scales_layout not in _lib.SCALES:
            raise ValueError(f"scales_layout={scales_layout!r}: use 'rows', 'cols' or 'ue8m0'")
        if device not in _lib.DEVICES:
            raise ValueError(f"device={device!r}: use 'cpu' or 'cuda'")
        if forward not in self._FORWARD:
            raise ValueError(f"forward={forward!r}: use 'auto', 'on' or 'off'")
        if not isinstance(comm, Comm):
            raise TypeError(f"comm: expected a ferry.Comm, got {type(comm).__name__}")
        num_experts, topk, hidden, max_tokens, num_sms, ring_tokens, dp_size = (
            _lib.c_int(v, n) for v, n in ((num_experts, "num_experts"), (topk, "topk"),
                                          (hidden, "hidden"), (max_tokens, "max_tokens"),
                                          (num_sms, "num_sms"), (ring_tokens, "ring_tokens"),
                                          (dp_size, "dp_size")))
        ch = comm._handle()
        lib = _lib_handle()
        self._h = C.c_void_p()
        cfg = _lib.EpConfig(C.sizeof(_lib.EpConfig), _lib.FERRY_EP_CONFIG_MAGIC,
                            _lib.VERSION_CODE, num_experts, topk, hidden, max_tokens,
                            _lib.DTYPES[dtype], _lib.DEVICES[device], num_sms,
                            _lib.MODES[mode], ring_tokens, int(bool(fp8_round_scale)),
                            _lib.SCALES[scales_layout], int(bool(mask_on_timeout)),
                            self._FORWARD[forward], dp_size)
        rc = lib.ferry_ep_create(ch, C.byref(cfg), C.byref(self._h))
        if rc != 0:
            self._h = C.c_void_p()
            raise FerryError(rc, lib.ferry_comm_last_error(ch).decode())
        self.comm = comm  # kept open until this EP is closed
        comm._eps += 1
        lay = _lib.Layout()
        lay.size = C.sizeof(_lib.Layout)
        rc = lib.ferry_ep_get_layout(self._h, C.byref(lay))
        if rc != 0:
            msg = lib.ferry_ep_last_error(self._h).decode()
            self.close()
            raise FerryError(rc, msg)
        self.num_experts, self.topk, self.hidden = num_experts, topk, hidden
        self.max_tokens, self.dtype, self.device = max_tokens, dtype, device
        self.mode = mode
        self.dp_size = max(dp_size, 1)
        self.num_sms = num_sms  # as asked (0: the engine's default)
        self.fp8_round_scale = bool(fp8_round_scale)
        self.scales_layout = scales_layout
        self.num_ranks = lay.num_ranks
        self.rank = lay.rank
        self.num_local_experts = lay.num_local_experts
        self.capacity = lay.expert_capacity
        self.num_scales = lay.num_scales
        self.token_bytes = lay.token_bytes
        # calls need a stream made with cudaStreamNonBlocking (GPU memory on
        # the fabric path through a provider copying on the legacy stream)
        self.needs_nonblocking_stream = bool(lay.needs_nonblocking_stream)
        self._cuda_index = _current_cuda_device() if device == "cuda" else None
        self._keep = {}
        self._rounds = {}  # round -> T (rows of topk_weights and out at combine)
        self._last_round = 0  # rounds are numbered 1, 2, 3... per context
        # routes: the context owns every route's handle until it is
        # destroyed (_route_hs, addresses: destroyed before the context, by
        # Route.close, or after their Route died); _dead: those whose Route
        # died (Route.__del__, in whatever thread the collector ran), each
        # destroyed by the next call on this context in its caller's
        # thread (_ep) or by close; _routes: the live Route objects, marked
        # closed with the context
        self._route_hs = set()
        self._dead = []
        self._routes = weakref.WeakSet()


    def _ep(self):
        if not self._h:
            raise ValueError("EP: the context is closed")
        if self._dead:
            self._reap()
        return self._h

    def _reap(self):
        """Destroy the routes whose Route objects died (queued by
        Route.__del__; pop is atomic, so a collector in another thread may
        queue more meanwhile)."""
        while self._dead:
            a = self._dead.pop()
            if a in self._route_hs:
                self._route_hs.discard(a)
                _lib_handle().ferry_route_destroy(C.c_void_p(a))

    def _route_free(self, a):
        """Route.close: destroy route handle a now, if this context still
        owns it (not after the context was closed)."""
        if a in self._route_hs:
            self._route_hs.discard(a)
            if self._h:
                _lib_handle().ferry_route_destroy(C.c_void_p(a))

    # -- the round API for layers built on EP (ferry.deep_ep): what they
    # -- may read and set instead of the context's private state

    def handle(self):
        """The C handle (ferry_ep_t, a ctypes c_void_p) for calls made
        through libferry directly; ValueError once the context is closed."""
        return self._ep()

    @property
    def last_round(self):
        """The number of the last round dispatched on this context (rounds
        are 1, 2, 3...; 0 before the first). Buffer set r & 1 serves round
        r."""
        return self._last_round

    @last_round.setter
    def last_round(self, r):
        """Rounds dispatched by a caller's own C calls (a captured CUDA
        graph replayed, which advances the device's round): the context
        counts from r on."""
        self._last_round = int(r)

    def next_set(self):
        """The buffer set (0 or 1) the next round uses."""
        return (self._last_round + 1) & 1

    def new_expert_scales(self, xp, f32, i32, kw):
        """An expert_x_scales buffer in the context's layout (rows, or the
        column-major views of DeepEP's layouts) made with the array module
        xp (numpy or torch), its float32 and int32 dtypes and extra keyword
        arguments kw (e.g. device=)."""
        return self._scales_new(xp, f32, i32, kw)

    def nodes(self):
        """(node of each rank as a list, forwards): ranks that share memory
        form a node, numbered in the order of their lowest rank; forwards
        is True when the high-throughput calls send through one rank per
        node (ferry_ep_get_nodes)."""
        n, fwd = C.c_int(), C.c_int()
        node_of = (C.c_int32 * self.num_ranks)()
        self._check(_lib_handle().ferry_ep_get_nodes(self._ep(), C.byref(n), node_of,
                                                      C.byref(fwd)))
        return list(node_of), bool(fwd.value)

    def stats(self):
        """The counters of the thread that drives this context's fabric path
        (ferry_ep_get_stats), cumulative since creation, as a dict: writes,
        bytes (payload posted to fabric peers), arrivals, ... (ferry.h)."""
        st = _lib.EpStats()
        st.size = C.sizeof(_lib.EpStats)
        self._check(_lib_handle().ferry_ep_get_stats(self._ep(), C.byref(st)))
        return {n: getattr(st, n) for n, _ in _lib.EpStats._fields_[1:]}

    def _check(self, rc):
        if rc != 0:
            raise FerryError(rc, _lib_handle().ferry_ep_last_error(self._h).decode())

    def _arr(self, a, name, dtypes, shape, required=True, output=False, inf=None,
             strided=False):
        """The pointer of a checked against the context, or None (when a is
        None and not required). shape: a tuple, None entries any size.
        strided: a torch or numpy view whose element strides are all at
        least 1 is taken too (_elem_strides says which)."""
        if a is None:
            if required:
                raise TypeError(f"{name}: expected shape {self._show(shape)} "
                                f"{dtypes[0]}, got None")
            return None
        if inf is None:
            inf = _info(a, name)
        # the messages are built only when a check fails (this runs per call)
        if inf.dev != self.device:
            raise ValueError(f"{name}: expected a {self.device} array, got a {inf.dev} array")
        if self._cuda_index is not None and inf.index is not None \
                and inf.index != self._cuda_index:
            raise ValueError(f"{name}: expected an array on cuda:{self._cuda_index} "
                             f"(the context's device), got one on cuda:{inf.index}")
        if inf.dtype not in dtypes:
            raise TypeError(self._mismatch(name, shape, dtypes, inf))
        ishape = inf.shape
        if len(ishape) != len(shape):
            raise ValueError(self._mismatch(name, shape, dtypes, inf))
        for w, n in zip(shape, ishape):  # a loop: cheaper than any() over a generator
            if w is not None and w != n:
                raise ValueError(self._mismatch(name, shape, dtypes, inf))
        if not inf.contig and not (strided and _elem_strides(a) is not None):
            raise ValueError(f"{name}: expected a " + (
                "C-contiguous or strided (every stride at least 1 element, aligned) array, "
                if strided else "C-contiguous (row-major, aligned) array, ") +
                f"got a strided view {_fmt_shape(ishape)} {inf.dtype}")
        if output and not inf.writable:
            raise ValueError(f"{name}: expected a writable array, got a read-only one")
        return inf.ptr

    def _mismatch(self, name, shape, dtypes, inf):
        want = f"{self._show(shape)} {dtypes[1] if inf.torch else dtypes[0]}"
        return f"{name}: expected shape {want}, got {_fmt_shape(inf.shape)} {inf.dtype}"

    @staticmethod
    def _show(shape):
        return _fmt_shape(["T" if n is None else n for n in shape])

    def alloc(self, xp=None):
        """Output buffers of dispatch_recv, as numpy (default) or torch arrays."""
        self._ep()
        El, cap, H = self.num_local_experts, self.capacity, self.hidden
        if xp is None or xp.__name__ == "numpy":
            import numpy as np
            q = self.dtype != "bf16"
            ex = np.zeros(self._x_shape(), dtype=np.uint8 if q else np.uint16)
            sc = self._scales_new(np, np.float32, np.int32, dict(dtype=np.float32))
            return dict(expert_x=ex, expert_x_scales=sc if q else None,
                        expert_num_tokens=np.zeros(El, dtype=np.int32),
                        expert_src_rank=np.zeros((El, cap), dtype=np.int32),
                        expert_src_token=np.zeros((El, cap), dtype=np.int32))
        import torch
        dev = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else "cpu"
        xdt = {"fp8": torch.float8_e4m3fn, "nvfp4": torch.uint8}.get(self.dtype, torch.bfloat16)
        ex = torch.empty(self._x_shape(), dtype=xdt, device=dev)
        sc = self._scales_new(torch, torch.float32, torch.int32, dict(device=dev))
        return dict(expert_x=ex, expert_x_scales=sc if self.dtype != "bf16" else None,
                    expert_num_tokens=torch.zeros(El, dtype=torch.int32, device=dev),
                    expert_src_rank=torch.empty((El, cap), dtype=torch.int32, device=dev),
                    expert_src_token=torch.empty((El, cap), dtype=torch.int32, device=dev))

    def _x_shape(self):
        """expert_x's shape: [E_local, capacity, H], NVFP4 H/2 bytes."""
        H = self.hidden // 2 if self.dtype == "nvfp4" else self.hidden
        return (self.num_local_experts, self.capacity, H)

    def _nvfp4_scales_shape(self):
        """NVFP4's expert_x_scales: uint8 [E_local, ceil(capacity / 128),
        H/64, 32, 4, 4], the 128 x 4 block-scaled layout (ferry.h)."""
        return (self.num_local_experts, (self.capacity + 127) // 128, self.hidden // 64, 32, 4,
                4)

    def _scales_new(self, xp, f32, i32, kw):
        """An expert_x_scales buffer in the context's layout (rows; or the
        column-major view of a contiguous [E_local, S, capacity]; NVFP4's
        swizzled bytes)."""
        El, cap, ns = self.num_local_experts, self.capacity, max(1, self.num_scales)
        kw = dict(kw)
        if self.dtype == "nvfp4":
            kw["dtype"] = getattr(xp, "uint8")
            return xp.zeros(self._nvfp4_scales_shape(), **kw)
        if self.scales_layout == "rows":
            kw["dtype"] = f32
            return xp.zeros((El, cap, ns), **kw)
        kw["dtype"] = f32 if self.scales_layout == "cols" else i32
        S = ns if self.scales_layout == "cols" else ns // 4
        return xp.zeros((El, S, cap), **kw).swapaxes(1, 2)

    def _scales_ptr(self, a, required):
        """expert_x_scales checked against the context's layout."""
        El, cap, ns = self.num_local_experts, self.capacity, self.num_scales
        if self.dtype == "nvfp4":
            return self._arr(a, "expert_x_scales", _U8, self._nvfp4_scales_shape(),
                             required=required, output=True)
        if self.scales_layout == "rows":
            return self._arr(a, "expert_x_scales", _F32, (El, cap, ns), required=required,
                             output=True)
        cols = self.scales_layout == "cols"
        S = ns if cols else ns // 4
        if a is None or getattr(a, "ndim", None) != 3 or not hasattr(a, "swapaxes"):
            return self._arr(a, "expert_x_scales", _F32 if cols else _I32, (El, cap, S),
                             required=True, output=True)
        # column-major in the last two dims: its transpose is C-contiguous
        return self._arr(a.swapaxes(1, 2), f"expert_x_scales.transpose(1, 2) (scales_layout="
                         f"{self.scales_layout!r})", _F32 if cols else _I32, (El, S, cap),
                         output=True)

    def _din(self, x, topk_idx, x_scales, num_tokens, stream, x_global_scale=None):
        """dispatch_send's argument block, checked, and the round's rows."""
        H, K, Tmax = self.hidden, self.topk, self.max_tokens
        # rows: from topk_idx, else x; both absent is an empty round
        lead = topk_idx if topk_idx is not None else x
        R, ii, ix = 0, None, None
        if lead is not None:
            inf = _info(lead, "topk_idx" if topk_idx is not None else "x")
            R = inf.shape[0] if len(inf.shape) == 2 else None
            ii, ix = (inf, None) if topk_idx is not None else (None, inf)
        quant = x_scales is not None
        if quant and self.dtype != "fp8":
            raise ValueError(f"x_scales: given, but the context's dispatch dtype is "
                             f"{self.dtype} (pre-quantised input needs dtype='fp8')")
        pi = self._arr(topk_idx, "topk_idx", _I64, (R, K), required=R != 0, inf=ii)
        px = self._arr(x, "x", _FP8 if quant else _BF16, (R, H), required=R != 0, inf=ix)
        ps = self._arr(x_scales, "x_scales", _F32, (R, self.num_scales), required=False)
        if R > Tmax:
            raise ValueError(f"x: expected at most max_tokens = {Tmax} rows, got "
                             f"{_fmt_shape(_info(x, 'x').shape)}")
        nt_dev, T = None, R
        if isinstance(num_tokens, bool):
            raise TypeError("num_tokens: expected an int, got bool")
        if isinstance(num_tokens, numbers.Integral):
            num_tokens = int(num_tokens)
        if num_tokens is not None and not isinstance(num_tokens, int):
            if self.device != "cuda":
                raise TypeError(f"num_tokens: expected an int (a device array only with "
                                f"device='cuda'), got {type(num_tokens).__name__}")
            nt_dev = self._arr(num_tokens, "num_tokens", _I32, (1,))
            if R != Tmax:
                raise ValueError(f"num_tokens: a device array needs x and topk_idx of "
                                 f"max_tokens = {Tmax} rows (it is read when the work runs), "
                                 f"got {R} rows")
            T = Tmax
        elif num_tokens is not None:
            if not 0 <= num_tokens <= R:
                raise ValueError(f"num_tokens: expected 0..{R} (the rows of x), "
                                 f"got {num_tokens}")
            T = num_tokens
        din = _lib.DispatchIn(C.sizeof(_lib.DispatchIn), T, px, ps, pi,
                              _stream_of(x, stream), nt_dev,
                              self._global_scale(x_global_scale))
        return din, T

    def _global_scale(self, gs):
        """x_global_scale's pointer: NVFP4's encode scale, a float or a
        float32 array (its first element; a device array on CUDA contexts,
        read when the work runs); None for the other dtypes."""
        if self.dtype != "nvfp4":
            if gs is not None:
                raise ValueError(f"x_global_scale: given, but the context's dispatch dtype is "
                                 f"{self.dtype} (it is NVFP4's encode scale)")
            return None
        if gs is None:
            raise ValueError("x_global_scale: required with dtype='nvfp4' (the encode scale, "
                             "the same on every rank)")
        if isinstance(gs, numbers.Real) and not isinstance(gs, bool):
            if self.device == "cuda":
                raise TypeError("x_global_scale: a float32 device array on a CUDA context "
                                "(read when the work runs), got a number")
            import numpy as np
            gs = np.array([gs], dtype=np.float32)
        inf = _info(gs, "x_global_scale")
        if len(inf.shape) > 1 or (inf.shape and inf.shape[0] < 1):
            raise ValueError(f"x_global_scale: expected one float32 (0-d or 1-d), got "
                             f"{_fmt_shape(inf.shape)}")
        p = self._arr(gs, "x_global_scale", _F32, tuple(inf.shape), inf=inf)
        self._keep["gs"] = gs  # alive while the call reads it
        return p

    def _sent(self, r, T, x, topk_idx, x_scales, num_tokens):
        # alive until the round ends
        self._keep[r] = (x, topk_idx, x_scales, num_tokens)
        self._rounds[r] = T
        self._last_round = r
        return r

    def dispatch_send(self, x, topk_idx, x_scales=None, num_tokens=None, stream=None,
                      x_global_scale=None):
        """Send tokens x [T, H] (bf16; fp8 with x_scales [T, H/128]) to the
        ranks of their experts; topk_idx [T, K] int64, -1 = none; T <=
        max_tokens. Returns the round. num_tokens: an int <= T (the first
        num_tokens rows are sent; combine then takes num_tokens rows), or
        (CUDA) an int32 device array of one element, read when the work
        runs: then x and topk_idx have max_tokens rows, and so do
        topk_weights and out at combine. x_global_scale (dtype='nvfp4'): the
        encode scale, a float or a float32 array of one element (ferry.h)."""
        h = self._ep()
        din, T = self._din(x, topk_idx, x_scales, num_tokens, stream, x_global_scale)
        r = C.c_uint64()
        self._check(_lib_handle().ferry_dispatch_send(h, C.byref(din), C.byref(r)))
        return self._sent(r.value, T, x, topk_idx, x_scales, num_tokens)

    def dispatch_recv(self, round, expert_x, expert_num_tokens, expert_x_scales=None,
                      expert_src_rank=None, expert_src_token=None, stream=None,
                      wait_cost=None, recv_stats=None):
        """expert_x [E_local, capacity, H] (bf16, or fp8 with expert_x_scales
        [E_local, capacity, H/128] float32), expert_num_tokens [E_local]
        int32, optional expert_src_rank/expert_src_token [E_local, capacity]
        int32: see alloc(). Optional wait_cost [num_ranks] int64: adds, per
        source rank, how long this receive waited for it (CUDA: SM clock
        cycles; CPU: nanoseconds). Optional recv_stats [E_local] int32: adds
        expert_num_tokens (a running total; on CUDA ranks by the kernel)."""
        h = self._ep()
        round = _lib.c_int(round, "round", C.c_uint64)
        dout = self._dout(expert_x, expert_num_tokens, expert_x_scales, expert_src_rank,
                          expert_src_token, stream, wait_cost, recv_stats)
        self._check(_lib_handle().ferry_dispatch_recv(h, round, C.byref(dout)))

    def _dout(self, expert_x, expert_num_tokens, expert_x_scales, expert_src_rank,
              expert_src_token, stream, wait_cost=None, recv_stats=None):
        El, cap, H = self.num_local_experts, self.capacity, self.hidden
        fp8 = self.dtype == "fp8"
        q = self.dtype != "bf16"
        if not q and expert_x_scales is not None:
            raise ValueError("expert_x_scales: expected None (the context's dispatch "
                             "dtype is bf16), got an array")
        xdt = _FP8 if fp8 else _U8 if q else _BF16
        dout = _lib.DispatchOut(
            C.sizeof(_lib.DispatchOut),
            self._arr(expert_x, "expert_x", xdt, self._x_shape(), output=True),
            self._scales_ptr(expert_x_scales, q),
            self._arr(expert_num_tokens, "expert_num_tokens", _I32, (El,), output=True),
            self._arr(expert_src_rank, "expert_src_rank", _I32, (El, cap), required=False,
                      output=True),
            self._arr(expert_src_token, "expert_src_token", _I32, (El, cap),
                      required=False, output=True),
            _stream_of(expert_x, stream),
            self._arr(wait_cost, "wait_cost", _I64, (self.num_ranks,), required=False,
                      output=True),
            self._arr(recv_stats, "recv_stats", _I32, (El,), required=False, output=True))
        return dout

    def _cin(self, expert_y, stream, signals=None, signal_value=0, signal_block=0,
             sent_rows=None, format="bf16", num_sms=0):
        El = self.num_local_experts
        cin = _lib.CombineIn(C.sizeof(_lib.CombineIn),
                             self._arr(expert_y, "expert_y", _BF16,
                                       (El, self.capacity, self.hidden)),
                             _stream_of(expert_y, stream))
        f = _lib.COMBINE_FORMATS.get(format)
        if f is None:
            raise ValueError(f"format={format!r}: use 'bf16' or 'logfmt'")
        cin.format = f
        cin.num_sms = self._num_sms_arg(num_sms, "num_sms")
        if signals is None:
            if sent_rows is not None:
                raise TypeError("sent_rows: given without signals (it counts the rows sent "
                                "past their signals)")
            return cin
        cin.signals, cin.signal_value, cin.signal_block = self._signal_args(
            signals, signal_value, signal_block)
        cin.sent_rows = self._arr(sent_rows, "sent_rows", _I32, (El,), required=False,
                                  output=True)
        return cin

    @staticmethod
    def _num_sms_arg(n, name):
        """A combine's num_sms (None or 0: the context's) as a C int >= 0."""
        n = _lib.c_int(0 if n is None else n, name)
        if n < 0:
            raise ValueError(f"{name} = {n}: the most SMs the combine takes, > 0, or 0 (None) "
                             f"for the context's")
        return n

    def _signal_args(self, signals, value, block,
                    names=("signals", "signal_value", "signal_block")):
        """The overlapped combine's signals checked against this context:
        (pointer, value as uint32, rows per signal). signals: 1-D uint32 or
        int32, at least E_local * ceil(capacity / block) entries (block 0:
        one per expert); names: the caller's names of the three arguments,
        for the errors."""
        El = self.num_local_experts
        block = _lib.c_int(int(block or 0), names[2])
        if block < 0:
            raise ValueError(f"{names[2]} = {block}: rows per signal, > 0, or 0 for one "
                             f"signal per expert")
        nb = -(-self.capacity // block) if block else 1
        inf = _info(signals, names[0])
        ptr = self._arr(signals, names[0], _SIG, (None,), inf=inf)
        if inf.shape[0] < El * nb:
            raise ValueError(f"{names[0]}: {inf.shape[0]} signals, expected at least {El * nb} "
                             f"({El} local experts x " + (
                                 f"ceil(capacity {self.capacity} / {names[2]} {block}))"
                                 if block else "1)"))
        value = int(value)
        if not -2 ** 31 <= value < 2 ** 32:
            raise ValueError(f"{names[1]} = {value}: a 32-bit value (int32 or uint32)")
        return ptr, value & 0xFFFFFFFF, block

    def combine_send(self, round, expert_y, stream=None, signals=None, signal_value=0,
                     signal_block=0, sent_rows=None, format="bf16", num_sms=0):
        """expert_y [E_local, capacity, H] bf16, the experts' outputs.
        format: how the rows travel, "bf16" or "logfmt" (DeepEP's LogFMT-10,
        hidden a multiple of 512; every rank passes the same in a round).
        num_sms > 0: the most SMs this combine's kernels take on a GPU rank
        (0: the context's; the GEMM beside an overlapped combine keeps the
        rest); ignored on CPU ranks.

        The overlapped combine: with signals (1-D uint32 or int32, expert_y's
        device), row `slot` of local expert e is sent only once
        signals[e * nb + slot // signal_block] == signal_value, nb =
        ceil(capacity / signal_block); signal_block 0: one signal per
        expert (signals[e]). The caller resets the signals between rounds.
        sent_rows: optional int32 [E_local] where the send adds each
        expert's rows once past their signal (adds, never clears)."""
        h = self._ep()
        round = _lib.c_int(round, "round", C.c_uint64)
        cin = self._cin(expert_y, stream, signals, signal_value, signal_block, sent_rows, format,
                        num_sms)
        self._check(_lib_handle().ferry_combine_send(h, round, C.byref(cin)))
        k = self._keep.get(round, ())
        self._keep[round] = tuple(k) + (expert_y,)

    def combine_recv(self, round, topk_weights, out, stream=None, wait_cost=None):
        """out [T, H] bf16 = sum_k topk_weights[t, k] * y_k[t] (fp32 sum);
        topk_weights [T, K] float32; T as at dispatch_send; wait_cost as
        dispatch_recv's."""
        h = self._ep()
        round = _lib.c_int(round, "round", C.c_uint64)
        cout = self._cout(round, topk_weights, out, stream, wait_cost)
        self._check(_lib_handle().ferry_combine_recv(h, round, C.byref(cout)))
        self._keep.pop(round, None)
        self._rounds.pop(round, None)

    def _cout(self, round, topk_weights, out, stream, wait_cost=None):
        T = self._rounds.get(round)
        if T is None:  # not a round of this context in flight: ferry says why
            cout = _lib.CombineOut(C.sizeof(_lib.CombineOut), None, None, None, None)
        else:
            cout = _lib.CombineOut(
                C.sizeof(_lib.CombineOut),
                self._arr(topk_weights, "topk_weights", _F32, (T, self.topk), required=T > 0),
                self._arr(out, "out", _BF16, (T, self.hidden), required=T > 0, output=True),
                _stream_of(out, stream),
                self._arr(wait_cost, "wait_cost", _I64, (self.num_ranks,), required=False,
                          output=True))
        return cout

    def dispatch(self, x, topk_idx, x_scales=None, num_tokens=None, stream=None,
                 x_global_scale=None, **out):
        """dispatch_send and dispatch_recv in one call (one kernel launch on
        CUDA ranks); out: dispatch_recv's arguments. Returns the round."""
        bad = set(out) - {"expert_x", "expert_num_tokens", "expert_x_scales",
                          "expert_src_rank", "expert_src_token", "wait_cost", "recv_stats"}
        if bad:
            raise TypeError("dispatch: unexpected argument(s): " + ", ".join(sorted(bad)))
        h = self._ep()
        din, T = self._din(x, topk_idx, x_scales, num_tokens, stream, x_global_scale)
        dout = self._dout(out.get("expert_x"), out.get("expert_num_tokens"),
                          out.get("expert_x_scales"), out.get("expert_src_rank"),
                          out.get("expert_src_token"), stream, out.get("wait_cost"),
                          out.get("recv_stats"))
        # one stream for both halves (an empty round's x may be None)
        din.stream = dout.stream = din.stream or dout.stream
        r = C.c_uint64()
        self._check(_lib_handle().ferry_dispatch(h, C.byref(din), C.byref(dout), C.byref(r)))
        return self._sent(r.value, T, x, topk_idx, x_scales, num_tokens)

    def combine(self, round, expert_y, topk_weights, out, stream=None, wait_cost=None,
                signals=None, signal_value=0, signal_block=0, sent_rows=None, format="bf16",
                num_sms=0):
        """combine_send and combine_recv in one call (one kernel launch on
        CUDA ranks); signals ..., format, num_sms: combine_send's."""
        h = self._ep()
        round = _lib.c_int(round, "round", C.c_uint64)
        cin = self._cin(expert_y, stream, signals, signal_value, signal_block, sent_rows,
                        format, num_sms)
        cout = self._cout(round, topk_weights, out, stream, wait_cost)
        cin.stream = cout.stream = cin.stream or cout.stream  # out may be None (T = 0)
        self._check(_lib_handle().ferry_combine(h, round, C.byref(cin), C.byref(cout)))
        self._keep.pop(round, None)
        self._rounds.pop(round, None)

    # ------------------------------------------------------ high throughput

    def route(self, topk_idx, expert_alignment=0, stream=None, max_recv=0):
        """Collective (mode='ht'): where this rank's tokens go, from topk_idx
        [T, K] int64 (T <= max_tokens). Returns a Route (num_recv,
        expert_counts); usable for any number of ht_dispatch/ht_combine
        calls (forward and backward) until closed. On CUDA, topk_idx is a
        GPU tensor, the work goes on `stream` (default: the tensor's
        current stream) and the call waits once for the counts.

        max_recv > 0 makes a bounded route (DeepEP's num_worst_tokens): no
        wait for the counts (on CUDA the route, its dispatches and combines
        can be captured in a CUDA graph); num_recv is max_recv, the
        dispatch outputs have max_recv rows, those past the real count
        being padding (recv_topk_idx -1, weights 0, sources -1); the real
        count is route.num_recv_real and the per-expert counts
        route.expert_counts (int32 tensors on the GPU, written on the
        stream; numpy on CPU). More rows than max_recv is an error naming
        max_recv (on CUDA from the next call or sync)."""
        h = self._ep()
        inf = _info(topk_idx, "topk_idx")
        T = inf.shape[0] if len(inf.shape) == 2 else None
        p = self._arr(topk_idx, "topk_idx", _I64, (T, self.topk), required=T != 0, inf=inf)
        st = _stream_of(topk_idx, stream) if self.device == "cuda" else None
        max_recv = _lib.c_int(int(max_recv or 0), "max_recv")
        expert_alignment = _lib.c_int(int(expert_alignment), "expert_alignment")
        if T:
            _lib.c_int(T, "topk_idx rows")
        if max_recv < 0:
            raise ValueError(f"max_recv: {max_recv}: must be 0 (exact route) or the bound on "
                             "rows received")
        return self._route_run(h, topk_idx, T or 0, p, expert_alignment, st, max_recv)

    _RIN_SIZE = C.sizeof(_lib.RouteIn)

    def _route_run(self, h, like, T, p, expert_alignment, st, max_recv):
        """route once its arguments are checked (p: topk_idx's pointer; a
        bounded route's outputs made like `like`)."""
        nout = eout = None
        ext = None if max_recv else self._ext(like)
        if ext is not None:  # route_create and its counts from C++
            return self._route_made(
                ext.route(h.value, T, p, expert_alignment, st, self.num_local_experts), T)
        if max_recv:
            new = lambda shape: self._ht_new(like, shape, _I32)  # noqa: E731
            nout, eout = new((1,)), new((self.num_local_experts,))
        rin = _lib.RouteIn(self._RIN_SIZE, T, p, expert_alignment, st, max_recv,
                           self._ptr(nout), self._ptr(eout))
        r = C.c_void_p()
        self._check(_lib_handle().ferry_route_create(h, C.byref(rin), C.byref(r)))
        return Route(self, r, T, (nout, eout) if max_recv else None)

    def _route_made(self, r, T):
        """The Route of an exact route from ferry._torchext's route (or
        route_dispatch): r = (status, address, num_recv, counts as a
        bytearray of int32, ...), or (status,) when no route was made
        (raised). The route is the context's (Route.__init__) before a
        failure of its counts is raised."""
        if len(r) == 1:
            self._check(r[0])
        route = Route(self, C.c_void_p(r[1]), T, made=(r[2], r[3]))
        if r[0]:
            raise FerryError(r[0], "ferry_route_counts failed")
        return route

    def _ext(self, like):
        """ferry._torchext for an HT call whose tensors are torch ones on
        this context's device (like: one of them), else None."""
        return _torchext() if self._torch_io(like) else None

    def _torch_io(self, like):
        """An HT call's outputs are torch tensors on `like`'s device: on CUDA
        contexts always, on CPU ones when the inputs are torch tensors."""
        return self.device == "cuda" or _torch_like(like)

    def _ht_new(self, like, shape, dtype):
        """An output of an HT call: a torch tensor (_torch_io), else numpy
        (dtype: numpy name, torch name)."""
        if self._torch_io(like):
            import torch
            return torch.empty(shape, dtype=getattr(torch, dtype[1]), device=like.device)
        import numpy as np
        return np.zeros(shape, getattr(np, dtype[0]))

    def _given(self, like):
        """A valid device pointer standing for an empty input that was
        given (never read: it has no rows)."""
        g = self._keep.get("given")
        if g is None:
            import torch
            g = self._keep["given"] = torch.zeros(16, dtype=torch.uint8, device=like.device)
        return g.data_ptr()

    @staticmethod
    def _ptr(a):
        if a is None:
            return None
        return a.data_ptr() if hasattr(a, "data_ptr") else a.__array_interface__["data"][0]

    _HT_OUTS = ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights",
                "recv_src_rank", "recv_src_token")
    _HT_OUT_SET = frozenset(_HT_OUTS)

    def ht_dispatch(self, route, x, x_scales=None, topk_weights=None, stream=None,
                    outputs=None, topk_idx_dtype="int32"):
        """Collective (mode='ht'): this rank's tokens x [T, H] (bf16; fp8 as
        uint8 or float8_e4m3fn with x_scales [T, H/128] float32, any
        strides of at least 1, e.g. column-major, read in place) to the
        ranks of their experts. Returns a dict: recv_x [num_recv, H] (x's
        dtype), recv_x_scales (fp8), recv_topk_idx [num_recv, K] int32
        (local expert or -1), recv_topk_weights (when topk_weights [T, K]
        float32 is given), recv_src_rank, recv_src_token [num_recv] int32:
        numpy arrays on CPU contexts, torch tensors on CUDA ones (queued on
        `stream`, default x's current stream; no synchronisation). Rows are
        ordered by source rank, then token. outputs: the names of the
        optional ones to make (recv_topk_idx, recv_topk_weights,
        recv_src_rank, recv_src_token; default all); the others are None
        and never written (recv_x and its scales are always made).
        topk_idx_dtype="int64" makes recv_topk_idx int64 (DeepEP's dtype),
        written so by the library (no widening pass after it)."""
        if outputs is not None and not self._HT_OUT_SET.issuperset(outputs):
            bad = set(outputs) - self._HT_OUT_SET
            raise ValueError(f"outputs: unknown {sorted(bad)} (from {self._HT_OUTS[2:]})")
        if topk_idx_dtype not in ("int32", "int64"):
            raise ValueError(f"topk_idx_dtype: {topk_idx_dtype!r}: expected 'int32' or 'int64'")
        want = (lambda k: True) if outputs is None else outputs.__contains__
        h, rh = self._ep(), route._handle(self)
        T, n, H, K = route.num_tokens, route.num_recv, self.hidden, self.topk
        fp8 = x_scales is not None
        xinf = _info(x, "x")
        px = self._arr(x, "x", _FP8 if fp8 else _BF16, (T, H), required=T > 0, inf=xinf)
        sinf = _info(x_scales, "x_scales") if fp8 else None
        ps = self._arr(x_scales, "x_scales", _F32, (T, H // 128), required=False,
                       inf=sinf, strided=True)
        # strided scales (DeepEP's column-major ones) go as they are
        sst = (0, 0) if ps is None or sinf.contig else _elem_strides(x_scales)
        if sst != (0, 0) and _lib_version() < (0, 1, 1):
            # a library before x_scales_stride reads the scales row-major
            if hasattr(x_scales, "contiguous"):
                x_scales = x_scales.contiguous()
            elif type(x_scales).__module__ == "numpy":
                x_scales = sys.modules["numpy"].ascontiguousarray(x_scales)
            else:
                raise ValueError(f"x_scales: a strided array needs libferry 0.1.1 or newer "
                                 f"(loaded: {version()})")
            ps, sst = self._arr(x_scales, "x_scales", _F32, (T, H // 128)), (0, 0)
        pw = self._arr(topk_weights, "topk_weights", _F32, (T, K), required=False)
        tio = self._torch_io(x)
        if tio:
            # an empty tensor (no tokens on this rank) has no storage: "given
            # but empty" must still reach the library as given (fp8 rows,
            # weights riding along), as every rank must say the same
            ps = ps or (self._given(x) if x_scales is not None else None)
            pw = pw or (self._given(x) if topk_weights is not None else None)
        xdt = (_FP8[0], xinf.dtype) if fp8 else _BF16
        if tio and xdt[1] not in ("float8_e4m3fn", "bfloat16"):
            xdt = ("uint8", "uint8") if fp8 else ("uint16", "uint16")
        if tio:  # torch.empty on x's device, its dtype looked up once
            import torch
            xdt = getattr(torch, xdt[1])
        # int64 ids written by the library (0.1.2 on), else widened after it
        i64 = topk_idx_dtype == "int64" and _lib_version() >= (0, 1, 2)
        st = _stream_of(x, stream) if self.device == "cuda" else None
        o = self._ht_dispatch_run(h, rh, n, x, px, ps, sst, pw, st, xdt, fp8, i64,
                                  (want("recv_topk_idx"),
                                   topk_weights is not None and want("recv_topk_weights"),
                                   want("recv_src_rank"), want("recv_src_token")))
        o = dict(zip(self._HT_OUTS, o))
        if topk_idx_dtype == "int64" and not i64 and o["recv_topk_idx"] is not None:
            ri = o["recv_topk_idx"]
            o["recv_topk_idx"] = ri.long() if hasattr(ri, "long") else ri.astype("int64")
        return o

    _DIN_SIZE = C.sizeof(_lib.HtDispatchIn)
    _DOUT_SIZE = C.sizeof(_lib.HtDispatchOut)

    def _ht_dispatch_run(self, h, rh, n, like, px, ps, sst, pw, st, xdt, fp8, i64, want):
        """ht_dispatch once its inputs are checked (the pointers of x, its
        scales (element strides sst, (0, 0): row-major) and the weights;
        h, rh: the context's and the route's handles). Makes the outputs
        on like's device (xdt: recv_x's torch dtype, or the (numpy, torch)
        names for _ht_new) and calls the library. want: (recv_topk_idx
        (int64 when i64), recv_topk_weights, recv_src_rank,
        recv_src_token). Returns the outputs in _HT_OUTS' order."""
        H, K = self.hidden, self.topk
        ext = self._ext(like)
        if ext is not None:  # the outputs made in C++ (xdt: a torch dtype here)
            o = ext.ht_dispatch(h.value, rh.value, n, like, xdt, px, ps, sst[0], sst[1], pw, st,
                                fp8 | want[0] << 1 | (i64 and want[0]) << 2 | want[1] << 3 |
                                want[2] << 4 | want[3] << 5, K, H)
            self._check(o[0])
            return o[1:]
        if self._torch_io(like):
            import torch
            dev = like.device
            e = torch.empty
            rx = e((n, H), dtype=xdt, device=dev)
            rs = e((n, H // 128), dtype=torch.float32, device=dev) if fp8 else None
            ri = e((n, K), dtype=torch.int64 if i64 else torch.int32, device=dev) \
                if want[0] else None
            rw = e((n, K), dtype=torch.float32, device=dev) if want[1] else None
            rr = e((n,), dtype=torch.int32, device=dev) if want[2] else None
            rt = e((n,), dtype=torch.int32, device=dev) if want[3] else None
            p = (rx.data_ptr(), rs.data_ptr() if fp8 else None,
                 ri.data_ptr() if want[0] else None, rw.data_ptr() if want[1] else None,
                 rr.data_ptr() if want[2] else None, rt.data_ptr() if want[3] else None)
        else:
            new = lambda shape, dt: self._ht_new(like, shape, dt)  # noqa: E731
            rx = new((n, H), xdt)
            rs = new((n, H // 128), _F32) if fp8 else None
            ri = new((n, K), _I64 if i64 else _I32) if want[0] else None
            rw = new((n, K), _F32) if want[1] else None
            rr = new((n,), _I32) if want[2] else None
            rt = new((n,), _I32) if want[3] else None
            p = tuple(self._ptr(a) for a in (rx, rs, ri, rw, rr, rt))
        din = _lib.HtDispatchIn(self._DIN_SIZE, px, ps, pw, st, (C.c_int64 * 2)(*sst))
        # the int64 ids go in their own slot (the last), int32 ones in recv_topk_idx
        dout = _lib.HtDispatchOut(self._DOUT_SIZE, p[0], p[1], None if i64 else p[2], p[3],
                                  p[4], p[5], p[2] if i64 else None)
        self._check(_lib_handle().ferry_ht_dispatch(h, rh, C.byref(din), C.byref(dout)))
        return rx, rs, ri, rw, rr, rt

    def ht_combine(self, route, y, topk_weights=None, stream=None, weights_sum=False,
                   bias=None, sum_order="ranks"):
        """Collective (mode='ht'): y [num_recv, H] bf16, one row per row this
        rank received, back to the tokens' ranks and summed there. Returns
        out [T, H] bf16 (uint16 on CPU), and with topk_weights [num_recv, K]
        float32 also the [T, K] weights gathered from the experts' ranks
        (slot k from the rank of expert k, the adjoint of ht_dispatch's
        recv_topk_weights; weights_sum=True: slot k summed over every rank
        the token went to, DeepEP's combined_topk_weights); torch tensors
        on CUDA contexts, queued on `stream`. bias: one or two [T, H] bf16
        added to out in fp32 after the rows, before its one rounding
        (DeepEP's combine bias). sum_order="slots": the biases first, then
        the rows in the order of the highest top-k slot each rank holds for
        the token (DeepEP 2's order; "ranks", the default: ascending rank
        order, biases last)."""
        h, rh = self._ep(), route._handle(self)
        T, n, H, K = route.num_tokens, route.num_recv, self.hidden, self.topk
        orders = {"ranks": 0, "slots": 1}
        if sum_order not in orders:
            raise ValueError(f"sum_order: {sum_order!r}, expected 'ranks' or 'slots'")
        bias = () if bias is None else (tuple(bias) if isinstance(bias, (tuple, list))
                                       else (bias,))
        if len(bias) > 2:
            raise ValueError(f"bias: {len(bias)} tensors, at most 2")
        pb = [self._arr(b, f"bias[{i}]", _BF16, (T, H), required=T > 0)
              for i, b in enumerate(bias)] + [None] * (2 - len(bias))
        py = self._arr(y, "y", _BF16, (n, H), required=n > 0)
        pw = self._arr(topk_weights, "topk_weights", _F32, (n, K), required=False)
        if self._torch_io(y) and topk_weights is not None:
            pw = pw or self._given(y)
        st = _stream_of(y, stream) if self.device == "cuda" else None
        out, wout = self._ht_combine_run(h, rh, T, y, py, pw, topk_weights is not None, st,
                                         weights_sum, pb, orders[sum_order])
        return (out, wout) if topk_weights is not None else out

    _CIN_SIZE = C.sizeof(_lib.HtCombineIn)
    _COUT_SIZE = C.sizeof(_lib.HtCombineOut)

    def _ht_combine_run(self, h, rh, T, like, py, pw, want_w, st, weights_sum, pb, order):
        """ht_combine once its inputs are checked (pointers; pb the two bias
        pointers): makes out [T, H] (and with want_w the [T, K] weights) on
        like's device and calls the library."""
        H, K = self.hidden, self.topk
        ext = self._ext(like)
        if ext is not None:  # the outputs made in C++
            o = ext.ht_combine(h.value, rh.value, T, K, like, py, pw, want_w, st,
                               int(bool(weights_sum)),
                               pb[0], pb[1], order, H)
            self._check(o[0])
            return o[1], o[2]
        if self._torch_io(like):
            import torch
            dev = like.device
            out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
            wout = torch.empty((T, K), dtype=torch.float32, device=dev) if want_w else None
            po, pwo = out.data_ptr(), None if wout is None else wout.data_ptr()
        else:
            out = self._ht_new(like, (T, H), ("uint16", "uint16"))
            wout = self._ht_new(like, (T, K), _F32) if want_w else None
            po, pwo = self._ptr(out), self._ptr(wout)
        cin = _lib.HtCombineIn(self._CIN_SIZE, py, pw, st, int(bool(weights_sum)),
                               (C.c_void_p * 2)(*pb), order)
        cout = _lib.HtCombineOut(self._COUT_SIZE, po, pwo)
        self._check(_lib_handle().ferry_ht_combine(h, rh, C.byref(cin), C.byref(cout)))
        return out, wout

    def sync(self, stream=None):
        """Wait for the stream (CUDA) and raise what the GPU reported."""
        self._check(_lib_handle().ferry_ep_sync(self._ep(), stream))

    def mask_rank(self, rank, masked=True, stream=None):
        """Low latency: treat `rank` as gone (masked=True) or back
        (False) from the next round on: this rank sends it nothing, waits
        for nothing from it, and top-k slots whose expert lives there count
        as -1. Every surviving rank masks the same ranks before the same
        round. Only between rounds; clearing a mask after a round ran with
        it raises (FerryError, FERRY_ERR_STATE: create a new context). CUDA:
        written on `stream` (default: the current stream), capturable."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank: expected an int, got {type(rank).__name__}")
        rank = _lib.c_int(rank, "rank")
        st = self._mask_stream(stream)
        self._check(_lib_handle().ferry_ep_mask_rank(self._ep(), rank, int(bool(masked)), st))

    def mask_query(self, out=None, stream=None):
        """The mask: int32 [num_ranks], 1 where masked. CUDA contexts: a
        torch tensor on the context's GPU (or `out`, int32 [num_ranks] there),
        written on `stream`; CPU: a numpy array (or `out`)."""
        N = self.num_ranks
        if out is None:
            if self.device == "cuda":
                import torch
                out = torch.empty(N, dtype=torch.int32,
                                  device=torch.device("cuda", self._cuda_index))
            else:
                import numpy as np
                out = np.zeros(N, np.int32)
        p = self._arr(out, "out", _I32, (N,), output=True)
        st = self._mask_stream(stream)
        self._check(_lib_handle().ferry_ep_mask_query(self._ep(), p, st))
        return out

    def _mask_stream(self, stream):
        if self.device != "cuda":
            return None
        if stream is not None:
            return _stream_of(None, stream)
        import torch
        return torch.cuda.current_stream(torch.device("cuda", self._cuda_index)).cuda_stream

    def close(self):
        """Collective. Closes the Comm too when its close() was deferred."""
        if self._h:
            # a route does not outlive its context: the live ones are
            # marked closed, and every route still owned is destroyed first
            for r in list(self._routes):
                r._h = C.c_void_p()
            self._routes = weakref.WeakSet()
            self._dead.clear()
            for a in self._route_hs:
                _lib_handle().ferry_route_destroy(C.c_void_p(a))
            self._route_hs.clear()
            h, self._h = self._h, C.c_void_p()
            self._keep.clear()
            self._rounds.clear()
            try:
                rc = _lib_handle().ferry_ep_destroy(h)
            finally:
                self.comm._ep_closed()
            if rc:
                raise FerryError(rc, "ferry_ep_destroy failed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Route:
    """A high-throughput route (EP.route()): num_tokens, num_recv and
    expert_counts (rows per local expert, padded to the alignment asked
    for); a bounded route also num_recv_real (num_recv is then its bound).
    close() frees it (not collective); one dropped without close() is
    freed by the next call on its context."""

    def __init__(self, ep, h, T, bounded=None, made=None):
        import numpy as np
        self.ep, self._h, self.num_tokens = ep, h, T
        if h:  # the context's from now on (even if this raises): owned, and
            ep._route_hs.add(h.value)  # among its live routes
            ep._routes.add(self)
        if made is not None:  # (num_recv, counts as int32 bytes), read already
            self.num_recv_real = None
            self.num_recv = made[0]
            self.expert_counts = np.frombuffer(made[1], np.int32)  # a bytearray: writable
            return
        n = C.c_int()
        if bounded is not None:  # the counts are in the outputs the route wrote
            rc = _lib_handle().ferry_route_counts(h, C.byref(n), None)
            self.num_recv_real, self.expert_counts = bounded
        else:
            self.num_recv_real = None
            # read into a ctypes array (numpy's .ctypes costs more than the call)
            at = ep.__dict__.get("_counts_t")  # the array type, made once per EP
            if at is None:
                at = ep._counts_t = C.c_int32 * ep.num_local_experts
            counts = at()
            rc = _lib_handle().ferry_route_counts(h, C.byref(n), counts)
            self.expert_counts = np.frombuffer(counts, np.int32)
        if rc:
            raise FerryError(rc, "ferry_route_counts failed")
        self.num_recv = n.value

    def _handle(self, ep):
        if not self._h:
            raise ValueError("route: closed")
        if ep is not self.ep:
            raise ValueError("route: made on another EP")
        return self._h

    def close(self):
        if self._h:
            h, self._h = self._h, C.c_void_p()
            self.ep._route_free(h.value)

    def __del__(self):
        # a route nobody holds any more (a dropped handle's, DeepEP 2's
        # EPHandle's) is freed by the next call on its context, in that
        # call's thread (never here: a collector may run this in another
        # thread, or after the context was destroyed), its tables then
        # going to later routes (on CUDA after its calls on the stream)
        h = self.__dict__.get("_h")
        if h:
            self._h = C.c_void_p()
            try:
                self.ep._dead.append(h.value)
            except Exception:  # noqa: BLE001 (interpreter shutdown)
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
