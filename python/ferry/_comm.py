"""Comm: the communicator, from the environment, a torch.distributed group,
an mpi4py communicator or a caller's allgather."""
import ctypes as C

from . import _lib
from ._core import FerryError, _lib_handle

def _group_info(group):
    """(rank, size, backend name) of a torch.distributed group (None: the
    default group). A group made outside torch's registry (vLLM's
    stateless groups, which its elastic EP passes as the EP group) has no
    entry there, so dist.get_rank(group) and dist.get_backend(group) fail
    on it: such a group answers through its own methods."""
    import torch.distributed as dist
    if group is None:
        return dist.get_rank(), dist.get_world_size(), dist.get_backend()
    try:
        return dist.get_rank(group), dist.get_world_size(group), dist.get_backend(group)
    except (ValueError, RuntimeError):
        pass
    try:
        rank, size = group.rank(), group.size()
    except (AttributeError, TypeError, RuntimeError) as e:
        raise TypeError(f"group: expected a torch.distributed process group, got "
                        f"{type(group).__name__} ({e})") from None
    backend = None
    for name in ("_get_backend_name", "name"):
        f = getattr(group, name, None)
        if callable(f):
            try:
                backend = str(f()).lower()
                break
            except (RuntimeError, TypeError):
                continue
    if backend is None:
        raise TypeError(f"group: a {type(group).__name__} outside torch.distributed's registry "
                        f"that names no backend (_get_backend_name)")
    return rank, size, backend


def _is_mpi_comm(obj):
    """An mpi4py communicator (duck-typed: mpi4py is imported only then)."""
    return all(hasattr(obj, a) for a in ("Get_rank", "Get_size", "Allgather", "Allreduce"))


class Comm:
    """Who the ranks are. Comm() reads the environment (FERRY_RANK/
    FERRY_WORLD_SIZE/FERRY_ROOT, Open MPI, torchrun, Slurm); Comm(group)
    uses a torch.distributed process group's allgather, or an mpi4py
    communicator's (any one, COMM_WORLD or a split of it).

    close() while EPs on it are open is deferred: the communicator is
    closed by the last of those EPs' close() (each EP holds its Comm).
    From close() on, the Comm cannot be used (rank, size, barrier, new
    EPs raise ValueError); closing twice is harmless."""

    def __init__(self, group=None):
        lib = _lib_handle()
        self._h = C.c_void_p()
        self._closed = False
        self._eps = 0  # open EPs on this communicator
        err = C.create_string_buffer(512)
        self._cb = None
        if group is None:
            rc = lib.ferry_comm_init_env(C.byref(self._h), err, 512)
        elif _is_mpi_comm(group):
            from mpi4py import MPI
            n = group.Get_size()

            def allgather(inp, out, length, ctx):
                try:
                    src = (C.c_char * length).from_address(inp)
                    dst = (C.c_char * (n * length)).from_address(out)
                    group.Allgather([src, MPI.BYTE], [dst, MPI.BYTE])
                    return 0
                except Exception:  # reported by ferry as a bootstrap error
                    return -1

            self._cb = _lib.ALLGATHER_FN(allgather)
            rc = lib.ferry_comm_init_allgather(group.Get_rank(), n, self._cb, None,
                                               C.byref(self._h), err, 512)
        else:
            import torch
            import torch.distributed as dist
            me, n, backend = _group_info(group)
            dev = torch.device("cuda", torch.cuda.current_device()) \
                if backend == "nccl" else torch.device("cpu")

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
            rc = lib.ferry_comm_init_allgather(me, n, self._cb, None,
                                               C.byref(self._h), err, 512)
        if rc != 0:
            raise FerryError(rc, err.value.decode())

    def _handle(self):
        if self._closed or not self._h:
            raise ValueError("comm: the communicator is closed")
        return self._h

    @property
    def rank(self):
        return _lib_handle().ferry_comm_rank(self._handle())

    @property
    def size(self):
        return _lib_handle().ferry_comm_size(self._handle())

    def barrier(self):
        rc = _lib_handle().ferry_comm_barrier(self._handle())
        if rc:
            raise FerryError(rc, _lib_handle().ferry_comm_last_error(self._h).decode())

    def close(self):
        """Collective. Deferred while EPs on this Comm are open (see above)."""
        self._closed = True
        if self._eps == 0:
            self._destroy()

    def _destroy(self):
        if self._h:
            h, self._h = self._h, C.c_void_p()
            _lib_handle().ferry_comm_destroy(h)

    def _ep_closed(self):
        self._eps -= 1
        if self._closed and self._eps == 0:
            self._destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
