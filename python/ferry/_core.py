"""The library handle, ferry's error and version."""
import ctypes as C
import functools
import os

from . import _lib

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


@functools.lru_cache(maxsize=None)
def _lib_version():
    """The loaded library's version as a tuple of ints."""
    try:
        return tuple(int(p) for p in version().split(".")[:3])
    except ValueError:
        return (0, 0, 0)


def _env_word(name, default, words):
    """The environment's `name` (unset or empty: default), refused with a
    ValueError naming it unless among `words`."""
    v = os.environ.get(name, "") or default
    if v not in words:
        raise ValueError(f"{name}={v}: must be {', '.join(words[:-1])} or {words[-1]}")
    return v


def _env_int(name, default, lo, hi):
    """The environment's `name` as a whole number in lo..hi (unset or
    empty: default), else a ValueError naming it and the range."""
    v = os.environ.get(name, "")
    if not v:
        return default
    try:
        x = int(v, 10)
    except ValueError:
        x = None
    if x is None or not lo <= x <= hi:
        raise ValueError(f"{name}={v}: must be a whole number, {lo}..{hi}")
    return x


_EXT = None
_EXT_ERR = None  # why FERRY_TORCH_EXT=1 cannot be served (raised on every call)
#: libferry's functions ferry._torchext calls, in its init's order
_EXT_FNS = ("ferry_dispatch_layout", "ferry_route_create", "ferry_route_counts",
            "ferry_ht_dispatch", "ferry_ht_combine", "ferry_route_destroy")


#: what this package calls in ferry._torchext (a module built from an
#: older source lacks some: not used then)
_EXT_NEEDS = ("layout", "layout_plain", "route", "route_dispatch", "new_plain", "ht_dispatch",
              "ht_combine", "record", "call_begin", "call_end")


def _torchext():
    """ferry._torchext, initialised with the loaded library's functions, or
    None: the high-throughput calls' outputs made in C++ for torch tensors
    (python/ferry/_torchext.cpp, built by `make pyext`). FERRY_TORCH_EXT=0
    leaves it unused; =1 makes its absence an error (else the Python path
    runs, as it does with a library older than 0.1.2). Called with torch
    imported."""
    global _EXT, _EXT_ERR
    if _EXT is None:
        want = _env_word("FERRY_TORCH_EXT", "auto", ("auto", "0", "1"))  # every call till good
        _EXT = False
        if want != "0":
            try:
                from . import _torchext as m
            except ImportError as e:
                _EXT_ERR = ImportError(f"FERRY_TORCH_EXT=1, but ferry._torchext does not "
                                       f"load ({e}): build it with `make pyext` against "
                                       f"this torch")
                m = None
            stale = [f for f in _EXT_NEEDS if m is not None and not hasattr(m, f)]
            if stale:
                _EXT_ERR = ImportError(f"FERRY_TORCH_EXT=1, but ferry._torchext was built "
                                       f"from an older ferry (no {', '.join(stale)}): "
                                       f"rebuild it with `make pyext`")
                m = None
            if m is not None and _lib_version() < (0, 1, 2):
                _EXT_ERR = ImportError(f"FERRY_TORCH_EXT=1, but the loaded libferry "
                                       f"({version()}) is older than 0.1.2, which "
                                       f"ferry._torchext needs")
                m = None
            if m is not None:
                lib = _lib_handle()
                m.init(*(C.cast(getattr(lib, n), C.c_void_p).value for n in _EXT_FNS))
                _EXT = m
            if want != "1":
                _EXT_ERR = None
    if _EXT_ERR is not None:
        raise _EXT_ERR
    return _EXT or None


def cuda_available():
    buf = C.create_string_buffer(256)
    ok = _lib_handle().ferry_cuda_available(buf, 256)
    return bool(ok), buf.value.decode()


# ---------------------------------------------------------------- arrays
