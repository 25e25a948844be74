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
from . import _lib
# the package is split in modules; every name it had stays here
from ._arrays import (_Arr, _BF16, _F32, _FP8, _I32, _I64, _ITEMSIZE, _TORCH_DTYPES,  # noqa: F401
                      _TYPESTR, _TYPESTR_CACHE, _c_contiguous, _current_cuda_device,
                      _elem_strides, _fmt_shape, _info, _stream_of, _torch_dtype_name,
                      _torch_like, _typestr)
from ._comm import Comm, _group_info, _is_mpi_comm  # noqa: F401
from ._core import FerryError, _lib_handle, _lib_version, cuda_available, version  # noqa: F401
from ._ep import EP, Route  # noqa: F401

__all__ = ["FerryError", "Comm", "EP", "Route", "version", "cuda_available"]
