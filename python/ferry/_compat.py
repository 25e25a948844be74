"""Pieces of DeepEP's API that need neither torch nor a GPU (ferry.deep_ep
re-exports them; kept apart so they can be tested anywhere)."""

__all__ = ["Config"]


class _UnsetSms(int):
    """An SM count nobody set: reads as DeepEP's default, 20, to engines
    that compute with it, while ferry's kernels keep ferry's default.
    Arithmetic on it gives plain ints."""


def _int(name, v, lo):
    import operator
    if isinstance(v, bool):
        raise TypeError(f"Config: {name}: expected an int, got bool")
    try:
        v = operator.index(v)  # ints, numpy ints
    except TypeError:
        raise TypeError(f"Config: {name}: expected an int, got {type(v).__name__}") from None
    if v < lo:
        raise ValueError(f"Config: {name} = {v}: must be at least {lo}")
    return v


class Config:
    """DeepEP's Config: the SMs and chunk sizes of its normal
    (high-throughput) mode, with DeepEP's constraints (send chunk smaller
    than the receive buffer; the RDMA receive buffer rounded up to a
    multiple of the send chunk and at least twice it) and DeepEP's defaults
    (20 SMs, 6/256 NVLink and 6/256 RDMA tokens). ferry.deep_ep's normal
    mode (ferry's high-throughput engine) sizes its own rings
    (ring_tokens), so a Config sizes nothing of ferry's: code that builds,
    passes or annotates with it runs, and its buffer size hints give the
    ring memory ferry's normal mode keeps (engines pass them to Buffer(),
    which ignores them)."""

    def __init__(self, num_sms=_UnsetSms(20), num_max_nvl_chunked_send_tokens=6,
                 num_max_nvl_chunked_recv_tokens=256, num_max_rdma_chunked_send_tokens=6,
                 num_max_rdma_chunked_recv_tokens=256):
        # given (SGLang's --deepep-config, set_num_sms before
        # get_dispatch_config): the SMs of the normal-mode context the
        # config is first passed to; unset: ferry's default there
        self.num_sms = num_sms if type(num_sms) is _UnsetSms else _int("num_sms", num_sms, 0)
        ns = _int("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens, 1)
        nr = _int("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens, 1)
        rs = _int("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens, 1)
        rr = _int("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens, 1)
        if ns >= nr:
            raise ValueError(f"Config: num_max_nvl_chunked_send_tokens ({ns}) must be smaller "
                             f"than num_max_nvl_chunked_recv_tokens ({nr})")
        rr = (rr + rs - 1) // rs * rs
        if rs * 2 > rr:
            raise ValueError(f"Config: num_max_rdma_chunked_send_tokens ({rs}) must be at most "
                             f"half of num_max_rdma_chunked_recv_tokens ({rr}, rounded up to a "
                             f"multiple of the send chunk)")
        self.num_max_nvl_chunked_send_tokens = ns
        self.num_max_nvl_chunked_recv_tokens = nr
        self.num_max_rdma_chunked_send_tokens = rs
        self.num_max_rdma_chunked_recv_tokens = rr

    def __repr__(self):
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Bytes of ring memory ferry's normal mode keeps per GPU rank of one
        node for rows of hidden_bytes: a ring per channel (num_sms) and
        peer, both ways, of 512 / num_ranks tokens within 32..128, each
        row with 128 bytes beside it. Informational, as DeepEP's answer is
        for its own Buffer(): ferry's Buffer() takes any size and allocates
        its own rings."""
        hb = _int("hidden_bytes", hidden_bytes, 1)
        n = _int("num_ranks", num_ranks, 1)
        rt = min(128, max(32, 512 // n))
        return max(1, self.num_sms) * 2 * n * rt * (hb + 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        """Bytes of ring memory ferry's normal mode keeps per GPU rank with
        peers on other nodes (the staged engine through host memory: a
        ring per peer, both ways, of 256 tokens); informational, as
        get_nvl_buffer_size_hint."""
        hb = _int("hidden_bytes", hidden_bytes, 1)
        n = _int("num_ranks", num_ranks, 1)
        return 2 * n * 256 * (hb + 128)
