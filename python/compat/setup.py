"""ferry-deep-ep's build: the package ferry_deep_ep (its deep_ep module
taken from deep_ep/) and, at the top of site-packages, ferry-deep-ep.pth,
whose one line registers the import hook at interpreter start."""
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def run(self):
        # a build folder left by the layout before (deep_ep/ at the top)
        # must not carry that folder into this wheel
        shutil.rmtree(os.path.join(self.build_lib, "deep_ep"), ignore_errors=True)
        super().run()
        self.copy_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                    "ferry-deep-ep.pth"),
                       os.path.join(self.build_lib, "ferry-deep-ep.pth"))


setup(cmdclass={"build_py": BuildPy})
