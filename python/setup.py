"""Builds libferry with the repository's Makefile and ships it in the
package (pip install ./python)."""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

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


setup(cmdclass={"build_py": BuildWithLib})
