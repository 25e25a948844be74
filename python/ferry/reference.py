"""The formulas ferry implements, in PyTorch, for tests and baselines.

fp8_block_quant is ferry's dispatch quantisation: per 128 channels,
scale = amax / 448 and q = e4m3(x * (448 / amax)), an all-zero block
getting scale 1 (IEEE divisions, as the C and CUDA code do), so results
compare byte for byte. Non-finite inputs stay local: amax is over the
finite channels, +-Inf saturates to +-448, NaN stays NaN.
"""
import torch


def fp8_block_quant(x, round_scale=False):
    """x [T, H] bf16 -> (q [T, H] float8_e4m3fn, scales [T, H/128] fp32).
    round_scale: scales rounded up to powers of two (at least 2^-126), as
    ferry's fp8_round_scale and DeepEP's round_scale."""
    T, H = x.shape
    xb = x.view(T, H // 128, 128).float()
    fin = torch.isfinite(xb)
    amax = torch.where(fin, xb.abs(), torch.zeros_like(xb)).amax(dim=2, keepdim=True)
    c = torch.full_like(amax, 448.0)  # tensor / tensor: IEEE division
    scale = torch.where(amax > 0, amax / c, torch.ones_like(amax))
    inv = torch.where(amax > 0, c / amax, torch.ones_like(amax))
    if round_scale:
        u = scale.view(torch.int32).clamp(min=0x00800000)
        u = torch.where((u & 0x007FFFFF) != 0, (u & 0x7F800000) + 0x00800000, u)
        scale = u.view(torch.float32)
        inv = torch.ones_like(scale) / scale
    y = xb * inv
    y = torch.where(torch.isinf(y), torch.sign(y) * 448.0, y)  # saturate
    return y.to(torch.float8_e4m3fn).view(T, H), scale.view(T, H // 128)
