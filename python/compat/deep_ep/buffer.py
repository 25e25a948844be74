"""deep_ep.buffer on ferry: DeepEP's module of the Buffer class, for code
that imports it from there (from deep_ep.buffer import Buffer)."""
from ferry.deep_ep import Buffer, Config, EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap"]
