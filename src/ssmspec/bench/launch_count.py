"""What one engine step launches, counted on the CPU: the kernels a captured step would put on a GPU.

A model of the size the suite trains decodes at the speed of its launches (``trained_acceptance``'s
``kernels_per_step``: 151 for an autoregressive step of the Mamba-2 pair, 258 for replay + draft_model at S = 4),
so an idea that removes launches can be judged before a GPU runs it. Under the Triton interpreter
(``TRITON_INTERPRET=1``, ``SSMSPEC_OPS_BACKEND=triton``) one eager engine step runs the same ops, in the same
order, as the graph the engine captures on a GPU (``Engine._eager`` is what ``Engine._capture`` records).
``LaunchCounter`` counts:

- every Triton kernel launch, by kernel name (the interpreter's ``InterpretedFunction.run``; the host work the
  interpreter does inside a launch is not counted);
- every aten op a GPU runs as a kernel, by op name: views, aliases and allocations (``empty``, ``empty_strided``)
  are not kernels; ``copy_``, ``fill_`` and ``zero_`` are (on a GPU a contiguous same-dtype copy may be a memcpy
  and a fill a memset, which ``bench/kernel_profile.py`` leaves out, so this count can run a few above the GPU's);
- not: ops that return no tensor (``promote_types``, sizes); host reads of device values (``aten._local_scalar_dense``: ``.item()``, ``.tolist()``), which a captured step
  must not have, apart.

``python -m ssmspec.bench.launch_count`` builds a ``conf/train/<run>.yaml`` family's target and draft with random
weights (structure decides the launches, not the values; ``--width`` shrinks every width for the interpreter's
sake, keeping layer counts and patterns), prefills a batch, runs a warm-up step, and prints per line (autoregressive
and each ``strategy + drafter`` at each S) the launches of one step, split into drafting and the target step, with
the most frequent kernels; ``--json`` writes the table.

How close it is, against ``kernels_per_step`` of ``trained_acceptance``'s GPU record (ed8e512, one H100; batch 1,
replay + draft_model at S = 4), counted here at ``--width 64``: the Mamba-2 pair 150 / 257 against 151 / 258 (one
kernel a step more on the GPU); the Nemotron-H pair 169 / 350 against 170 / 374 and the GDN pair 499 / 914 against
575 / 1057: attention and the GDN mixers take other paths on the CPU than on a GPU, so for those families the count
says where launches go, and is a lower bound of their number.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
from pathlib import Path

NO_KERNEL = {  # aten ops that launch nothing on a GPU (besides views and aliases, found from the schema)
    "empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
    "new_empty_strided.default", "lift_fresh.default", "detach.default", "set_.source_Storage_storage_offset",
    "resize_.default", "_to_copy.default_noop", "alias.default", "conj.default", "resolve_conj.default",
    "resolve_neg.default", "_reshape_alias.default", "unbind.int", "split.Tensor", "split_with_sizes.default",
    "chunk.default", "record_stream.default",
}
HOST_READ = "_local_scalar_dense.default"


class LaunchCounter:
    """``with LaunchCounter() as c: ...`` -> ``c.kernels`` (Counter of kernel names: ``triton:<fn>`` and
    ``aten:<op>``), ``c.host_reads`` (int); ``c.total()``. Needs the Triton modules imported in interpreter mode
    for the Triton launches to be seen (they run as ``InterpretedFunction``)."""

    def __init__(self) -> None:
        self.kernels: collections.Counter = collections.Counter()
        self.host_reads = 0
        self._inside = 0
        self._stack = contextlib.ExitStack()

    def total(self) -> int:
        return sum(self.kernels.values())

    def __enter__(self) -> LaunchCounter:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not counter._inside:
                    counter._aten(func, out)
                return out

        self._stack.enter_context(_Mode())
        with contextlib.suppress(ImportError):
            from triton.runtime.interpreter import InterpretedFunction

            original = InterpretedFunction.run

            def run(fn_self, *args, **kwargs):
                if not kwargs.get("warmup"):
                    counter.kernels[f"triton:{fn_self.fn.__name__}"] += 1
                counter._inside += 1
                try:
                    return original(fn_self, *args, **kwargs)
                finally:
                    counter._inside -= 1

            InterpretedFunction.run = run
            self._stack.callback(setattr, InterpretedFunction, "run", original)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _aten(self, func, out) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        name = f"{func._schema.name.split('::')[-1]}.{func._overloadname}"
        if name == HOST_READ:
            self.host_reads += 1
        elif not (getattr(func, "is_view", False) or name in NO_KERNEL
                  or not any(isinstance(x, torch.Tensor) for x in tree_leaves(out))):  # promote_types, sym sizes
            self.kernels[f"aten:{name}"] += 1


def count_step(eng) -> dict:
    """The launches of one step of an eager CPU engine that has prefilled (and run a warm-up step): drafting
    and the target step apart (``Engine.draft_part`` / ``target_part``, the two halves of its eager step)."""
    import torch

    with torch.no_grad():
        with LaunchCounter() as draft:
            eng.draft_part()
        with LaunchCounter() as target:
            eng.target_part()
        eng.strategy.after_step()
    return {"draft": draft.total(), "target": target.total(), "kernels": draft.total() + target.total(),
            "host_reads": draft.host_reads + target.host_reads,
            "draft_kernels": dict(draft.kernels.most_common()), "target_kernels": dict(target.kernels.most_common())}


SHARED_HEADS = (("ssm_heads", "n_groups"), ("n_heads", "n_kv_heads"), ("gdn_v_heads", "gdn_k_heads"))


def _narrow(spec: dict, width: int | None) -> dict:
    """A ``models`` entry with every width cut to at most ``width`` (heads of 64 -> fewer heads), layer counts kept:
    each head count scaled (at least 1), the heads they share (groups, KV heads, GDN key heads) cut to the largest
    divisor of it that is no more than before."""
    if not width or width >= int(spec["d_model"]):
        return dict(spec)
    scale = width / int(spec["d_model"])
    out = {**spec, "d_model": width}
    for heads, shared in SHARED_HEADS:
        if heads in out:
            out[heads] = max(1, round(int(out[heads]) * scale))
        if shared in out:
            n = int(out.get(heads, 1))
            out[shared] = next(d for d in range(min(int(out[shared]), n), 0, -1) if n % d == 0)
    if "d_ff" in out:
        out["d_ff"] = max(64, int(int(out["d_ff"]) * scale))
    return out


def _models(run: str, family: str, width: int | None, vocab: int):
    from ssmspec.models.model import build_model
    from ssmspec.train.command import compose_train
    from ssmspec.train.run import model_config

    cfg = compose_train(run, [])
    models = cfg["models"]
    if family not in models:
        raise ValueError(f"conf/train/{run}.yaml has no family {family!r}; choose among {sorted(models)}")
    out = []
    for role in ("target", "draft"):
        mc = model_config(_narrow(dict(models[family][role]), width), name=f"{family}-{role}", vocab_size=vocab,
                          seed=0)
        out.append(build_model(mc, seed=1 + len(out)))
    return out


def lines(args) -> list[dict]:
    import torch

    from ssmspec.bench.prompt_groups import pad_group
    from ssmspec.bench.real_drafters import measured_drafter
    from ssmspec.engine import Engine
    from ssmspec.strategies import SpecConfig

    target, draft = _models(args.run, args.family, args.width, args.vocab)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    ids, valid = pad_group(prompts, args.prompt_len, target.cfg.pad_token_id, "cpu")
    todo = [("none", "autoregressive", 0)] + [(d, st, S) for S in args.S for st in args.strategy for d in args.drafter]
    rows = []
    for dname, strategy, S in todo:
        drafter = measured_drafter(dname, target=target, draft=draft, draft_len=S) if S else None
        eng = Engine(target, batch=args.batch, prefill_len=args.prompt_len, max_new_tokens=8 * (max(args.S) + 1),
                     strategy=strategy, drafter=drafter, spec=SpecConfig(draft_len=S, buffer_size=args.R),
                     cuda_graph=False)
        eng.prefill(ids, valid, prompts)
        eng.launch()  # warm-up: the first step may build what later steps reuse
        eng.collect(keep=0)
        row = {"line": f"{strategy} + {dname}" if S else "autoregressive", "S": S, "batch": args.batch,
               **count_step(eng)}
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssmspec.bench.launch_count", description=__doc__.splitlines()[0])
    p.add_argument("--run", default="gpu", help="conf/train/<run>.yaml whose family to build (default gpu)")
    p.add_argument("--family", default="mamba2")
    p.add_argument("--strategy", nargs="+", default=["replay"])
    p.add_argument("--drafter", nargs="+", default=["draft_model"])
    p.add_argument("--S", nargs="+", type=int, default=[4])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--R", type=int, default=32, help="replay's ring size")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--width", type=int, default=64, help="cut every width to this (0: the run's own sizes)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if any(s < 1 for s in args.S) or args.batch < 1:
        print("error: --S and --batch take integers >= 1", file=sys.stderr)
        return 2
    try:
        rows = lines(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in rows:
        print(f"{r['line']:<28} S={r['S']} B={r['batch']}: {r['kernels']} kernels (drafting {r['draft']}, target step "
              f"{r['target']}), host reads {r['host_reads']}")
        for part in ("draft", "target"):
            for name, n in list(r[f"{part}_kernels"].items())[:args.top]:
                print(f"    {part:<6} {n:4d}  {name}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton module is imported
    os.environ.setdefault("SSMSPEC_OPS_BACKEND", "triton")
    raise SystemExit(main())
