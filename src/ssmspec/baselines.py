"""The GPU baselines the kernel experiments compare against, installed without compiling CUDA.

    python -m ssmspec.baselines install [--from DIR] [--force]   what `make setup` runs on a GPU machine
    python -m ssmspec.baselines download DIR                     fill DIR for a machine without network
    python -m ssmspec.baselines check                            what imports here (exit 1: something missing)

mamba_ssm (its Triton ``selective_state_update`` and ``mamba_chunk_scan_combined``) is the baseline of every
Mamba-2 kernel figure; fla-core is the Gated DeltaNet baseline. fla-core is a pure-Python wheel and pip
installs it as it is. mamba-ssm is published as an sdist whose setup.py compiles CUDA extensions (many
minutes, with nvcc), and its 2.3.x package imports one of them, ``selective_scan_cuda``, unconditionally
(``mamba_ssm/ops/selective_scan_interface.py``), so ``MAMBA_SKIP_CUDA_BUILD=TRUE`` yields a package that
cannot be imported. Only the Mamba-1 selective scan calls that extension; the Triton kernels never do.

So ``install`` takes the sdist (from the package index, checked against the sha256 pinned below, or from
``--from DIR``), runs none of its build code, and repackages its pure-Python ``mamba_ssm/`` as a wheel
``mamba_ssm-<version>+triton-py3-none-any.whl`` that also holds a placeholder ``selective_scan_cuda`` module
(an attribute of it raises an error saying what is missing) and declares what the package imports at import
time (``TRITON_ONLY_REQUIRES``). pip installs that wheel and fla-core into the running interpreter's
environment, resolving einops from the index or DIR, and records both: ``pip uninstall mamba-ssm fla-core``
removes them. causal-conv1d is not needed: mamba_ssm imports it inside try/except, and our own conv kernel
(``ops/causal_conv1d``) is what the suite runs. A mamba_ssm or fla-core installed some other way (a full CUDA
build, say) is kept as it is.
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib
import importlib.metadata as metadata
import importlib.util
import io
import json
import logging
import os
import re
import ssl
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ssmspec.baselines")


@dataclass(frozen=True)
class Baseline:
    name: str  # import name; rows skipped for its absence give the reason "<name> not importable: ..."
    dist: str  # distribution name on the package index
    version: str  # the version the reference results were measured against
    modules: tuple[str, ...]  # what the suite imports from it
    used_for: str  # one line for `check`


MAMBA_SSM = Baseline("mamba_ssm", "mamba-ssm", "2.3.2.post1",
                     ("mamba_ssm.ops.triton.selective_state_update", "mamba_ssm.ops.triton.ssd_combined"),
                     "Mamba-2 kernel baselines (kernel_parity, snl_tab1_kernels, replay_fig*)")
FLA = Baseline("fla", "fla-core", "0.6.0", ("fla.ops.gated_delta_rule",), "Gated DeltaNet kernel baselines")
BASELINES = (MAMBA_SSM, FLA)

# sha256 of the pinned sdist as PyPI publishes it: a mirror or a carried folder must hold the same bytes
MAMBA_SSM_SDIST_SHA256 = "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028"
# what ``import mamba_ssm.ops.triton.*`` imports besides the standard library (read from mamba_ssm 2.3.2:
# its __init__ pulls in the modules, models and utils.generation); the sdist's own list adds build tools
# and Mamba-3 packages (tilelang, quack-kernels) that it imports inside try/except or not at all
TRITON_ONLY_REQUIRES = ("torch", "triton", "einops", "transformers", "huggingface-hub", "packaging")
LOCAL_TAG = "triton"  # local version label of the repackaged wheel: 2.3.2.post1+triton says what it lacks
STUB_MODULE = "selective_scan_cuda"
STUB_SOURCE = '''"""Placeholder for mamba_ssm's CUDA extension, written by `python -m ssmspec.baselines install`.

mamba_ssm imports this module unconditionally; only its Mamba-1 selective scan calls it. The Triton kernels
(mamba_ssm.ops.triton.*) do not. For the CUDA path, build mamba-ssm from source
(pip install --no-build-isolation mamba-ssm), which replaces this package.
"""


def __getattr__(name):
    # AttributeError, so that hasattr() answers False instead of raising
    raise AttributeError(f"selective_scan_cuda.{name}: mamba_ssm was installed without its CUDA extension "
                         f"(Triton kernels only, by `python -m ssmspec.baselines install`); build mamba-ssm "
                         f"from source for the Mamba-1 selective scan")
'''


class BaselineError(RuntimeError):
    """Something the user can fix (no network, a folder without the files, no GPU): one message."""


# the mamba-ssm sdist ---------------------------------------------------------------------------------
def sdist_name(version: str = MAMBA_SSM.version) -> str:
    return f"mamba_ssm-{version}.tar.gz"


def _index_url() -> str:
    # the same variable pip reads, so a mirror configured for pip serves this download too
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def _urlopen(url: str, accept: str | None = None):
    ctx = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    return urllib.request.urlopen(req, timeout=60, context=ctx)


def fetch_sdist(dest: Path, version: str = MAMBA_SSM.version) -> Path:
    """Download the mamba-ssm sdist into ``dest`` from the index's simple API (PEP 691 JSON, or the HTML
    page of older mirrors), without running any of its code; the bytes are checked against the pinned
    sha256 (other versions: against the index's hash)."""
    name = sdist_name(version)
    page = f"{_index_url()}/{MAMBA_SSM.dist}/"
    try:
        with _urlopen(page, "application/vnd.pypi.simple.v1+json, text/html;q=0.1") as r:
            body, kind = r.read().decode(), r.headers.get("Content-Type", "")
        if "json" in kind:
            files = {f["filename"]: (f["url"], f.get("hashes", {}).get("sha256")) for f in json.loads(body)["files"]}
        else:
            files = {}
            for href in re.findall(r'href="([^"]+)"', body):  # PEP 503: <a href="url#sha256=...">file</a>
                url, _, frag = href.partition("#")
                files[url.rsplit("/", 1)[-1]] = (url, frag.removeprefix("sha256=") or None)
        if name not in files:
            raise BaselineError(f"{page} lists no {name}; is {version} a mamba-ssm release?")
        url, index_sha = files[name]
        with _urlopen(urllib.parse.urljoin(page, url)) as r:
            data = r.read()
    except OSError as e:  # URLError, timeouts, TLS: all mean no usable index from here
        raise BaselineError(f"cannot download {name} from {page} ({e}); on a machine without network, fill a "
                            f"folder elsewhere with `python -m ssmspec.baselines download DIR`, carry it here and "
                            f"pass --from DIR (make setup BASELINES_FROM=DIR)") from e
    want = MAMBA_SSM_SDIST_SHA256 if version == MAMBA_SSM.version else index_sha
    got = hashlib.sha256(data).hexdigest()
    if want and got != want:
        raise BaselineError(f"{name} from {page} has sha256 {got}, expected {want}; refusing to install it")
    path = Path(dest) / name
    path.write_bytes(data)
    return path


def find_sdist(folder: Path, version: str = MAMBA_SSM.version) -> Path:
    path = Path(folder) / sdist_name(version)
    if not path.is_file():
        raise BaselineError(f"{folder} holds no {path.name}; fill it with `python -m ssmspec.baselines download "
                            f"{folder}` on a machine with network")
    if version == MAMBA_SSM.version and hashlib.sha256(path.read_bytes()).hexdigest() != MAMBA_SSM_SDIST_SHA256:
        raise BaselineError(f"{path} is not the published {path.name} (sha256 differs); download it again")
    return path


# the Triton-only wheel -------------------------------------------------------------------------------
def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_triton_wheel(sdist: Path, out_dir: Path) -> Path:
    """Repackage the sdist's ``mamba_ssm/`` package (no csrc/, no setup.py run) as a pure-Python wheel in
    ``out_dir`` that also holds the ``selective_scan_cuda`` placeholder; returns the wheel's path."""
    m = re.fullmatch(r"mamba_ssm-(.+)\.tar\.gz", Path(sdist).name)
    if not m:
        raise BaselineError(f"{sdist} is not named mamba_ssm-<version>.tar.gz")
    version = f"{m[1]}+{LOCAL_TAG}"
    files: dict[str, bytes] = {}
    license_text = b""
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if not member.isfile() or len(parts) < 2:
                continue
            inner = "/".join(parts[1:])  # drop the top folder mamba_ssm-<version>/
            if inner.startswith("mamba_ssm/") and "__pycache__" not in parts:
                files[inner] = tar.extractfile(member).read()
            elif inner == "LICENSE":
                license_text = tar.extractfile(member).read()
    if "mamba_ssm/__init__.py" not in files:
        raise BaselineError(f"{sdist} holds no mamba_ssm/__init__.py: not a mamba-ssm sdist")
    files[f"{STUB_MODULE}.py"] = STUB_SOURCE.encode()
    info = f"mamba_ssm-{version}.dist-info"
    meta = ["Metadata-Version: 2.1", "Name: mamba_ssm", f"Version: {version}",
            f"Summary: mamba_ssm {m[1]} Triton kernels without its CUDA extensions (repackaged by ssmspec.baselines)",
            "License: Apache-2.0"] + [f"Requires-Dist: {r}" for r in TRITON_ONLY_REQUIRES]
    files[f"{info}/METADATA"] = ("\n".join(meta) + "\n").encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: ssmspec.baselines\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/top_level.txt"] = f"mamba_ssm\n{STUB_MODULE}\n".encode()
    if license_text:
        files[f"{info}/LICENSE"] = license_text
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        writer.writerow([path, _record_hash(data), len(data)])
    writer.writerow([f"{info}/RECORD", "", ""])
    files[f"{info}/RECORD"] = record.getvalue().encode()
    wheel = Path(out_dir) / f"mamba_ssm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


# install / download / check -------------------------------------------------------------------------
def installed_version(b: Baseline) -> str | None:
    try:
        return metadata.version(b.dist)
    except metadata.PackageNotFoundError:
        return None


def available_version(b: Baseline) -> str | None:
    """What a report should name: the installed distribution's version, or for a source tree on
    PYTHONPATH (no dist-info) the imported package's ``__version__`` marked "(source)"; None when it is
    neither installed nor importable."""
    have = installed_version(b)
    if have is not None or importlib.util.find_spec(b.name) is None:
        return have
    try:
        module = importlib.import_module(b.name)
    except Exception:  # noqa: BLE001 - present but broken: check() says why
        return None
    return f"{getattr(module, '__version__', 'unknown')} (source)"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _pip(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    log.info("baselines: %s", " ".join(cmd[1:]))
    if subprocess.call(cmd) != 0:
        raise BaselineError(f"pip failed: {' '.join(cmd[2:])} (its message is above)")


def install(source: Path | None = None, *, force: bool = False) -> list[str]:
    """Install the missing baselines into this interpreter's environment (from the index, or only from the
    folder ``source``); returns the requirements pip was given (empty: nothing was missing)."""
    if not force and not _has_cuda():
        raise BaselineError("no CUDA device here: the baselines are GPU kernels, and on a CPU machine "
                            "transformers would route CPU tensors to them when they import (the CPU tests "
                            "break); pass --force to install them anyway")
    if source is not None and not Path(source).is_dir():
        raise BaselineError(f"--from {source}: no such folder")
    with tempfile.TemporaryDirectory(prefix="ssmspec-baselines-") as tmp:
        wanted = []
        have, ours = installed_version(MAMBA_SSM), f"{MAMBA_SSM.version}+{LOCAL_TAG}"
        if have and not have.endswith(f"+{LOCAL_TAG}"):
            log.info("baselines: keeping mamba-ssm %s (installed some other way)", have)
        elif have != ours:  # none yet, or ours from an older pin
            v = MAMBA_SSM.version
            sdist = find_sdist(Path(source), v) if source is not None else fetch_sdist(Path(tmp), v)
            wanted.append(str(build_triton_wheel(sdist, Path(tmp))))
        have = installed_version(FLA)
        if have:
            log.info("baselines: fla-core %s already installed", have)
        else:
            wanted.append(f"{FLA.dist}=={FLA.version}")
        if wanted:
            where = ["--no-index", "--find-links", str(source)] if source is not None else []
            _pip(["install", "-q", "--no-input", *where, *wanted])
    return wanted


def download(dest: Path) -> list[Path]:
    """Fill ``dest`` with what ``install --from dest`` needs: the mamba-ssm sdist and the fla-core and
    einops wheels (pure Python, so one folder serves any Linux machine)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    paths = [find_sdist(dest) if (dest / sdist_name()).is_file() else fetch_sdist(dest)]  # an old copy is checked
    _pip(["download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest), f"{FLA.dist}=={FLA.version}", "einops"])
    return paths + sorted(dest.glob("*.whl"))


def import_error(b: Baseline) -> str | None:
    """None when every module the suite uses from ``b`` imports, else the reason in the rows' words."""
    for mod in b.modules:
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 -- any failure (missing package, a broken dependency) is "not importable"
            return f"{b.name} not importable: {type(e).__name__}: {e}"
    return None


def check() -> dict[str, str | None]:
    """{baseline name: None if importable, else why not}."""
    return {b.name: import_error(b) for b in BASELINES}


# tests -----------------------------------------------------------------------------------------------
# packages transformers 5 binds in place of its PyTorch code whenever they import, for CPU tensors too
TRANSFORMERS_FALLBACKS = ("mamba_ssm", "fla", "causal_conv1d")
_MODELING = re.compile(r"transformers\.models\.\w+\.modeling_\w+")


class _HiddenWhileLoading:
    """Loader wrapper: runs a module's code with ``hidden`` packages absent from the import system."""

    def __init__(self, loader, hidden: tuple[str, ...]) -> None:
        self.loader, self.hidden = loader, hidden

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in self.hidden}
        sys.modules.update({p: None for p in self.hidden})  # None in sys.modules: `import p` raises ImportError
        try:
            self.loader.exec_module(module)
        finally:
            for p in self.hidden:
                sys.modules.pop(p, None)
            sys.modules.update(saved)


class _TorchPathsFinder:
    """Meta-path finder that hands transformers' modeling modules a loader hiding the baselines."""

    def __init__(self, hidden: tuple[str, ...]) -> None:
        self.hidden = hidden

    def find_spec(self, name, path=None, target=None):
        if not _MODELING.fullmatch(name):
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _HiddenWhileLoading(spec.loader, self.hidden)
        return spec


def keep_transformers_on_torch_paths() -> tuple[str, ...]:
    """Make transformers' modeling modules, when imported from now on, bind their PyTorch paths rather than
    mamba_ssm / fla / causal_conv1d kernels; those packages stay importable for everything else.

    transformers 5 picks the implementation when a modeling module is imported
    (``integrations.hub_kernels.use_kernel_func_from_hub_with_fallback``: the package's kernel if it imports,
    whatever the device), so on a GPU machine with the baselines installed its CPU models would call Triton
    kernels on CPU tensors. The CPU tests compare against those PyTorch paths; tests/conftest.py calls this
    before any test module imports transformers. Returns the packages hidden (none on CPU machines and CI,
    where none of them is installed)."""
    import importlib.util

    hidden = tuple(p for p in TRANSFORMERS_FALLBACKS if importlib.util.find_spec(p) is not None)
    if hidden and not any(isinstance(f, _TorchPathsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchPathsFinder(hidden))
    return hidden


# command line -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(prog="python -m ssmspec.baselines", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install", help="install the missing baselines into this environment")
    p.add_argument("--from", dest="source", type=Path, help="folder of downloaded files; no network is used")
    p.add_argument("--force", action="store_true", help="install even without a CUDA device")
    p = sub.add_parser("download", help="download what `install --from DIR` needs into DIR")
    p.add_argument("dest", type=Path)
    sub.add_parser("check", help="which baselines import here")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "install":
            done = install(args.source, force=args.force)
            print("baselines: installed " + ", ".join(Path(w).name for w in done) if done
                  else "baselines: nothing to install")
            return 0
        if args.cmd == "download":
            for path in download(args.dest):
                print(path)
            return 0
    except BaselineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    status = 0
    for b in BASELINES:
        why = import_error(b)
        version = available_version(b) or "not installed"
        print(f"{b.name:<10} {version:<22} {'ok' if why is None else 'MISSING'}  {b.used_for}")
        if why:
            print(f"{'':<10} {why}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
