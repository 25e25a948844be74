"""Arrays from numpy, torch, CuPy or anything with __array_interface__ /
__cuda_array_interface__: their pointer, dtype, shape, layout and device
(no copies), as the calls check them."""
import sys


class _Arr:
    """What the binding knows of an array-like: pointer, device ("cpu" or
    "cuda", and the CUDA device index when known), dtype name, shape,
    whether it is C-contiguous and writable, and whether it is a torch
    tensor (for the dtype names in messages)."""
    __slots__ = ("ptr", "dev", "index", "dtype", "shape", "contig", "writable", "torch")


_TYPESTR = {"u1": "uint8", "i1": "int8", "u2": "uint16", "i2": "int16", "f2": "float16",
            "u4": "uint32", "i4": "int32", "f4": "float32", "u8": "uint64", "i8": "int64",
            "f8": "float64", "b1": "bool"}
_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "uint16": 2, "int16": 2,
             "float16": 2, "bfloat16": 2, "uint32": 4, "int32": 4, "float32": 4,
             "uint64": 8, "int64": 8, "float64": 8}


_TYPESTR_CACHE = {}


def _typestr(t):
    """An array-interface typestr ("<u2") as a dtype name ("uint16"); byte
    orders other than this machine's (little-endian) keep the typestr."""
    n = _TYPESTR_CACHE.get(t)
    if n is None:
        if isinstance(t, str) and len(t) == 3 and t[0] in "<|=" and t[1:] in _TYPESTR:
            n = _TYPESTR[t[1:]]
        else:
            n = str(t)
        if isinstance(t, str):
            _TYPESTR_CACHE[t] = n
    return n


def _c_contiguous(shape, strides, itemsize):
    if strides is None:
        return True
    if 0 in shape:
        return True
    want = itemsize
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != want:
            return False
        want *= n
    return True


_TORCH_DTYPES = {}


def _torch_dtype_name(dt):
    n = _TORCH_DTYPES.get(dt)
    if n is None:
        n = _TORCH_DTYPES[dt] = str(dt).replace("torch.", "")
    return n


def _torch_like(a):
    """a is a torch tensor (of any device)."""
    return a is not None and type(a).__module__.startswith("torch")


def _elem_strides(a):
    """An array's strides in elements, each at least 1 (a dimension of one
    element: 1), with the data aligned to its elements; else None. Torch
    tensors, numpy arrays and anything with __cuda_array_interface__ or
    __array_interface__ (strides None there: C-contiguous)."""
    if type(a).__module__.startswith("torch") and hasattr(a, "data_ptr"):
        st = tuple(a.stride())
        item = a.element_size()
        ptr = a.data_ptr()
        shape = tuple(a.shape)
    else:
        iface = getattr(a, "__cuda_array_interface__", None) or \
            getattr(a, "__array_interface__", None)
        if not isinstance(iface, dict) or not isinstance(iface.get("data"), tuple):
            return None
        shape = tuple(int(n) for n in iface["shape"])
        item = _ITEMSIZE.get(_typestr(iface.get("typestr")), 1)
        bst = iface.get("strides")
        if bst is None:  # C-contiguous
            bst, run = [], item
            for n in reversed(shape):
                bst.insert(0, run)
                run *= n
        if any(x % item for x in bst):
            return None
        st = tuple(x // item for x in bst)
        ptr = iface["data"][0] or 0
    st = tuple(1 if n == 1 else x for n, x in zip(shape, st))
    if any(x < 1 for x in st) or ptr % item:
        return None
    return st


def _info(a, name):
    """An _Arr for a (no copy), or TypeError naming the argument."""
    r = _Arr()
    r.torch = type(a).__module__.startswith("torch")
    if r.torch and hasattr(a, "data_ptr"):
        r.ptr = a.data_ptr()
        cuda = a.is_cuda
        r.dev = "cuda" if cuda else ("cpu" if a.is_cpu else a.device.type)
        r.index = a.get_device() if cuda else None
        r.dtype = _torch_dtype_name(a.dtype)
        r.shape = a.shape  # a tuple (torch.Size)
        r.contig = a.is_contiguous()
        r.writable = True
        return r
    np = sys.modules.get("numpy")
    if np is not None and type(a) is np.ndarray:  # the common case, fast
        fl = a.flags
        r.ptr = a.__array_interface__["data"][0]
        r.dev = "cpu"
        r.index = None
        r.dtype = _typestr(a.dtype.str)
        r.shape = a.shape
        r.contig = fl.c_contiguous and fl.aligned
        r.writable = fl.writeable
        return r
    cai = getattr(a, "__cuda_array_interface__", None)
    ai = None if cai is not None else getattr(a, "__array_interface__", None)
    iface = cai if cai is not None else ai
    if not isinstance(iface, dict) or not isinstance(iface.get("data"), tuple):
        raise TypeError(f"{name}: expected a numpy/torch/CuPy array, got {type(a).__name__}")
    r.ptr = iface["data"][0] or 0
    r.writable = not iface["data"][1]
    r.dev = "cuda" if cai is not None else "cpu"
    dev = getattr(a, "device", None)
    r.index = getattr(dev, "id", None) if cai is not None else None
    r.dtype = _typestr(iface.get("typestr"))
    r.shape = tuple(int(n) for n in iface["shape"])
    item = _ITEMSIZE.get(r.dtype, 1)
    strides = iface.get("strides")
    r.contig = _c_contiguous(r.shape, strides, item) and r.ptr % item == 0
    return r


_BF16 = ("uint16", "bfloat16")   # numpy name, torch name
_FP8 = ("uint8", "float8_e4m3fn")
_U8 = ("uint8", "uint8")          # NVFP4 codes (two per byte) and scale bytes
_I64 = ("int64", "int64")
_I32 = ("int32", "int32")
_SIG = ("uint32", "uint32", "int32")  # signals: 32-bit, either sign (numpy, torch names first)
_F32 = ("float32", "float32")


def _fmt_shape(shape):
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def _current_cuda_device():
    """The CUDA device the context is created on (the current one), when
    torch or CuPy can say; None otherwise."""
    try:
        if "torch" in sys.modules:
            return sys.modules["torch"].cuda.current_device()
        if "cupy" in sys.modules:
            return sys.modules["cupy"].cuda.runtime.getDevice()
    except Exception:
        pass
    return None


def _stream_of(a, stream):
    if stream is not None:
        return stream if isinstance(stream, int) else getattr(stream, "cuda_stream", stream)
    if a is not None and type(a).__module__.startswith("torch") and a.is_cuda:
        import torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:  # the current stream's handle, without a Stream object
            return raw(a.device.index)
        return torch.cuda.current_stream(a.device).cuda_stream
    return None


# ---------------------------------------------------------------- comm
