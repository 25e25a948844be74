"""The import hook of ferry-deep-ep (run at interpreter start by the line
in ferry-deep-ep.pth; it only registers a finder, nothing is imported or
scanned until `import deep_ep`).

`import deep_ep` then gives ferry's module (ferry_deep_ep/deep_ep/) when
no other deep_ep is installed. Where another one is (a real DeepEP), it
raises ImportError naming both, unless FERRY_DEEP_EP chooses:
  FERRY_DEEP_EP=ferry    ferry's deep_ep (the other stays installed, unused)
  FERRY_DEEP_EP=deepep   the other one (ferry's hook steps aside)
"""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deep_ep")


def _is_ferry(spec):
    """Is this deep_ep ferry's own (this package's, or the source tree's
    python/compat/deep_ep), marked by _ferry_backend.py?"""
    locs = getattr(spec, "submodule_search_locations", None) or []
    return any(os.path.exists(os.path.join(d, "_ferry_backend.py")) for d in locs)


class FerryDeepEpFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "deep_ep":
            return None
        choice = os.environ.get("FERRY_DEEP_EP", "").strip().lower()
        if choice not in ("", "ferry", "deepep"):
            raise ImportError(f"FERRY_DEEP_EP={choice}: use 'ferry' or 'deepep'", name=name)
        if choice == "deepep":
            return None  # the other finders look for it
        other = importlib.machinery.PathFinder.find_spec(name, path)
        if other is not None and _is_ferry(other):
            return other  # ferry's own, from a source tree on sys.path
        if other is not None and choice != "ferry":
            where = other.origin or (list(other.submodule_search_locations or []) or ["?"])[0]
            raise ImportError(
                f"two deep_ep modules are installed: DeepEP's at {where} and ferry's "
                f"(the package ferry-deep-ep, {_HERE}); set FERRY_DEEP_EP=ferry to run "
                f"DeepEP's API on ferry, or FERRY_DEEP_EP=deepep for the other one "
                f"(pip uninstall ferry-deep-ep removes ferry's and leaves the other as it "
                f"was)", name=name)
        return importlib.util.spec_from_file_location(
            name, os.path.join(_HERE, "__init__.py"), submodule_search_locations=[_HERE])


def install():
    if not any(isinstance(f, FerryDeepEpFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, FerryDeepEpFinder())


install()
