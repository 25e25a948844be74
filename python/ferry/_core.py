"""The library handle, ferry's error and version."""
import ctypes as C
import functools

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


def cuda_available():
    buf = C.create_string_buffer(256)
    ok = _lib_handle().ferry_cuda_available(buf, 256)
    return bool(ok), buf.value.decode()


# ---------------------------------------------------------------- arrays
