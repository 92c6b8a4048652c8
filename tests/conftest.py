"""Loaded before every test module. On a GPU machine `make setup` installs mamba_ssm and fla-core (the GPU
baselines); transformers 5 would then bind their Triton kernels for its CPU models, which the CPU tests use
as the PyTorch reference. From here on, transformers' modeling modules are imported with those packages
hidden, so they keep their PyTorch paths (ssmspec.baselines.keep_transformers_on_torch_paths; a no-op where
none is installed, as on CI).
"""
import os

from ssmspec.gputests import SPREAD_ENV, worker_gpus

# `python -m ssmspec.gputests --spread`: this xdist worker's GPU first, before anything starts CUDA
_GPUS = worker_gpus(os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(SPREAD_ENV, ""))
if _GPUS is not None:
    os.environ["CUDA_VISIBLE_DEVICES"] = _GPUS

import pytest  # noqa: E402
import torch  # noqa: E402

from ssmspec.baselines import keep_transformers_on_torch_paths  # noqa: E402

keep_transformers_on_torch_paths()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors: intra-op threads only oversubscribe the 2 cores that pytest-xdist workers share. A module
    uses it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
