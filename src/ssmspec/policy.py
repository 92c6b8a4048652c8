"""A step-cost model fitted from measured decode steps, and a policy that picks the speculation method.

Cost model (per strategy s): one engine step at batch B whose calls carry L tokens per sequence (pending token
plus drafts; L = 1 for standard decoding) takes

    t_s(B, L) = a_s + b_s B + c_s B (L - 1)        ms

a fixed part (launches, the weight read that dominates small batches), a per-sequence part (the state and KV
traffic of one token) and a per-draft part (what each extra token of the verify call costs). The three
coefficients are a least-squares fit to measured steps (``fit``), kept >= 0; ``CostModel.residual`` is the
relative RMS error of the fit on its own points. With a stated acceptance the expected tokens a step emits per
sequence are 1 + E[accepted] (``drafting.oracle.expected_accepted``: chains, the best of D chains), so the
predicted throughput of a setting is

    tokens/s = 1000 B (1 + E[accepted]) / t_s(B, 1 + D S)

``pick`` maximises it over the candidate settings (strategy, S, D) at a batch size -- traffic-aware speculation
(seed 001, section 4): longer and more drafts pay at small batches, where the step is bound by the weight read,
and stop paying as the batch grows. ``python -m ssmspec policy --fit results/cost_model/<profile>/results.jsonl
--batch 1 64 256 --alpha 0.7`` prints the picks of the model the ``cost_model`` experiment fitted.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ssmspec.drafting.oracle import expected_accepted


@dataclass(frozen=True)
class Setting:
    """A fixed way to decode: a strategy, draft length S and drafts per sequence D (S = 0: standard decoding)."""

    strategy: str
    S: int = 0
    D: int = 1

    @property
    def tokens(self) -> int:  # L: tokens per sequence in one call
        return 1 + self.D * self.S

    @property
    def label(self) -> str:
        return self.strategy if self.S == 0 else f"{self.strategy} S={self.S} D={self.D}"


@dataclass
class CostModel:
    """Per-strategy coefficients (a, b, c) of t(B, L) = a + b B + c B (L - 1), in ms (module doc)."""

    coef: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    residual: dict[str, float] = field(default_factory=dict)  # relative RMS error of each strategy's fit

    def step_ms(self, strategy: str, batch: int, tokens: int) -> float:
        if strategy not in self.coef:
            raise ValueError(f"the cost model has no fit for strategy {strategy!r}; fitted: {sorted(self.coef)}")
        a, b, c = self.coef[strategy]
        return a + b * batch + c * batch * (tokens - 1)

    def tokens_per_s(self, setting: Setting, batch: int, alpha: float) -> float:
        emitted = 1.0 + (expected_accepted(alpha, draft_len=setting.S, num_drafts=setting.D) if setting.S else 0.0)
        return 1000.0 * batch * emitted / self.step_ms(setting.strategy, batch, setting.tokens)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "CostModel":
        """From ``save``'s json, or from the ``kind: fit`` rows of a cost_model run's results.jsonl."""
        try:
            text = Path(path).read_text()
            if str(path).endswith(".jsonl"):
                rows = [json.loads(line) for line in text.splitlines() if line.strip()]
                fits = [r for r in rows if r.get("kind") == "fit"]
                if not fits:
                    raise KeyError("no kind: fit rows")
                return cls({r["strategy"]: (r["a"], r["b"], r["c"]) for r in fits},
                           {r["strategy"]: r["residual"] for r in fits})
            data = json.loads(text)
            return cls({k: tuple(v) for k, v in data["coef"].items()}, dict(data.get("residual", {})))
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{path}: not a fitted cost model ({e}); give the results.jsonl of a cost_model run "
                             f"(python -m ssmspec run experiment=cost_model) or a CostModel.save() json") from e


def fit(points: list[dict]) -> CostModel:
    """Least squares of t = a + b B + c B (L - 1) per strategy over ``points`` (dicts with strategy, batch,
    tokens, ms), coefficients clipped at 0 and refitted without the clipped terms."""
    by: dict[str, list[dict]] = {}
    for p in points:
        by.setdefault(str(p["strategy"]), []).append(p)
    model = CostModel()
    for strategy, pts in by.items():
        B = np.array([float(p["batch"]) for p in pts])
        L = np.array([float(p["tokens"]) for p in pts])
        t = np.array([float(p["ms"]) for p in pts])
        X = np.stack([np.ones_like(B), B, B * (L - 1)], axis=1)
        active = [0, 1, 2] if (L > 1).any() else [0, 1]
        while True:
            sol, *_ = np.linalg.lstsq(X[:, active], t, rcond=None)
            if (sol >= 0).all() or len(active) == 1:
                break
            active = [i for i, v in zip(active, sol) if v >= 0] or [0]
        coef = np.zeros(3)
        coef[active] = np.maximum(sol, 0.0)
        pred = X @ coef
        model.coef[strategy] = tuple(float(v) for v in coef)
        model.residual[strategy] = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    return model


def pick(model: CostModel, batch: int, alpha: float, candidates: list[Setting],
         fits=None) -> tuple[Setting, float]:
    """The candidate with the highest predicted tokens/s at ``batch`` and acceptance ``alpha`` (and its
    prediction). ``fits(setting, batch) -> bool`` drops settings whose engine would not fit in memory."""
    best = None
    for s in candidates:
        if fits is not None and not fits(s, batch):
            continue
        v = model.tokens_per_s(s, batch, alpha)
        if best is None or v > best[1]:
            best = (s, v)
    if best is None:
        raise ValueError(f"no candidate setting fits at batch {batch}; lower the batch or add standard decoding")
    return best


def main(argv: list[str] | None = None) -> int:
    """``python -m ssmspec policy --fit <cost_model.json> --batch 64 --alpha 0.7``: the pick and its prediction."""
    import argparse

    ap = argparse.ArgumentParser(prog="ssmspec policy", description=main.__doc__)
    ap.add_argument("--fit", required=True, help="results.jsonl of a cost_model run (or a CostModel.save() json)")
    ap.add_argument("--batch", type=int, nargs="+", required=True)
    ap.add_argument("--alpha", type=float, required=True, help="per-token acceptance of the drafts, in [0, 1]")
    ap.add_argument("--S", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    ap.add_argument("--D", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    try:
        if not 0.0 <= args.alpha <= 1.0 or min(args.batch) < 1:
            raise ValueError("--alpha must be in [0, 1] and --batch sizes >= 1")
        model = CostModel.load(Path(args.fit))
        cands = candidates(sorted(model.coef), args.S, args.D)
        for B in args.batch:
            s, v = pick(model, B, args.alpha, cands)
            print(f"batch {B}: {s.label} ({v:.0f} tokens/s predicted)")
    except ValueError as e:
        print(f"error: {e}")
        return 2
    return 0


def candidates(strategies: list[str], S: list[int], D: list[int]) -> list[Setting]:
    """Every setting of the fitted strategies: standard decoding (``autoregressive``) and S x D speculation for
    every other strategy (D chains per sequence)."""
    out = []
    for st in strategies:
        if st == "autoregressive":
            out.append(Setting(st))
            continue
        out += [Setting(st, int(s), int(d)) for s in S for d in D]
    return out
