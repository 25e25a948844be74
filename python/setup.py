"""Builds libferry with the repository's Makefile and ships it in the
package (pip install ./python; pip wheel ./python: a platform wheel,
py3-none-linux_*, that scripts/wheel.sh turns into a manylinux one).

The sdist carries the C and CUDA sources it needs (native/: Makefile,
include/, src/, scripts/libferry.map), so `pip install ferry_ep-*.tar.gz`
builds libferry from the sdist itself; from a checkout the repository's
own tree is used. FERRY_CUDA=0 builds without the CUDA kernels (they are
built when nvcc is found; about 5 minutes on 2 cores), FERRY_CUDA=1
requires them.

libferry is loaded with ctypes, so the wheel does not depend on the
Python version or ABI, only on the platform; libfabric comes from the
system."""
import os
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
# what libferry.so is built from, relative to the tree that holds it
NATIVE = ["Makefile", "include", "src", os.path.join("scripts", "libferry.map")]


def native_root():
    """The sdist's own sources (native/), else the repository's tree."""
    own = os.path.join(HERE, "native")
    if os.path.exists(os.path.join(own, "Makefile")):
        return own
    root = os.path.dirname(HERE)
    if not os.path.exists(os.path.join(root, "Makefile")):
        raise SystemExit("ferry-ep: no native sources: neither native/ (an sdist) nor "
                         "../Makefile (a checkout) is here")
    return root


class BuildWithLib(build_py):
    def run(self):
        root = native_root()
        lib = os.path.join(root, "build", "libferry.so")
        jobs = str(os.cpu_count() or 2)
        cmd = ["make", "-C", root, "-j", jobs, "build/libferry.so"]
        cuda = os.environ.get("FERRY_CUDA", "")
        if cuda not in ("", "0", "1"):
            raise SystemExit(f"FERRY_CUDA={cuda!r}: use 0 (no CUDA kernels) or 1")
        if cuda:
            cmd.append("CUDA=" + cuda)
        subprocess.check_call(cmd)
        super().run()
        dst = os.path.join(self.build_lib, "ferry")
        os.makedirs(dst, exist_ok=True)
        shutil.copy2(lib, os.path.join(dst, "libferry.so"))


class SdistWithSources(sdist):
    """The sdist carries libferry's sources under native/."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        root = native_root()
        lic = os.path.join(os.path.dirname(root) if root.endswith("native") else root, "LICENSE")
        if os.path.exists(lic):
            shutil.copy2(lic, os.path.join(base_dir, "LICENSE"))
        for rel in NATIVE:
            src, dst = os.path.join(root, rel), os.path.join(base_dir, "native", rel)
            if os.path.isdir(src):
                shutil.copytree(src, dst, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.o", "*.d", "__pycache__"))
            else:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copy2(src, dst)


class NativeDistribution(Distribution):
    """The package carries a native library (installed as platform code)."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """Tagged for this platform, for any Python 3."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(distclass=NativeDistribution,
      cmdclass={"build_py": BuildWithLib, "bdist_wheel": PlatformWheel,
                "sdist": SdistWithSources})
