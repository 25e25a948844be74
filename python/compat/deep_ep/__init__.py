"""The module `deep_ep` on ferry: DeepEP v1.2.1's public names (Buffer,
Config, EventOverlap, and topk_idx_t of later versions), backed by
ferry.deep_ep, for engines that import `deep_ep` (vLLM's deepep_* all2all
backends, SGLang's --moe-a2a-backend deepep).

Installed by the package ferry-deep-ep (pip install ./python
./python/compat) as ferry_deep_ep/deep_ep, which its import hook gives as
`deep_ep`: no file named deep_ep/ is installed, so a real DeepEP beside it
is never overwritten, and with both present `import deep_ep` asks for a
choice (FERRY_DEEP_EP=ferry or deepep). The package ferry alone never
provides `deep_ep`. See docs/python.md for what each call does on ferry.
"""
import torch  # noqa: F401  (DeepEP's package imports torch first too)

from ferry.deep_ep import Buffer, Config, ElasticBuffer, EPHandle, EventOverlap, topk_idx_t

# the library and what it needs (libfabric) are loaded now, so that
# `import deep_ep` fails, naming what is missing, where the first call
# would (engines probe for DeepEP by importing it)
try:
    import ferry as _ferry
    _ferry._lib_handle()
except OSError as _e:
    raise ImportError(f"deep_ep on ferry cannot load libferry: {_e}") from None

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventOverlap", "topk_idx_t"]

#: the version of DeepEP's Python API this module follows
__version__ = "1.2.1"

#: what this `deep_ep` runs on (a real DeepEP has no such attribute)
backend = "ferry"
