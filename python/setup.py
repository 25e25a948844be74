"""Builds libferry with the repository's Makefile and ships it in the
package (pip install ./python; pip wheel ./python: a platform wheel,
py3-none-linux_*, that scripts/wheel.sh turns into a manylinux one).

libferry is loaded with ctypes, so the wheel does not depend on the
Python version or ABI, only on the platform; libfabric comes from the
system."""
import os
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class BuildWithLib(build_py):
    def run(self):
        lib = os.path.join(ROOT, "build", "libferry.so")
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["make", "-C", ROOT, "-j", jobs, "build/libferry.so"])
        super().run()
        dst = os.path.join(self.build_lib, "ferry")
        os.makedirs(dst, exist_ok=True)
        shutil.copy2(lib, os.path.join(dst, "libferry.so"))


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
      cmdclass={"build_py": BuildWithLib, "bdist_wheel": PlatformWheel})
