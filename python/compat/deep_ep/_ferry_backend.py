"""Marks this deep_ep as ferry's (ferry_deep_ep._hook tells it from a real
DeepEP by this file)."""
