"""bench/launch_count.py: the CPU count of what a step launches (Triton launches under the interpreter, aten ops that
are kernels on a GPU), and the counts of the engine's steps it reports."""
from __future__ import annotations

import argparse
import collections

import pytest
import torch

from ssmspec.bench import launch_count as lc
from ssmspec.ops.dispatch import interpret_mode

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="counts Triton launches under the CPU interpreter")


def test_counter_counts_kernels_and_host_reads_not_views_allocations_or_interpreter_work():
    from ssmspec.ops.norm import add_rms_norm

    x, w = torch.randn(4, 8), torch.ones(8)
    with lc.LaunchCounter() as c:
        x.view(32).reshape(4, 8).t()  # views: nothing
        torch.empty(3)  # an allocation: nothing
        x.dtype.is_floating_point, torch.promote_types(x.dtype, torch.float16)  # no tensor out: nothing
        y = x + 1  # a kernel
        y.add_(x)  # a kernel
        y.sum().item()  # a kernel and a host read
        add_rms_norm(x, None, w, eps=1e-6, backend="triton")  # one launch; the interpreter's own host copies: nothing
    assert c.kernels == collections.Counter({"aten:add.Tensor": 1, "aten:add_.Tensor": 1, "aten:sum.default": 1,
                                             "triton:_add_rms_norm_kernel": 1})
    assert c.total() == 4 and c.host_reads == 1
    with lc.LaunchCounter() as after:  # the interpreter's hook is put back on exit
        pass
    add_rms_norm(x, None, w, eps=1e-6, backend="triton")
    assert after.total() == 0


def _args(**kw) -> argparse.Namespace:
    base = dict(run="tiny", family="mamba2", strategy=["replay"], drafter=["draft_model"], S=[2], batch=1,
                prompt_len=16, R=32, vocab=1024, width=0)
    return argparse.Namespace(**{**base, **kw})


def test_a_step_of_the_tiny_pair_launches_six_kernels_a_mamba2_layer_and_the_draft_its_own(monkeypatch):
    """conf/train/tiny.yaml's Mamba-2 target has 2 layers: an autoregressive step is add + RMSNorm, in_proj, conv
    update, SSM update, gated norm and out_proj a layer, then the final norm, the LM head, the embedding, the
    argmax, the report's zeroing and the emit (on the GPU, ``kernels_per_step`` counts one more). The
    replay verify has the same six a layer (its fused verify in place of the SSM update); drafting is the draft
    model's calls. No step reads a device value on the host (a captured step could not)."""
    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "triton")
    monkeypatch.delenv("SSMSPEC_DECODE_FUSION", raising=False)
    ar, spec = lc.lines(_args())
    assert (ar["line"], ar["kernels"], ar["draft"], ar["host_reads"]) == ("autoregressive", 6 * 2 + 6, 0, 0)
    assert ar["target_kernels"]["triton:_ssm_update_kernel"] == 2
    assert spec["line"] == "replay + draft_model" and spec["host_reads"] == 0
    assert spec["target_kernels"]["triton:_fused_kernel"] == 2 and "triton:_ssm_update_kernel" not in spec[
        "target_kernels"]
    assert spec["draft"] == sum(spec["draft_kernels"].values()) > 0
    assert spec["kernels"] == spec["draft"] + spec["target"] > ar["kernels"]


def test_cli_prints_a_line_a_step_and_refuses_an_unknown_family(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SSMSPEC_OPS_BACKEND", "triton")
    out = tmp_path / "counts.json"
    assert lc.main(["--run", "tiny", "--width", "0", "--S", "2", "--top", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("autoregressive") and "replay + draft_model" in printed
    assert out.read_text().count('"line"') == 2
    assert lc.main(["--run", "tiny", "--family", "nemotron_h"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: conf/train/tiny.yaml has no family 'nemotron_h'") and "\n" not in err
