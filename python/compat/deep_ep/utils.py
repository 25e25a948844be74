"""deep_ep.utils on ferry: the names engines import from it."""
from ferry.deep_ep import EventOverlap

__all__ = ["EventOverlap"]
