"""End-to-end decode throughput at a stated acceptance: ``replay_fig8_throughput`` (seed 000, Fig. 8).

Acceptance, stated (issue 9, item 1). With random weights no real drafter is ever accepted, so every
speculative line drafts with the ``oracle`` (``drafting/oracle.py``): each draft token equals the target's
own next greedy token with probability alpha -- an exact, seeded Bernoulli per node -- else a different
token. Under greedy verification a chain of S drafts then accepts a truncated geometric count,
P(a >= k) = alpha^k, so the expected accepted length is sum_{k=1..S} alpha^k (``expected_accepted``).

The oracle needs the target's own continuation, so nothing here starts synthetically: every batch point
prefills real synthetic prompt tokens (``bench.inputs.synthetic_prompts``, seeded by ``data.seed``) through
``Engine.prefill``, and the truth is the greedy continuation of the *same model and prompts* computed once
per (model, batch) by an autoregressive ``generate()`` (the engine's own loop; ``reference=``) for as many
tokens as the timed run can emit. Greedy verification is lossless, so the speculative run emits exactly
that continuation and the oracle's truth stays the target's next token at every step -- unless the
numerics of another strategy or call width flip a near-tie argmax (bf16). Rows record that honestly:
``ref_match`` is the share of sequences whose emitted tokens equal the reference, and ``mean_accepted`` /
``accepted_hist`` are the counts the engine's reports saw (``bench.steps.step_row``), never the formula.
With random bf16 weights that exception is the rule at large batches (on an H100 at batch 256 nearly every
sequence flips within 100 tokens), after which every kept draft is rejected; so by default the oracle is
*forced* (``bench.oracle: forced``, ``drafting/oracle.py``): greedy verification accepts exactly its kept
nodes, and the accepted counts are the designed truncated geometric whatever the numerics. ``bench.oracle:
compare`` verifies by token comparison (exact on fp32; the CPU reference shows both agree there).
Every line's oracle has the same seed (``seed``), so snapshot and replay at the same S draw the same Bernoulli
sequence and see the same accepted counts: their ratio compares the cost of their steps alone.

Rows also carry the tokens/s at the designed acceptance beside the measured one (``bench/designed.py``:
sequence-steps x (1 + E[a]) over the summed step times, and the measured mean accepted length's gap to E[a]).

Throughput is emitted tokens per second of the engine's captured decode steps (``Engine.time_steps``: drafting
+ verify + commit, CUDA events around each step): every step emits accepted + 1 tokens per sequence (the
budget is sized so that no sequence finishes inside the timed steps), divided by the summed step times.
Lines: ``autoregressive`` and ``replay`` standard decode (S = 0), ``snapshot`` spec (``bench.snapshot_S``),
``replay`` spec (``bench.replay_S``). Each point first checks ``engine.memory.plan_bytes`` (weights already
resident) against the free memory; a point that cannot fit is a ``status: skipped`` row naming both numbers,
and a real out-of-memory error is a ``status: oom`` row -- both are where a curve stops.

The oracle costs almost nothing to draft; the paper's MTP heads cost one extra layer per draft token, so
these lines are an upper bound on what a real drafter at the same acceptance gives. Presets named in
``bench.drafts`` (target -> draft model preset) add what a draft model costs: a ``draft autoregressive`` line
(the draft model's own autoregressive step at the same batch and prompts) and ``replay spec S=s + <draft>``
lines that run the draft model's whole drafting every step and verify the oracle's tokens in its place
(``drafting/costed.py``: the acceptance stays the oracle's stated one, the cost is the draft's). Their rows
carry the drafting time (``draft_ms``, ``draft_call_ms`` per draft call: ``bench.steps.draft_fields``) and
``draft_vs_ar``, a draft call over the draft model's autoregressive step measured in the same run.

On a checkpoint (``checkpoint=``; ``bench.drafter: auto`` picks ``png`` there, ``oracle`` on random weights)
the speculative lines draft with the real prompt n-gram drafter (PNG(S, 1), ``drafting/png.py``) on the
prompts of ``data=`` (a prompt set on disk, e.g. ``data=mtbench``; ``data=synthetic`` keeps random tokens).
Each prompt is tokenised by the checkpoint's tokenizer and cut to its last ``bench.prompt_len`` tokens, so
every batch point prefills the same width; a batch larger than the set cycles through it. Rows then say
``acceptance: measured`` and ``drafter: png``, and the accepted counts are what the drafter earned.
``bench.measured_drafters`` (a checkpoint only) runs every speculative line once per real drafter it lists,
labelled ``replay spec S=4 + mtp`` etc.: ``mtp`` (the checkpoint's own MTP head, as seed 000 drafts), ``draft_model``
(the model of ``bench.draft_checkpoint``, loaded in the target's dtype) and ``png``. Their rows carry ``ref_match``
against the target's autoregressive output of the same prompts (greedy verification is lossless: 1.0 in float32).
``bench.trained`` (``bench/trained_rows.py``) runs exactly this on the pairs the suite trains: the (acc) rows.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from omegaconf import DictConfig

from ssmspec import config as C
from ssmspec.bench.designed import designed_fields
from ssmspec.bench.inputs import synthetic_prompts, track
from ssmspec.bench.prompt_groups import load_sets, pad_group
from ssmspec.bench.steps import step_row
from ssmspec.bench.steps_replay import model_for, release
from ssmspec.drafting.costed import CostedOracle
from ssmspec.drafting.draft_model import DraftModel
from ssmspec.drafting.oracle import DRAWS, Oracle
from ssmspec.engine import Engine
from ssmspec.engine.generate import generate
from ssmspec.engine.memory import HEADROOM, fmt_bytes, free_bytes, plan_bytes
from ssmspec.strategies import SpecConfig, make_strategy

log = logging.getLogger("ssmspec.bench.e2e")

# seed 000 does not state the acceptance of its MTP drafters on GSM8K; alpha = 0.7 per token is our choice
# (S = 4: 2.77 tokens per step, so the paper's 1.9x needs a replay spec step <= 1.46x an autoregressive step)
DEFAULT_ALPHA = 0.7


def expected_accepted(alpha: float, S: int) -> float:
    """Mean accepted drafts of a chain of S oracle drafts under greedy verification: sum_{k=1..S} alpha^k."""
    return sum(alpha ** k for k in range(1, S + 1))


def lines(b: DictConfig, kinds=("oracle",), *, tag: bool = False) -> list[tuple[str, str, int, str]]:
    """(line label, strategy, S, drafter) of every curve: standard decode first, then the speculative lines, each
    once per drafter of ``kinds`` (``tag``: labelled ``<line> + <drafter>``)."""
    out = [("autoregressive", "autoregressive", 0, "none"), ("replay", "replay", 0, "none")]
    spec = [(f"snapshot spec S={int(s)}", "snapshot", int(s)) for s in b.snapshot_S]
    spec += [(f"replay spec S={int(s)}", "replay", int(s)) for s in b.replay_S]
    return out + [(f"{label} + {k}" if tag else label, st, S, k) for label, st, S in spec for k in kinds]


def draft_lines(b: DictConfig, preset: str) -> list[tuple[str, str, int, str, str]]:
    """(line label, strategy, S, drafter, draft preset) of the draft-model lines of ``preset`` (``bench.drafts``)."""
    draft = (b.get("drafts") or {}).get(preset)
    if not draft:
        return []
    out = [("draft autoregressive", "autoregressive", 0, "none", str(draft))]
    return out + [(f"replay spec S={int(s)} + draft", "replay", int(s), "oracle", str(draft)) for s in b.replay_S]


def draft_model_for(cfg: DictConfig, preset: str, room: int):
    """The draft model of a draft-model line: random weights seeded apart from the target's (``seed`` + 1)."""
    from ssmspec.models import build_model, load_preset

    mcfg = load_preset(preset)
    mcfg = mcfg.replace(max_seq_len=max(room + 64, mcfg.max_seq_len))
    return build_model(mcfg, seed=int(cfg.seed) + 1, device=cfg.device, dtype=C.resolve_dtype(str(cfg.dtype),
                                                                                              str(cfg.device)))


def spec_R(b: DictConfig) -> int:
    """Replay buffer of the replay spec lines: ``bench.spec_R``, else ``bench.R`` (that of the decode line)."""
    return int(b.get("spec_R") or b.R)


def check_bench(b: DictConfig, what: str) -> None:
    """Refuse settings that cannot work, naming the fix."""
    sizes = [int(x) for x in b.batch]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{what}: bench.batch needs positive sizes, got {sizes}")
    wins = [int(s) for s in list(b.snapshot_S) + list(b.replay_S)]
    if any(s < 1 for s in wins):
        raise ValueError(f"{what}: bench.snapshot_S / bench.replay_S hold draft windows S >= 1, got {wins}")
    spec_wins = [int(s) for s in b.replay_S]
    R = spec_R(b)
    if spec_wins and R < max(spec_wins) + 1:
        raise ValueError(f"{what}: replay needs a buffer of at least one call (S + 1 = {max(spec_wins) + 1} tokens); "
                         f"raise bench.spec_R (now {R}) or lower bench.replay_S")
    if int(b.R) < 1:
        raise ValueError(f"{what}: bench.R is the replay decode line's buffer, >= 1; got {b.R}")
    if not 0.0 <= float(b.alpha) <= 1.0:
        raise ValueError(f"{what}: bench.alpha is the oracle's per-token acceptance, in [0, 1]; got {b.alpha}")
    if int(b.prompt_len) < 1 or int(b.iters) < 1:
        raise ValueError(f"{what}: need bench.prompt_len >= 1 and bench.iters >= 1")


def oracle_draws(b: DictConfig) -> str:
    """``bench.draws``: random (seeded pseudo-random Bernoulli draws, the default) or weyl (low-discrepancy:
    the measured acceptance converges like 1/n to the designed one; ``drafting/weyl.py``)."""
    draws = str(b.get("draws", "random"))
    if draws not in DRAWS:
        raise ValueError(f"bench.draws must be one of {', '.join(DRAWS)}, got {draws!r}")
    return draws


def oracle_forced(b: DictConfig) -> bool:
    """``bench.oracle``: forced (default: accepted counts exactly as designed) or compare (token comparison)."""
    mode = str(b.get("oracle", "forced"))
    if mode not in ("forced", "compare"):
        raise ValueError(f"bench.oracle must be forced or compare, got {mode!r}")
    return mode == "forced"


def horizon(b: DictConfig) -> int:
    """Tokens a timed run can emit per sequence (first token + every launched step at the widest window + one
    window of slack): the reference's length and every engine's budget, so no sequence finishes while timed."""
    smax = max([0] + [int(s) for s in list(b.snapshot_S) + list(b.replay_S)])
    steps = max(int(b.warmup), 1) + int(b.iters) + 1
    return 1 + steps * (smax + 1) + smax


def plan_point(model, strategy: str, *, batch: int, prompt_len: int, new_tokens: int,
               spec: SpecConfig) -> tuple[bool, int, int]:
    """(fits, bytes needed, bytes free) of one engine next to the resident weights (``engine.memory``)."""
    parts = plan_bytes(model.cfg, make_strategy(strategy), batch=batch, spec=spec,
                       kv_capacity=prompt_len + new_tokens + spec.nodes + 1, prefill_len=prompt_len,
                       dtype=model.dtype, prefill=True)
    need, free = sum(parts.values()), free_bytes(model.device)
    return need <= HEADROOM * free, need, free


def ref_match(eng: Engine, reference: list[list[int]]) -> float:
    """Share of sequences whose emitted tokens (prompt excluded) equal the reference's first tokens."""
    buf = eng.step.buf
    toks, plen, n = buf.tokens.tolist(), buf.prompt_len.tolist(), buf.length.tolist()
    same = [row[p:k] == ref[:k - p] for row, p, k, ref in zip(toks, plen, n, reference)]
    return sum(same) / len(same)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def throughput_row(eng: Engine, *, warmup: int, iters: int, reference, oracle_alpha: float | None,
                   expected: float | None = None, **fields) -> dict:
    """Time the engine's steps; one tidy row with tokens/s from the reports' accepted counts, measured beside
    designed (``bench/designed.py``). ``oracle_alpha`` None: a real drafter, the acceptance is measured;
    ``expected``: the oracle's exact mean accepted length (default: a chain of S at alpha)."""
    row = step_row(eng, warmup=warmup, iters=iters, **fields)
    if bool(eng.step.done.any()):  # a finished sequence emits nothing: the accepted + 1 count would lie
        raise RuntimeError("a sequence finished inside the timed steps; the engine's budget is too small (bug)")
    accepted = [a for step in eng.accepted for a in step]
    emitted = sum(a + 1 for a in accepted)  # accepted + 1 per sequence per step
    seconds = sum(row["samples_ms"]) * 1e-3
    S = eng.spec.draft_len
    if not S:
        expected = 0.0
    elif oracle_alpha is None:
        expected = None
    elif expected is None:
        expected = expected_accepted(oracle_alpha, S)
    row.update(status="ok", tokens_emitted=emitted, tokens_per_s=emitted / seconds,
               tokens_per_s_wall=emitted / (row["loop_wall_ms"] * 1e-3),
               tokens_per_step=emitted / (len(eng.accepted) * eng.step.batch),
               acceptance=("oracle" if oracle_alpha is not None else "measured") if S else "none",
               alpha=oracle_alpha if S else None, expected_accepted=expected,
               ref_match=ref_match(eng, reference) if reference is not None else None)
    row.update(designed_fields(expected=expected, accepted=accepted, seconds=seconds,
                               tokens_per_s=row["tokens_per_s"]))
    return row


DRAFTERS = ("auto", "oracle", "png")
MEASURED = ("mtp", "draft_model", "png")  # bench.measured_drafters: a checkpoint's real drafters


def fig8_drafter(cfg: DictConfig) -> str:
    """``bench.drafter``: auto (png with ``checkpoint=``, oracle on random weights), oracle or png."""
    kind = str(cfg.bench.get("drafter", "auto"))
    if kind not in DRAFTERS:
        raise ValueError(f"replay_fig8_throughput: bench.drafter is one of {', '.join(DRAFTERS)}, got {kind!r}")
    return ("png" if cfg.get("checkpoint") else "oracle") if kind == "auto" else kind


def _measured_names(b) -> list[str]:
    names = [str(n) for n in (b.get("measured_drafters") or [])]
    if set(names) - set(MEASURED) or len(set(names)) != len(names):
        raise ValueError(f"replay_fig8_throughput: bench.measured_drafters lists distinct real drafters of "
                         f"{', '.join(MEASURED)}, got {names}")
    return names


def fig8_drafters(cfg: DictConfig) -> list[str]:
    """The drafters of the speculative lines: ``bench.measured_drafters`` (a checkpoint's real drafters, a line
    each) or the one drafter of ``bench.drafter``. Also checks the trained rows' block before any row runs."""
    b = cfg.bench
    if (b.get("trained") or {}).get("bench"):
        _measured_names(b.trained.bench)
    names = _measured_names(b)
    if not names:
        return [fig8_drafter(cfg)]
    if not cfg.get("checkpoint"):
        raise ValueError("replay_fig8_throughput: bench.measured_drafters measures the real drafters of a checkpoint; "
                         "give checkpoint=<dir> (bench.trained gives the trained pairs') or set it to null")
    if str(b.get("drafter", "auto")) != "auto":
        raise ValueError(f"replay_fig8_throughput: bench.measured_drafters replaces bench.drafter; leave "
                         f"bench.drafter=auto, got {b.drafter!r}")
    if "draft_model" in names and not b.get("draft_checkpoint"):
        raise ValueError("replay_fig8_throughput: the draft_model drafter needs bench.draft_checkpoint=<dir of the "
                         "draft model> (bench.trained sets the distilled draft); or drop it from "
                         "bench.measured_drafters")
    return names


def prompt_set(cfg: DictConfig, model) -> tuple[str, list[list[int]] | None]:
    """(name, token lists) of the first prompt set of ``data=`` on disk, tokenised by the model's tokenizer;
    (why not, None) where none is."""
    from ssmspec.data.tokenizers import load_tokenizer
    sets = load_sets(cfg, load_tokenizer(model), model.cfg.vocab_size)
    for ps in sets:
        if ps.reason is None:
            return ps.name, ps.prompts
    return "; ".join(str(ps.reason) for ps in sets) or "data= names no prompt set", None


def _models(cfg: DictConfig, b: DictConfig, room: int) -> Iterator[tuple[str, object]]:
    """(label, model) per preset, one at a time; a checkpoint replaces the presets."""
    if cfg.get("checkpoint"):
        model = C.make_model(cfg, max_seq_len=room)
        yield model.cfg.name, model
        return
    for preset in b.presets:
        yield str(preset), model_for(cfg, str(preset), room)


def run_fig8(cfg: DictConfig) -> Iterator[dict]:
    """Fig. 8: emitted tokens/s of every line (module doc) per preset x batch, at the oracle's alpha or with the
    checkpoint's real drafters."""
    # here, not at module level: the many benches that import this module's helpers do not load checkpoints
    from ssmspec.bench.real_drafters import measured_drafter
    from ssmspec.drafting.mtp import check_head
    from ssmspec.models.loading import load_model

    b = cfg.bench
    check_bench(b, "replay_fig8_throughput")
    device = str(cfg.device)
    graph = C.use_cuda_graph(b.get("cuda_graph", "auto"), device)
    warmup, iters, Tp, R, alpha = int(b.warmup), int(b.iters), int(b.prompt_len), int(b.R), float(b.alpha)
    forced = oracle_forced(b)
    kinds = fig8_drafters(cfg)
    oracle = kinds == ["oracle"]  # a run drafts with the oracle or with real drafters, never both
    H = horizon(b)
    seed, min_tok = int(cfg.data.get("seed", 0)), int(cfg.data.get("min_token_id", 3))
    for preset, model in _models(cfg, b, Tp + H + 16):
        V = model.cfg.vocab_size
        extra = [] if cfg.get("checkpoint") or not oracle else draft_lines(b, preset)
        drafts = {d: draft_model_for(cfg, d, Tp + H + 16) for d in {line[4] for line in extra}}
        if "mtp" in kinds:
            check_head(model.cfg)
        real_draft = None
        if "draft_model" in kinds:  # the checkpoint's draft (bench.trained: the draft distilled from it)
            real_draft = load_model(str(b.draft_checkpoint), device=device, dtype=model.dtype, max_seq_len=Tp + H + 16)
        real_set = not oracle and str(cfg.data.get("name", "")) != "synthetic"
        pset, texts = prompt_set(cfg, model) if real_set else ("synthetic", None)
        for bsz in track([int(x) for x in b.batch], desc=f"{preset} batches"):
            ids = valid = prompts = None  # made once the first line of this batch fits
            # a batch of the set's prompts, each cut to its last Tp tokens, cycling through the set
            sample = [texts[i % len(texts)][-Tp:] for i in range(bsz)] if texts else None
            reference, ref_error = None, None
            ar_ms = None  # the draft model's autoregressive step at this batch (its line runs first)
            tag = bool(b.get("measured_drafters"))
            for label, strategy, S, kind, dname in [(*ln, None) for ln in lines(b, kinds, tag=tag)] + extra:
                run_model = drafts[dname] if dname and not S else model  # the draft AR line runs the draft
                Rl = spec_R(b) if S else R  # the decode line's buffer, or the spec lines'
                spec = SpecConfig(draft_len=S, buffer_size=Rl)
                base = dict(model=preset, line=label, strategy=strategy, S=S, batch=bsz, prompt_len=Tp,
                            R=Rl if strategy == "replay" else None, dtype=C.dtype_name(model.dtype),
                            drafter=kind,
                            acceptance=("oracle" if oracle else "measured") if S else "none",
                            alpha=alpha if S and oracle else None,
                            oracle=("forced" if forced else "compare") if S and oracle else None)
                if dname:
                    base.update(draft=dname, drafter="oracle + draft_model cost" if S else "none")
                if kind == "draft_model":
                    base.update(draft=real_draft.cfg.name)
                if not oracle:
                    base.update(set=pset, ngram=int(b.get("ngram", 3)) if kind == "png" else None,
                                prompt_len_max=max(map(len, sample)) if sample is not None else Tp)
                    if sample is None and real_set:
                        yield {**base, "status": "skipped", "reason": pset}
                        continue
                fit, need, free = plan_point(run_model, strategy, batch=bsz, prompt_len=Tp, new_tokens=H, spec=spec)
                if not fit:
                    yield {**base, "status": "skipped", "planned_bytes": need,
                           "reason": f"needs {fmt_bytes(need)} beside the weights but {fmt_bytes(free)} are free "
                                     f"(at most {HEADROOM:.0%} used)"}
                    continue
                if ids is None and sample is not None:  # prompt-set tokens, left-padded to Tp
                    ids, valid = pad_group(sample, Tp, model.cfg.pad_token_id, device)
                    prompts = sample
                elif ids is None:
                    ids = synthetic_prompts(bsz, Tp, V, seed=seed, min_token_id=min_tok, device=device)
                    valid, prompts = torch.ones_like(ids, dtype=torch.bool), ids.tolist()
                if S and reference is None and ref_error is None:
                    try:  # the target's own greedy continuation, once per (model, batch): the oracle's truth, and
                        # what real drafters must reproduce (ref_match)
                        reference = generate(model, prompts, max_new_tokens=H, strategy="autoregressive",
                                             cuda_graph=graph).sequences
                    except (torch.OutOfMemoryError, RuntimeError) as e:
                        if not _is_oom(e):
                            raise
                        ref_error = str(e).splitlines()[0]
                    release(device)
                if S and reference is None:
                    yield {**base, "status": "oom", "reason": f"reference run out of memory: {ref_error}"}
                    continue
                eng = None
                try:
                    drafter = None
                    if S and oracle:
                        drafter = Oracle(p=alpha, draft_len=S, reference=reference, vocab_size=V,
                                         seed=int(cfg.seed), forced=forced)
                        if dname:
                            drafter = CostedOracle(drafter, DraftModel(draft=drafts[dname], draft_len=S))
                    elif S:
                        drafter = measured_drafter(kind, target=model, draft=real_draft, draft_len=S,
                                                   **({"ngram": int(b.get("ngram", 3))} if kind == "png" else {}))
                    eng = Engine(run_model, batch=bsz, prefill_len=Tp, max_new_tokens=H, strategy=strategy,
                                 drafter=drafter, spec=spec, cuda_graph=graph)
                    eng.prefill(ids, valid, prompts)
                    row = throughput_row(eng, warmup=warmup, iters=iters, reference=reference if S else None,
                                         oracle_alpha=alpha if oracle else None, **base, planned_bytes=need)
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not _is_oom(e):
                        raise
                    row = {**base, "status": "oom", "planned_bytes": need, "reason": str(e).splitlines()[0]}
                del eng
                release(device)
                if dname and row["status"] == "ok":
                    if S and ar_ms:
                        row["draft_vs_ar"] = row["draft_call_ms"] / ar_ms
                    elif not S:
                        ar_ms = row["ms_p50"]
                if row["status"] == "ok" and row["ref_match"] is not None and row["ref_match"] < 1.0:
                    log.warning("%s %s B=%d: %.0f%% of sequences left the reference (a near-tie argmax flipped); %s",
                                preset, label, bsz, 100 * (1 - row["ref_match"]),
                                "the drafter then drafts for another continuation" if not oracle else
                                "the forced oracle keeps the designed acceptance" if forced else
                                "their drafts after that point are wrong and acceptance is below alpha's")
                if row["status"] == "ok":
                    log.info("%s %s B=%d: %.0f tokens/s (%.2f accepted)", preset, label, bsz, row["tokens_per_s"],
                             row["mean_accepted"])
                yield row
            del reference
        del model, drafts, real_draft
        release(device)
