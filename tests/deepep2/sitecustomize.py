"""For DeepEP 2's tests with ranks sharing one GPU (a test aid of
tests/deepep2.sh): the shared-gpu shim (SHARED_GPU_SITE names its
sitecustomize.py: set_device to GPU 0, gloo, collectives on CUDA tensors
through host copies), and all_to_all_single the same way, which DeepEP
2's reference dispatch (deep_ep/utils/refs.py) calls on CUDA tensors."""
import os

_site = os.environ.get("SHARED_GPU_SITE")
if _site:
    exec(compile(open(_site).read(), _site, "exec"))
if os.environ.get("SHARED_GPU_SHIM") == "1":
    import torch
    import torch.distributed as dist

    _a2a = dist.all_to_all_single

    def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                           group=None, async_op=False):
        if not (input.is_cuda or output.is_cuda):
            return _a2a(output, input, output_split_sizes, input_split_sizes, group, async_op)
        # gloo's all-to-all on host copies; bf16 and fp8 widened to float32
        # on the way (exact), which gloo takes whatever its version
        dt = torch.float32 if output.dtype.itemsize < 4 and output.dtype.is_floating_point \
            else output.dtype
        out = torch.empty(output.shape, dtype=dt, device="cpu")
        _a2a(out, input.cpu().to(dt), output_split_sizes, input_split_sizes, group)
        output.copy_(out)
        return None
    dist.all_to_all_single = _all_to_all_single
