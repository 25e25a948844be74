"""deep_ep.utils on ferry: the names engines import from it (DeepEP's
module also re-exports Config)."""
from ferry.deep_ep import Config, EventOverlap

__all__ = ["Config", "EventOverlap"]
