"""A step-cost model fitted from measured decode steps, and a policy that picks the speculation method.

Cost model (per strategy s): one engine step at batch B whose calls carry L tokens per sequence (the pending
token plus D draft chains of S tokens: L = 1 + D S; L = 1 for standard decoding) takes

    t_s(B, L, D) = a + a_L (L - 1) + B (b + c (L - 1) + d (D - 1)) + e max(0, B L - N0)        ms

- ``a``: launches and the weight read that dominates small batches;
- ``a_L``: what an extra token costs the call whatever the batch (per-position work of the verify kernels);
- ``b``, ``c``, ``d``: per sequence, the state and KV traffic of one token, of each extra token, and of each
  extra draft chain (a chain reads or snapshots its own copy of the state);
- ``e`` and the knee ``N0``: once a call carries more than N0 tokens the projections stop being bound by the
  weight read and every further token costs compute (the roofline's knee).

``fit`` finds the coefficients by least squares on relative error (small batches weigh as much as large ones),
all kept >= 0, and the knee by trying every measured B L; ``CostModel.residual`` is the relative RMS error on its
own points. The points are fitted in a fixed order, so a run's ``kind: fit`` rows and a refit of its measured steps
(``CostModel.load``, the command line) are the same model. Where the points cannot tell knees apart (one measured
B L above a gap: every knee in the gap fits them equally, with its own e), the fit takes the lowest, the last
measured call below the gap: the cost then grows linearly across the gap instead of jumping at an arbitrary
point inside it, and the choice no longer rests on rounding. The model alone predicts any (B, S, D); where a
setting was measured the prediction is calibrated by that setting's measured / predicted ratio, interpolated in
log B between its measured batches (held at the ends), so the policy neither trusts a smooth curve over a
measurement nor needs one at every batch.

With a stated acceptance the expected tokens a step emits per sequence are 1 + E[accepted]
(``drafting.oracle.expected_accepted``: chains, the best of D chains), so the predicted throughput of a setting is

    tokens/s = 1000 B (1 + E[accepted]) / t_s(B, 1 + D S, D)

``pick`` maximises it over the candidate settings (strategy, S, D) at a batch size -- traffic-aware speculation
(seed 001, section 4): longer and more drafts pay at small batches, where the step is bound by the weight read,
and stop paying as the batch grows. ``python -m ssmspec policy --fit results/cost_model/<profile>/results.jsonl
--batch 2 8 24 --alpha 0.7`` refits the model from a ``cost_model`` run's measurements and prints the picks.

Measured acceptance (``fit_alpha``): with a real drafter the per-token alpha is not stated but estimated from the
accepted counts of single chains (D = 1) -- the maximum-likelihood alpha of the truncated geometric law
P(a >= k) = alpha^k, k <= S: every accepted draft is a success and every chain stopped before its S-th draft one
failure, so alpha = accepted / (accepted + stopped). The same law then predicts D chains (independent chains; real
drafters' chains are not, which the cost_model rows show as measured vs predicted accepted length).
``--alpha measured`` reads the alpha a cost_model run measured this way (its ``kind: acceptance`` row).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ssmspec.drafting.oracle import expected_accepted

TERMS = ("a", "a_L", "b", "c", "d", "e")  # coefficients of t(B, L, D) in ms (module doc), then the knee N0


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

    @classmethod
    def parse(cls, label: str) -> "Setting":
        """The setting of a ``label`` ('autoregressive', 'replay S=4 D=2')."""
        strategy, *rest = label.split()
        kv = dict(part.split("=", 1) for part in rest)
        return cls(strategy, int(kv.get("S", 0)), int(kv.get("D", 1)))


def _features(batch, tokens, drafts, knee: float) -> np.ndarray:
    B, L, D = (np.asarray(v, dtype=float) for v in (batch, tokens, drafts))
    return np.stack([np.ones_like(B), L - 1, B, B * (L - 1), B * (D - 1), np.maximum(0.0, B * L - knee)], axis=-1)


@dataclass
class CostModel:
    """Per-strategy coefficients ``{a, a_L, b, c, d, e, N0}`` of t(B, L, D) in ms (module doc; N0 None: no knee
    in the measured range), each fitted setting's calibration ``[[batch, measured / model], ...]``, each
    strategy's relative RMS residual, and per setting the smallest batch at which the run could not measure it
    (``limits``: it did not fit in memory; read from a run's skipped rows)."""

    coef: dict[str, dict[str, float | None]] = field(default_factory=dict)
    residual: dict[str, float] = field(default_factory=dict)
    calibration: dict[str, list[list[float]]] = field(default_factory=dict)
    limits: dict[str, float] = field(default_factory=dict)

    def model_ms(self, strategy: str, batch: int, tokens: int, drafts: int = 1) -> float:
        """The fitted surface alone."""
        if strategy not in self.coef:
            raise ValueError(f"the cost model has no fit for strategy {strategy!r}; fitted: {sorted(self.coef)}")
        k = self.coef[strategy]
        knee = k.get("N0")
        x = _features(batch, tokens, drafts, math.inf if knee is None else knee)
        return float(x @ np.array([k.get(t, 0.0) for t in TERMS]))

    def step_ms(self, setting: Setting, batch: int, calibrated: bool = True) -> float:
        """Predicted step time of ``setting`` at ``batch``: the surface, times the setting's measured / model
        ratio interpolated in log B when it was measured (``calibrated``)."""
        ms = self.model_ms(setting.strategy, batch, setting.tokens, setting.D if setting.S else 1)
        cal = self.calibration.get(setting.label) if calibrated else None
        if cal:
            xs, ys = zip(*sorted(cal))
            ms *= math.exp(float(np.interp(math.log(batch), np.log(xs), np.log(ys))))
        return ms

    def measured(self) -> list[Setting]:
        """The settings the fit measured (those with a calibration), in label order."""
        return [Setting.parse(label) for label in sorted(self.calibration)]

    def runs_at(self, setting: Setting, batch: int) -> bool:
        """Whether the fit measured ``setting`` and ``batch`` lies below the smallest batch at which the run could
        not (``limits``): the command line's stand-in for the memory plan, which the experiment asks itself."""
        return setting.label in self.calibration and batch < self.limits.get(setting.label, math.inf)

    def tokens_per_s(self, setting: Setting, batch: int, alpha: float, calibrated: bool = True) -> float:
        emitted = 1.0 + (expected_accepted(alpha, draft_len=setting.S, num_drafts=setting.D) if setting.S else 0.0)
        return 1000.0 * batch * emitted / self.step_ms(setting, batch, calibrated)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path, model: str | None = None) -> "CostModel":
        """From ``save``'s json, or refitted from the measured steps (``kind: measure``, ``phase: fit``) of a
        cost_model run's results.jsonl: those of ``model`` (None: the run's one model on random weights, the rows
        of a trained pair only when there is nothing else; ``run_rows``)."""
        try:
            text = Path(path).read_text()
            if str(path).endswith(".jsonl"):
                rows = run_rows(path, model)
                fitted = [r for r in rows if r.get("kind") == "measure" and r.get("phase") == "fit"]
                pts = [dict(strategy=r["strategy"], batch=r["batch"], S=r["S"], D=r["D"], ms=r["ms_p50"])
                       for r in fitted if r.get("status") == "ok"]
                if not pts:
                    raise KeyError("no measured steps (kind: measure, phase: fit, status: ok)")
                model = fit(pts)
                for r in fitted:
                    if r.get("status") != "ok":  # skipped by the memory plan, or out of memory
                        label = r["setting"]
                        model.limits[label] = min(float(r["batch"]), model.limits.get(label, math.inf))
                return model
            data = json.loads(text)
            coef = {k: {t: None if v is None else float(v) for t, v in c.items()} for k, c in data["coef"].items()}
            return cls(coef, dict(data.get("residual", {})), dict(data.get("calibration", {})),
                       {k: float(v) for k, v in data.get("limits", {}).items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a fitted cost model ({e}); give the results.jsonl of a cost_model run "
                             f"(python -m ssmspec run experiment=cost_model) or a CostModel.save() json") from e


def run_rows(path: Path, model: str | None = None) -> list[dict]:
    """The rows of one model of a cost_model run's results.jsonl: ``model``, or where None the run's only model
    (rows of the oracle pair first: ``pair: trained`` rows, measured on a trained pair, only when the run has no
    others). Several models and no ``model`` is an error naming them."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if model is None:
        own = [r for r in rows if r.get("pair") != "trained"]
        rows = own if any(r.get("kind") == "measure" for r in own) else rows
        names = sorted({str(r["model"]) for r in rows if r.get("kind") == "measure" and "model" in r})
        if len(names) > 1:
            raise ValueError(f"the run measured several models ({', '.join(names)}); name one with --model")
        return rows
    mine = [r for r in rows if str(r.get("model")) == model]
    if not mine:
        names = sorted({str(r["model"]) for r in rows if "model" in r})
        raise ValueError(f"no rows of model {model!r}; the run measured {', '.join(names) or 'none'}")
    return mine


def fit_alpha(chains: list[tuple[int, dict]]) -> tuple[float, int]:
    """(alpha, steps): the per-token acceptance that best explains measured single chains (module doc), from
    ``chains``, one (S, {accepted count: steps}) per measured setting at D = 1."""
    accepted = stopped = steps = 0
    for S, hist in chains:
        for a, n in hist.items():
            a, n = int(a), int(n)
            if not 0 <= a <= S:
                raise ValueError(f"an accepted count of {a} drafts from chains of S = {S}")
            accepted, stopped, steps = accepted + a * n, stopped + (n if a < S else 0), steps + n
    if not steps:
        raise ValueError("no measured single-chain steps (D = 1) to estimate the acceptance from")
    return (accepted / (accepted + stopped) if accepted + stopped else 0.0), steps


def read_alpha(path: Path, model: str | None = None) -> float:
    """The alpha a cost_model run measured on its fit prompts (``kind: acceptance`` row) for ``--alpha measured``."""
    got = [r for r in run_rows(path, model) if r.get("kind") == "acceptance"]
    if not got:
        raise ValueError(f"{path} has no measured acceptance (kind: acceptance) for this model; give --alpha <number>, "
                         f"or the rows of a cost_model run with a real drafter (--model <its trained pair's target>)")
    return float(got[0]["alpha"])


def _point_setting(p: dict) -> Setting:
    """A measured point's setting: from S and D, or from tokens per call with one chain."""
    if "S" in p and p["S"] is not None:
        return Setting(str(p["strategy"]), int(p["S"]), int(p.get("D") or 1))
    return Setting(str(p["strategy"]), int(p["tokens"]) - 1, 1)


def _nnls(X: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0 (terms with a negative solution dropped and the rest
    refitted; terms that never vary are left out)."""
    active = [i for i in range(X.shape[1]) if i == 0 or np.ptp(X[:, i]) > 0]
    while True:
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], t * w, rcond=None)
        if (sol >= 0).all() or len(active) == 1:
            break
        active = [i for i, v in zip(active, sol) if v >= 0] or [0]
    coef = np.zeros(X.shape[1])
    coef[active] = np.maximum(sol, 0.0)
    return coef


KNEE_TIE = 1e-9  # relative: knees whose fits differ by less than rounding fit the points equally


def _best(attempts: list[tuple[float, float, np.ndarray]]) -> tuple[float, float, np.ndarray]:
    """The (error, knee, coefficients) of the best fit; among fits equal within rounding (``KNEE_TIE``) the lowest
    knee (module doc), no knee (inf) last."""
    least = min(err for err, _, _ in attempts)
    return min((a for a in attempts if a[0] <= least * (1 + KNEE_TIE) + 1e-15), key=lambda a: a[1])


def fit(points: list[dict]) -> CostModel:
    """Fit the cost model per strategy over ``points`` (dicts with strategy, batch, ms, and S and D -- or tokens
    per call for one chain): relative least squares, coefficients >= 0, the knee N0 the best of every measured B L
    (or none), then each measured setting's calibration (module doc)."""
    by: dict[str, list[tuple[Setting, float, float]]] = {}
    # a fixed order: least squares over the same points in another order rounds differently, which decided between
    # knees that fit equally well (the run's fit rows and a refit of its rows disagreed)
    for p in sorted(points, key=lambda p: (str(p["strategy"]), float(p["batch"]), int(p.get("S") or 0),
                                            int(p.get("D") or 1), float(p.get("tokens") or 0), float(p["ms"]))):
        s = _point_setting(p)
        by.setdefault(s.strategy, []).append((s, float(p["batch"]), float(p["ms"])))
    model = CostModel()
    for strategy, pts in by.items():
        B = np.array([b for _, b, _ in pts])
        L = np.array([float(s.tokens) for s, _, _ in pts])
        D = np.array([float(s.D if s.S else 1) for s, _, _ in pts])
        t = np.array([ms for _, _, ms in pts])
        def attempt(knee: float) -> tuple[float, float, np.ndarray]:
            X = _features(B, L, D, knee)
            coef = _nnls(X, t, 1.0 / t)
            return float(np.sqrt(np.mean(((X @ coef - t) / t) ** 2))), knee, coef

        grid = sorted(set((B * L).tolist()))
        flat = attempt(math.inf)
        err, knee, coef = _best([attempt(k) for k in [math.inf, *grid]])
        if knee != math.inf:  # the knee lies between measured calls: search the two gaps around the best one
            i = grid.index(knee)
            lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
            for _ in range(5):  # zoom: 65 tries, then the two steps around the best, five times
                err, knee, coef = _best([(err, knee, coef), *(attempt(float(k)) for k in np.linspace(lo, hi, 65))])
                step = (hi - lo) / 64
                lo, hi = max(lo, knee - step), min(hi, knee + step)
        if err >= flat[0] - 1e-9:
            err, knee, coef = flat  # a knee that does not fit better is no knee
        model.coef[strategy] = {**{k: float(v) for k, v in zip(TERMS, coef)}, "N0": None if knee == math.inf else knee}
        model.residual[strategy] = err
    ratios: dict[str, dict[float, list[float]]] = {}
    for strategy, pts in by.items():
        for s, b, ms in pts:
            ratios.setdefault(s.label, {}).setdefault(b, []).append(ms / model.model_ms(strategy, b, s.tokens,
                                                                                          s.D if s.S else 1))
    model.calibration = {label: [[b, float(np.exp(np.mean(np.log(r))))] for b, r in sorted(per.items())]
                         for label, per in ratios.items()}
    return model


def pick(model: CostModel, batch: int, alpha: float, candidates: list[Setting], fits=None,
         calibrated: bool = True) -> tuple[Setting, float]:
    """The candidate with the highest predicted tokens/s at ``batch`` and acceptance ``alpha`` (and its
    prediction). ``fits(setting, batch) -> bool`` drops settings whose engine would not fit in memory;
    ``calibrated=False`` ranks by the fitted surface alone."""
    best = None
    for s in candidates:
        if fits is not None and not fits(s, batch):
            continue
        v = model.tokens_per_s(s, batch, alpha, calibrated)
        if best is None or v > best[1]:
            best = (s, v)
    if best is None:
        raise ValueError(f"no candidate setting fits at batch {batch}; lower the batch or add standard decoding")
    return best


def main(argv: list[str] | None = None) -> int:
    """``python -m ssmspec policy --fit <results.jsonl | cost_model.json> --batch 64 --alpha 0.7``: the pick and its
    prediction per batch, then each strategy's fitted coefficients. Without --S / --D the picks are made among
    the settings the fit measured, below the batch where the run could not (``CostModel.runs_at``): the choice
    of the cost_model experiment's policy rows wherever its memory plan agrees. --S / --D widen the grid to
    settings the fit never ran (the surface alone predicts them; such a pick is marked)."""
    import argparse

    ap = argparse.ArgumentParser(prog="ssmspec policy", description=main.__doc__)
    ap.add_argument("--fit", required=True, help="results.jsonl of a cost_model run (or a CostModel.save() json)")
    ap.add_argument("--batch", type=int, nargs="+", required=True)
    ap.add_argument("--alpha", required=True, help="per-token acceptance of the drafts, in [0, 1], or 'measured': the "
                    "alpha the run measured with a real drafter on its fit prompts")
    ap.add_argument("--model", help="the model whose rows to fit (a run with several; default: its only one)")
    ap.add_argument("--S", type=int, nargs="+", help="draft lengths (default: those the fit measured)")
    ap.add_argument("--D", type=int, nargs="+", help="drafts per sequence (default: those the fit measured)")
    args = ap.parse_args(argv)
    try:
        model = CostModel.load(Path(args.fit), args.model)
        if args.alpha == "measured":
            if not str(args.fit).endswith(".jsonl"):
                raise ValueError("--alpha measured reads a cost_model run's results.jsonl; give --fit <results.jsonl>")
            args.alpha = read_alpha(Path(args.fit), args.model)
        else:
            try:
                args.alpha = float(args.alpha)
            except ValueError:
                raise ValueError(f"--alpha is a number in [0, 1] or 'measured', got {args.alpha!r}") from None
        if not 0.0 <= args.alpha <= 1.0 or min(args.batch) < 1:
            raise ValueError("--alpha must be in [0, 1] and --batch sizes >= 1")
        measured = model.measured()
        if args.S or args.D:
            cands = candidates(sorted(model.coef), args.S or sorted({s.S for s in measured if s.S}) or [1],
                               args.D or sorted({s.D for s in measured if s.S}) or [1])
            fits = None
        else:
            cands, fits = measured, model.runs_at
        for B in args.batch:
            s, v = pick(model, B, args.alpha, cands, fits=fits)
            note = "" if s.label in model.calibration else ", model only: the fit never ran it"
            print(f"batch {B}: {s.label} ({v:.0f} tokens/s predicted{note})")
        for st in sorted(model.coef):
            k = model.coef[st]
            terms = ", ".join(f"{t} {k[t]:.4g}" for t in TERMS if k.get(t))
            knee = "no knee" if k.get("N0") is None else f"knee N0 {k['N0']:g} tokens a call"
            print(f"  {st}: {terms}, {knee}; residual {100 * model.residual[st]:.1f}%")
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
