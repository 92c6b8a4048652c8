"""Kernel tests: the Triton path runs under the CPU interpreter when there is no GPU.

``triton.jit`` decides interpreter mode when a kernel is decorated, so TRITON_INTERPRET must be set before
any of ssmspec's Triton modules is imported; the public ops import them lazily, and this conftest runs
before the test modules. On a CUDA machine the real kernels run and ``@pytest.mark.gpu`` tests (large
shapes, the paper's mixer sizes) run too; elsewhere those are skipped.
"""
from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (large shapes, real kernels); skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if CUDA else "cpu"
