"""The GPU-baseline install (ssmspec.baselines) against files this test builds: no network, no CUDA.

A fake mamba-ssm sdist imports ``selective_scan_cuda`` unconditionally and einops in its Triton modules, as
2.3.x does, and its setup.py fails if anything runs it; fake fla-core and einops wheels sit beside it. The
install runs in a throwaway venv that sees this venv's packages (torch, transformers, ...) but none of its
own, so the project venv never gets mamba_ssm or fla (CPU tests break when they import).
"""
from __future__ import annotations

import base64
import csv
import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from ssmspec import baselines
from ssmspec.baselines import BaselineError

FAKE_VERSION = "0.0.1"
FAKE_SDIST = {
    "setup.py": "raise SystemExit('setup.py must not run: it compiles CUDA')\n",
    "LICENSE": "Apache License 2.0 (fake)\n",
    "csrc/selective_scan/selective_scan.cpp": "// CUDA sources: never packaged\n",
    "mamba_ssm/__init__.py": (f"__version__ = {FAKE_VERSION!r}\n"
                              "import selective_scan_cuda  # unconditional, as in mamba_ssm 2.3.x\n"
                              "from mamba_ssm.ops.triton.selective_state_update import selective_state_update\n"),
    "mamba_ssm/ops/__init__.py": "",
    "mamba_ssm/ops/triton/__init__.py": "",
    "mamba_ssm/ops/triton/selective_state_update.py": "import einops\n\ndef selective_state_update(*a):\n    return 'ssu'\n",
    "mamba_ssm/ops/triton/ssd_combined.py": "import einops\n\ndef mamba_chunk_scan_combined(*a):\n    return 'scan'\n",
    "mamba_ssm/ops/__pycache__/x.cpython-311.pyc": "stale bytecode: never packaged\n",
}


def make_sdist(folder: Path, version: str = FAKE_VERSION, files: dict[str, str] = FAKE_SDIST) -> Path:
    path = folder / f"mamba_ssm-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"mamba_ssm-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def make_wheel(folder: Path, dist: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
    """A minimal valid pure-Python wheel (METADATA, WHEEL, RECORD), written independently of the code tested."""
    name = dist.replace("-", "_")
    info = f"{name}-{version}.dist-info"
    files = {**files, f"{info}/METADATA": "".join([f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
                                                    *(f"Requires-Dist: {r}\n" for r in requires)]),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
                     f"{len(t.encode())}\n" for p, t in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for p, t in {**files, f"{info}/RECORD": record}.items():
            zf.writestr(p, t)
    return path


@pytest.fixture
def carried(tmp_path) -> Path:
    """A folder as `python -m ssmspec.baselines download` fills it, with fakes."""
    folder = tmp_path / "whl"
    folder.mkdir()
    make_sdist(folder)
    make_wheel(folder, "fla-core", "0.0.2", {"fla/__init__.py": "", "fla/ops/__init__.py": "",
                                             "fla/ops/gated_delta_rule/__init__.py": "import einops\n"},
               requires=("einops",))
    make_wheel(folder, "einops", "0.0.3", {"einops/__init__.py": "__version__ = '0.0.3'\n"})
    return folder


# the wheel -----------------------------------------------------------------------------------------------
def test_triton_wheel_holds_the_python_package_and_the_extension_placeholder(tmp_path):
    wheel = baselines.build_triton_wheel(make_sdist(tmp_path), tmp_path)
    assert wheel.name == f"mamba_ssm-{FAKE_VERSION}+triton-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"mamba_ssm-{FAKE_VERSION}+triton.dist-info"
        assert {n for n in names if not n.startswith(info)} == {
            "selective_scan_cuda.py", *(n for n in FAKE_SDIST if n.startswith("mamba_ssm/") and "__pycache__" not in n)}
        meta = zf.read(f"{info}/METADATA").decode()
        assert f"Version: {FAKE_VERSION}+triton" in meta
        assert {line.split(": ")[1] for line in meta.splitlines() if line.startswith("Requires-Dist")} == set(
            baselines.TRITON_ONLY_REQUIRES) and "einops" in baselines.TRITON_ONLY_REQUIRES
        assert zf.read(f"{info}/LICENSE").decode() == FAKE_SDIST["LICENSE"]
        rows = list(csv.reader(io.StringIO(zf.read(f"{info}/RECORD").decode())))
        assert {r[0] for r in rows} == names
        for path, digest, size in rows:
            if digest:  # RECORD lists itself without a hash
                data = zf.read(path)
                want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert (digest, int(size)) == (f"sha256={want}", len(data)), path


def test_an_archive_without_the_package_is_refused(tmp_path):
    sdist = make_sdist(tmp_path, files={"setup.py": "", "README.md": "not mamba"})
    with pytest.raises(BaselineError, match="not a mamba-ssm sdist"):
        baselines.build_triton_wheel(sdist, tmp_path)


def test_a_folder_without_the_sdist_or_with_other_bytes_is_refused(tmp_path):
    with pytest.raises(BaselineError, match="holds no mamba_ssm-.*ssmspec.baselines download"):
        baselines.find_sdist(tmp_path)
    make_sdist(tmp_path, version=baselines.MAMBA_SSM.version)  # right name, not the published bytes
    with pytest.raises(BaselineError, match="sha256 differs"):
        baselines.find_sdist(tmp_path, baselines.MAMBA_SSM.version)


def test_install_refuses_a_machine_without_cuda(monkeypatch, carried):
    monkeypatch.setattr(baselines, "_has_cuda", lambda: False)
    with pytest.raises(BaselineError, match="no CUDA device here.*--force"):
        baselines.install(carried)


def test_the_gdn_extra_pins_the_same_fla_core():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["gdn"] == [f"{baselines.FLA.dist}=={baselines.FLA.version}"]


# the index ---------------------------------------------------------------------------------------------
@pytest.fixture
def index(tmp_path, monkeypatch):
    """A package index on localhost serving a fake sdist; ``index(kind, sha)`` sets what its page says."""
    sdist = make_sdist(tmp_path)
    data = sdist.read_bytes()
    page: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/simple/mamba-ssm/":
                body, kind = page["body"].encode(), page["type"]
            elif self.path == f"/files/{sdist.name}":
                body, kind = data, "application/octet-stream"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple/")

    def serve(kind: str, sha: str | None = None) -> bytes:
        sha = sha or hashlib.sha256(data).hexdigest()
        if kind == "json":  # PEP 691, with an absolute URL
            url = f"http://127.0.0.1:{server.server_port}/files/{sdist.name}"
            page.update(type="application/vnd.pypi.simple.v1+json",
                        body=json.dumps({"files": [{"filename": sdist.name, "url": url, "hashes": {"sha256": sha}}]}))
        else:  # PEP 503 HTML, with a relative URL
            page.update(type="text/html", body=f'<a href="../../files/{sdist.name}#sha256={sha}">{sdist.name}</a>')
        return data

    yield serve
    server.shutdown()


@pytest.mark.parametrize("kind", ["json", "html"])
def test_the_sdist_comes_from_the_index_and_is_checked(index, tmp_path, kind):
    data = index(kind)
    (tmp_path / "dl").mkdir()
    assert baselines.fetch_sdist(tmp_path / "dl", FAKE_VERSION).read_bytes() == data
    index(kind, sha="0" * 64)
    with pytest.raises(BaselineError, match="refusing to install it"):
        baselines.fetch_sdist(tmp_path / "dl", FAKE_VERSION)
    with pytest.raises(BaselineError, match="lists no mamba_ssm-9.9.tar.gz"):
        baselines.fetch_sdist(tmp_path / "dl", "9.9")


def test_no_index_names_the_offline_way(monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: nothing listens
    with pytest.raises(BaselineError, match="--from DIR.*BASELINES_FROM"):
        baselines.fetch_sdist(tmp_path)


# install end to end in a throwaway venv -------------------------------------------------------------------
INSTALL = f"""
import dataclasses, hashlib, sys
from pathlib import Path
import ssmspec.baselines as b
folder = Path(sys.argv[1])  # the fakes stand in for the pinned versions, their sha256 for the published one
b.MAMBA_SSM = dataclasses.replace(b.MAMBA_SSM, version={FAKE_VERSION!r})
b.MAMBA_SSM_SDIST_SHA256 = hashlib.sha256((folder / "mamba_ssm-{FAKE_VERSION}.tar.gz").read_bytes()).hexdigest()
b.FLA = dataclasses.replace(b.FLA, version="0.0.2")
sys.exit(b.main(["install", "--from", str(folder), "--force"]))
"""
PLACEHOLDER = """
import selective_scan_cuda, mamba_ssm
assert mamba_ssm.selective_state_update() == "ssu" and not hasattr(selective_scan_cuda, "fwd")
try:
    selective_scan_cuda.fwd
except AttributeError as e:
    print(e)
"""


@pytest.mark.skipif(any(baselines.installed_version(b) for b in baselines.BASELINES),
                    reason="the baselines are installed here and the throwaway venv would see them "
                           "(tests/gpu_setup_check.sh checks the install on a GPU machine)")
def test_install_from_a_folder_then_check_then_uninstall(tmp_path, carried):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    # this venv's packages (pip, torch, transformers, ssmspec) are visible; what pip installs lands in `site`
    (site / "_parent.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")

    def run(*args, script=None):
        cmd = [py, "-c", script, *args] if script else [py, "-m", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)

    before = run("ssmspec.baselines", "check")
    assert before.returncode == 1 and "mamba_ssm not importable" in before.stdout and "fla not importable" in before.stdout

    done = run(str(carried), script=INSTALL)
    assert done.returncode == 0, done.stderr
    assert f"mamba_ssm-{FAKE_VERSION}+triton-py3-none-any.whl, fla-core==0.0.2" in done.stdout
    assert {p.name for p in site.iterdir()} >= {"mamba_ssm", "fla", "einops", "selective_scan_cuda.py"}
    assert not (site / "csrc").exists() and not (site / "setup.py").exists()

    after = run("ssmspec.baselines", "check")
    assert after.returncode == 0, after.stdout + after.stderr
    lines = after.stdout.split("\n")
    assert lines[0].split()[:3] == ["mamba_ssm", f"{FAKE_VERSION}+triton", "ok"]
    assert lines[1].split()[:3] == ["fla", "0.0.2", "ok"]

    placeholder = run(script=PLACEHOLDER)
    assert placeholder.returncode == 0, placeholder.stderr
    assert "installed without its CUDA extension" in placeholder.stdout

    again = run(str(carried), script=INSTALL)
    assert again.returncode == 0 and "nothing to install" in again.stdout

    gone = run("pip", "uninstall", "-y", "-q", "mamba-ssm")
    assert gone.returncode == 0, gone.stderr
    assert not (site / "selective_scan_cuda.py").exists() and not (site / "mamba_ssm").exists()


# CPU tests beside installed baselines --------------------------------------------------------------------
HOOKED = """
import torch
from ssmspec.baselines import keep_transformers_on_torch_paths
assert "causal_conv1d" in keep_transformers_on_torch_paths()  # (with mamba_ssm and fla where installed)
from transformers import Mamba2Config, Mamba2ForCausalLM
import causal_conv1d  # still importable for everything but transformers' modeling modules
m = Mamba2ForCausalLM(Mamba2Config(vocab_size=50, hidden_size=32, num_heads=4, head_dim=16, state_size=8,
                                   n_groups=1, num_hidden_layers=1, expand=2))
with torch.no_grad():
    print(tuple(m(torch.randint(0, 50, (1, 5))).logits.shape))
"""


def test_transformers_keeps_its_torch_paths_where_a_kernel_package_imports(tmp_path):
    """A causal_conv1d whose kernels raise: transformers would call it for CPU tensors without the hook."""
    fake = tmp_path / "fake" / "causal_conv1d"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("def causal_conv1d_fn(*a, **k):\n    raise RuntimeError('fake kernel called')\n\n"
                                      "causal_conv1d_update = causal_conv1d_fn\n")
    out = subprocess.run([sys.executable, "-c", HOOKED], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "fake")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "(1, 5, 50)"


def test_available_version_names_a_source_tree_on_the_path(tmp_path, monkeypatch):
    """A baseline imported from a source tree (no dist-info) is reported as its __version__ "(source)",
    not "not installed"; a name that neither imports nor is installed stays None."""
    pkg = tmp_path / "fake_baseline_src"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '9.8.7'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    b = baselines.Baseline("fake_baseline_src", "fake-baseline-src-dist", "9.8.7", (), "test")
    assert baselines.installed_version(b) is None
    assert baselines.available_version(b) == "9.8.7 (source)"
    gone = baselines.Baseline("no_such_baseline_pkg", "no-such-baseline-dist", "1", (), "test")
    assert baselines.available_version(gone) is None
