"""The ahead-of-time compile check's two halves (tests/ops/test_aot_compile.py runs each in a subprocess).

- Record: a pytest plugin (``-p aot_specs`` with this folder on PYTHONPATH and ``SSMSPEC_AOT_RECORD=<file>``)
  wraps the interpreter's launch (``InterpretedFunction.run``) and writes, per kernel, every distinct
  specialization the tests launched. Each argument is typed the way Triton's launcher types it on a GPU
  (its own ``native_specialize_impl``: a tensor by its dtype, an int as i32 / i64 by magnitude or as a
  constexpr when it is 1, None as a constexpr, the 16-divisibility hints), with the constexprs' values and the
  launch options (num_warps, num_stages, ...).
- Compile: ``python -m aot_specs compile <specs> <out>`` (no TRITON_INTERPRET) builds an ``ASTSource`` per
  specialization and compiles it for sm_90 with Triton's bundled toolchain (no GPU needed), two at a time, and
  lists every ``@triton.jit`` function of src/ssmspec with the ones each kernel calls.
"""
from __future__ import annotations

import inspect
import json
import os
import sys

RECORD_ENV = "SSMSPEC_AOT_RECORD"
TRIM_ENV = "SSMSPEC_AOT_TRIM"  # a JSON file: {"path::test": None (skip it) or a regex its parameter ids must match}
SM90 = ("cuda", 90, 32)


def _value(v):
    """A constexpr's value as JSON (tuples as lists; a Triton dtype by name)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)):
        return [_value(x) for x in v]
    if type(v).__name__ == "dtype" and type(v).__module__.startswith("triton"):
        return {"tl_dtype": str(v)}
    raise TypeError(f"cannot record a constexpr of type {type(v).__name__}: {v!r}")


def _unvalue(v):
    if isinstance(v, list):
        return tuple(_unvalue(x) for x in v)
    if isinstance(v, dict) and "tl_dtype" in v:
        import triton.language as tl
        return tl.str_to_ty(v["tl_dtype"], None)
    return v


class Recorder:
    """Collects the specializations of the interpreter's launches while installed."""

    def __init__(self) -> None:
        self.specs: dict[str, dict] = {}

    def add(self, fn, args, kwargs) -> None:
        import triton.language as tl
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        sig = inspect.signature(fn)
        bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
        bound.apply_defaults()
        params, as_constexpr = [], []
        for name, p in sig.parameters.items():
            v = bound.arguments[name]
            if "constexpr" in str(p.annotation):
                params.append([name, "constexpr", _value(v.value if isinstance(v, tl.constexpr) else v)])
            else:  # what JITFunction's binder computes for a parameter that is not a constexpr (no annotation here)
                ty, attr = native_specialize_impl(BaseBackend, v, False, True, True)
                params.append([name, ty, _value(attr)])
                if ty == "constexpr":  # an int equal to 1, or None
                    as_constexpr.append(name)
        options = {k: _value(v) for k, v in sorted(kwargs.items()) if k not in sig.parameters}
        kernel = f"{fn.__module__}:{fn.__qualname__}"
        spec = {"kernel": kernel, "params": params, "options": options}
        key = json.dumps(spec, sort_keys=True)
        if key not in self.specs:
            spec["as_constexpr"] = as_constexpr
            spec["test"] = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
            self.specs[key] = spec

    def install(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        recorder = self

        def run(fn_self, *args, grid, warmup, **kwargs):
            recorder.add(fn_self.fn, args, kwargs)
            return original(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run


_RECORDER: Recorder | None = None


def pytest_configure(config):
    global _RECORDER
    if os.environ.get(RECORD_ENV) and _RECORDER is None:
        _RECORDER = Recorder()
        _RECORDER.install()


def pytest_collection_modifyitems(config, items):
    import re

    if not os.environ.get(TRIM_ENV):
        return
    with open(os.environ[TRIM_ENV]) as f:
        trim = json.load(f)
    keep, drop = [], []
    for item in items:
        name, _, params = item.nodeid.partition("[")
        if name not in trim:
            keep.append(item)
        elif trim[name] is not None and params and re.search(trim[name], params[:-1]):
            keep.append(item)
        else:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_sessionfinish(session, exitstatus):
    if _RECORDER is not None:
        worker = os.environ.get("PYTEST_XDIST_WORKER")  # under pytest-xdist, a file a worker
        with open(os.environ[RECORD_ENV] + (f".{worker}" if worker else ""), "w") as f:
            json.dump(list(_RECORDER.specs.values()), f, indent=0)


# ---------------------------------------------------------------------------------------------- compile half


def _load(kernel: str):
    import importlib

    mod, name = kernel.split(":")
    return getattr(importlib.import_module(mod), name)


def compile_spec(spec: dict) -> dict:
    """One recorded specialization compiled for sm_90 as ``JITFunction.run`` would compile it on an H100/H200."""
    import time

    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget

    t0 = time.perf_counter()
    fn = _load(spec["kernel"])
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, ty, val) in enumerate(spec["params"]):
        assert fn.arg_names[i] == name, (spec["kernel"], i, name)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[(i,)] = _unvalue(val)
        elif isinstance(val, str):
            attrs[(i,)] = BaseBackend.parse_attr(val)
    options = {k: _unvalue(v) for k, v in spec["options"].items()}
    options.setdefault("num_warps", 4)
    try:
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        k = triton.compile(src, target=GPUTarget(*SM90), options=options)
        out = {"ok": True, "shared": k.metadata.shared}  # bytes of shared memory a program uses
    except Exception as e:  # noqa: BLE001 - any compiler error is the finding this check reports
        msg = f"{type(e).__name__}: {e}"
        out = {"ok": False, "error": msg[-4000:]}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def jit_functions() -> dict[str, list[str]]:
    """Every ``@triton.jit`` function defined in src/ssmspec, each with the JIT functions its body names."""
    import ast
    import importlib
    import pathlib

    import ssmspec
    from triton.runtime.jit import JITFunction

    root = pathlib.Path(ssmspec.__file__).parent
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*.py")):
        if "triton.jit" not in path.read_text():
            continue
        name = "ssmspec." + ".".join(path.relative_to(root).with_suffix("").parts)
        mod = importlib.import_module(name.removesuffix(".__init__"))
        for attr, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.fn.__module__ == mod.__name__:
                found[f"{mod.__name__}:{attr}"] = obj
    calls = {}
    for key, obj in found.items():
        names = {n.id for n in ast.walk(ast.parse(obj.src)) if isinstance(n, ast.Name)}
        calls[key] = sorted(f"{g.fn.__module__}:{g.fn.__qualname__}" for n in names
                            if isinstance(g := obj.fn.__globals__.get(n), JITFunction) and g is not obj)
    return calls


def compile_main(specs_path: str, out_path: str, workers: int = 2) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with open(specs_path) as f:
        specs = json.load(f)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(compile_spec, specs, chunksize=1))
    with open(out_path, "w") as f:
        json.dump({"results": results, "jit": jit_functions()}, f)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("aot_specs compile: run without TRITON_INTERPRET (the compiler, not the interpreter)")
    cmd, *rest = sys.argv[1:]
    assert cmd == "compile", cmd
    compile_main(rest[0], rest[1], *(int(x) for x in rest[2:]))
