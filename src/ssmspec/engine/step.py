"""The decode step: one function of fixed shapes that the engine captures once as a CUDA graph.

``DecodeStep`` owns everything one (model, strategy, drafter, verifier, batch, SpecConfig) needs across
steps, allocated once: the strategy's SSM / conv state, a KV cache per attention block, the device token
buffer (``TokenBuffer``: prompt + emitted tokens of every sequence), and the per-sequence counters
(pending token, tokens folded into the state, tokens emitted, finished flag). ``step()`` runs

    drafter.propose_device(buf)  ->  strategy.layout  ->  model  ->  verifier  ->  strategy.commit + KV commit
    ->  drafter.observe  ->  emit: the emitted tokens into the buffer, EOS / length flags (``ops/step_glue``)

(a drafter with ``wants_hidden``, the mtp drafter, is also handed the target's final hidden states of the pending
token and the accepted path: ``observe_hidden``, gathered on the device from the same forward)

with device ops only: the host waits on nothing inside a step. Finished sequences keep stepping (their
emitted count is masked to 0), and prompts of different lengths were left-padded at prefill, so the shapes
never change. On CUDA the drafting and the target's step are captured as two graphs replayed back to back
(the drafter's work stays separable: its own graph, later its own stream or device); drafters that cannot
run on the device (``on_device`` False) run eagerly before the target's graph and their drafts are copied
into the graph's static inputs. CPU runs the same functions eagerly.

After every step the emitted tokens, counts and flags are gathered into one small int64 tensor
(``report``, (B, 4 + S)); ``engine/generate.py`` copies it to pinned host memory without blocking and reads it one step
later, so the host never stalls the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ssmspec.drafting.base import DraftTree, TokenBuffer
from ssmspec.engine.context import RunContext
from ssmspec.models.kv_cache import KVCache
from ssmspec.models.model import HybridLM
from ssmspec.ops.step_glue import emit
from ssmspec.strategies import SpecConfig, StepInputs, StrategyBase
from ssmspec.verify.base import Verdict, reads_argmax


class _SampleVerifier:
    """No drafts, sampling: emit one token drawn from the target distribution (its fp32 probabilities)."""

    name = "sample"

    def __init__(self, sampling) -> None:
        self.sampling = sampling

    def verify(self, node_logits: Tensor, drafts, generator=None) -> Verdict:
        from ssmspec.verify.distributions import sample, target_probs

        last = node_logits[:, 0]
        tok = sample(target_probs(last, self.sampling), generator)
        zeros = torch.zeros(last.shape[0], dtype=torch.long, device=last.device)
        return Verdict(accepted=zeros, path=zeros[:, None], bonus=tok)


def default_verifier(spec: SpecConfig, sampling):
    """Greedy or speculative sampling for drafts; without them the greedy verifier (whose verdict on no drafts
    is the argmax) or plain sampled picking."""
    if spec.draft_len == 0 and not sampling.greedy:
        return _SampleVerifier(sampling)
    from ssmspec.verify import make_verifier

    return make_verifier("greedy" if sampling.greedy else "speculative", sampling=sampling)


@dataclass
class Report:
    """What one step emitted, per sequence (host copy of ``DecodeStep.report``)."""

    tokens: list[list[int]]  # emitted tokens (accepted drafts, then the bonus), EOS / budget applied
    accepted: list[int]  # accepted draft tokens (before masking finished sequences)
    done: list[bool]  # finished after this step


class DecodeStep:
    """Static buffers + the step function of one run (module doc)."""

    def __init__(self, model: HybridLM, strategy: StrategyBase, *, batch: int, spec: SpecConfig, drafter=None,
                 verifier, generator: torch.Generator, kv_capacity: int, prefill_len: int, max_new_tokens: int,
                 eos_token_id: int | None = None) -> None:
        cfg = model.cfg
        self.model, self.strategy, self.drafter, self.verifier = model, strategy, drafter, verifier
        # a verifier that only ranks logits (greedy) reads them in the model dtype, and one that reads only their
        # argmax is handed that, made in bounded chunks (verify/base.py)
        self.fp32_logits = bool(getattr(verifier, "fp32_logits", True))
        self.argmax_only = reads_argmax(verifier)
        self.spec, self.batch, self.generator = spec, batch, generator
        self.device, dtype = model.device, model.dtype
        dev = self.device
        self.depth = spec.draft_len  # S: deepest accepted path
        self.max_new_tokens, self.eos_token_id = max_new_tokens, eos_token_id
        strategy.allocate(cfg, batch, spec, dev, dtype)
        call_len = max(prefill_len, strategy.max_call_len(spec))
        self.kv_capacity = kv_capacity
        self.kv = [KVCache(batch, cfg.n_kv_heads, cfg.attn_head_dim, kv_capacity, rows=strategy.max_rows(batch, spec),
                           max_new=call_len, device=dev, dtype=dtype) for _ in cfg.attention_layers]
        # token rows: prompt, emitted tokens; room for one step past the budget (masked writes stay in range)
        cap = prefill_len + max_new_tokens + spec.draft_len + 2
        self.buf = TokenBuffer(tokens=torch.zeros(batch, cap, dtype=torch.long, device=dev),
                               length=torch.zeros(batch, dtype=torch.long, device=dev),
                               prompt_len=torch.zeros(batch, dtype=torch.long, device=dev))
        self.pending = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) next token fed to the target
        self.seq_len = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) tokens folded into the state
        self.emitted = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) tokens emitted so far
        self.done = torch.zeros(batch, dtype=torch.bool, device=dev)  # (B,) finished (EOS or budget)
        self.report = torch.zeros(batch, 4 + self.depth, dtype=torch.long, device=dev)  # see _emit()
        self.ctx = RunContext(strategy=strategy, kv=self.kv, step=None)
        self.kv_bound = kv_capacity  # host bound on committed KV slots a call may read
        self.grow_bound = True  # eager runs: raise kv_bound by one step's tokens per step (host knowledge);
        # a captured step reads the whole capacity (its shapes are frozen at capture)
        self.drafts: DraftTree | None = None  # the drafts the target's step reads (static under graphs)
        # a drafter that reads the target's final hidden states (``wants_hidden``: the mtp drafter) is handed those
        # of the prompt (``prompt_hidden``, until Engine.prefill passes them on) and, every step, those of the
        # pending token and the accepted drafts (``observe_hidden``); without one the step computes what it did
        self.keep_hidden = bool(getattr(drafter, "wants_hidden", False))
        self.prompt_hidden: Tensor | None = None
        self.hidden: Tensor | None = None  # (rows, L, d) of the last verify forward, kept for such a drafter

    def cache_bytes(self) -> int:
        """Strategy state + KV caches of this run."""
        return self.strategy.cache_bytes() + sum(c.nbytes() for c in self.kv)

    # prefill --------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: Tensor, valid: Tensor) -> None:
        """Left-padded prompts ids, valid (B, T): set states and KV caches, pick the first token (eager)."""
        bsz, T = ids.shape
        dev = self.device
        pads = (~valid).sum(1)  # (B,)
        positions = (torch.arange(T, device=dev)[None] - pads[:, None]).clamp(min=0)
        self.ctx.step = StepInputs(input_ids=ids, positions=positions, valid=valid, prefill=True)
        for c in self.kv:
            c.length.zero_()
        hs = self.model.hidden(ids, self.ctx)  # (B, T, d)
        self.prompt_hidden = hs if self.keep_hidden else None
        head = self._head(hs[:, -1:])  # the LM head at the last position only: (B, 1, V) logits or (B, 1) argmax
        for c in self.kv:
            c.start.copy_(pads)
            c.commit(torch.arange(bsz, device=dev), torch.arange(T, device=dev)[None].expand(bsz, T),
                     torch.full((bsz,), T, device=dev, dtype=torch.long))
        first = self._verify(head, None).bonus  # (B,)
        # token rows hold each prompt from column 0 (no padding), then the first token
        n = valid.sum(1)
        col = torch.arange(T, device=dev)[None]
        src = (col + pads[:, None]).clamp(max=T - 1)  # prompt token k of row b sits at padded column pads + k
        self.buf.tokens[:, :T] = torch.where(col < n[:, None], ids.gather(1, src), 0)
        self.buf.prompt_len.copy_(n)
        self.buf.length.copy_(n)
        self.kv_bound = T if self.grow_bound else self.kv_capacity  # a captured step reads the whole cache
        self.seq_len.copy_(n)
        self.emitted.zero_()
        self.done.zero_()
        self._emit(None, None, torch.zeros_like(n), first, fold=False)  # the first token, pending from here

    @torch.no_grad()
    def start_synthetic(self, context: int, pending: Tensor, *, seed: int = 0) -> None:
        """Benchmark start: caches as if ``context`` tokens had been prefilled (KV contents random: a step's
        time does not depend on their values; SSM / conv states as allocated), ``pending`` (B,) next. The
        token rows hold random prompt tokens, then ``pending``; no token counts as emitted yet (the whole
        max_new_tokens budget is left for the timed steps)."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for c in self.kv:
            c.k[:, :, :context].normal_(generator=gen)
            c.v[:, :, :context].normal_(generator=gen)
            c.start.zero_()
            c.length.fill_(context)
        # as after a prefill: ``context`` prompt tokens, then the pending token (emitted, not yet fed)
        self.buf.tokens.random_(0, self.model.cfg.vocab_size, generator=gen)
        self.buf.prompt_len.fill_(context)
        self.buf.length.fill_(context + 1)
        self.buf.tokens[:, context] = pending
        self.seq_len.fill_(context)
        self.emitted.zero_()
        self.done.zero_()
        self.pending.copy_(pending)
        self.kv_bound = self.kv_capacity

    # one decode step ------------------------------------------------------------------------------
    def draft(self) -> DraftTree | None:
        """The drafter's proposal from the token buffer (device-side for on_device drafters)."""
        if self.drafter is None:
            return None
        if hasattr(self.drafter, "propose_device"):
            return self.drafter.propose_device(self.buf)
        return self.drafter.propose(self.buf.to_lists(), self.buf.pending())  # a duck-typed host drafter

    def set_drafts(self, drafts: DraftTree | None) -> None:
        """Drafts for the next ``target_step``: the first ones become the static inputs; later ones are copied
        into them (host drafters under a graph) or replace them (eager runs)."""
        self.drafts = drafts

    def copy_drafts(self, drafts: DraftTree) -> None:
        """Copy fresh drafts into the static ones a captured graph reads."""
        s = self.drafts
        s.tokens.copy_(drafts.tokens)
        if s.parents.data_ptr() != drafts.parents.data_ptr():  # chains share one constant layout (chain_layout)
            s.parents.copy_(drafts.parents)
        if s.q is not None:
            s.q.copy_(drafts.q)
        if s.match is not None:
            s.match.copy_(drafts.match)

    def forward(self) -> tuple[StepInputs, Tensor]:
        """Layout -> model: the verify forward of one step, (its StepInputs, what the verifier reads: logits
        (rows, L, V), or their argmax (rows, L) for an ``argmax_only`` verifier); the first half of
        ``target_step``, on its own so step-time benchmarks can time the model call alone."""
        step = self.strategy.layout(self.pending, self.drafts, self.seq_len)
        if self.grow_bound:
            self.kv_bound = min(self.kv_bound + self.spec.nodes + 1, self.kv_capacity)
        step.kv_bound = self.kv_bound
        self.ctx.step = step
        hidden = self.model.hidden(step.input_ids, self.ctx)
        if self.keep_hidden:  # the final hidden states (rows, L, d) kept for the drafter
            self.hidden = hidden
        return step, self._head(hidden)

    def _head(self, hidden: Tensor) -> Tensor:
        """The LM head on final hidden states (..., d) as the verifier reads it: the argmax (...,) in bounded
        chunks for an ``argmax_only`` verifier, else the logits (..., V) (fp32 unless the verifier only ranks)."""
        if self.argmax_only:
            return self.model.argmax(hidden)
        return self.model.logits(hidden, fp32=self.fp32_logits)

    def _verify(self, nodes: Tensor, drafts: DraftTree | None) -> Verdict:
        """The verdict on ``nodes`` ((B, 1+T) argmax or (B, 1+T, V) logits per tree node, as ``_head`` made them)."""
        if self.argmax_only:
            return self.verifier.verify_argmax(nodes, drafts)
        return self.verifier.verify(nodes, drafts, self.generator)

    def target_step(self) -> None:
        """Layout -> model -> verify -> commit -> append (device ops only; see module doc)."""
        drafts, strat = self.drafts, self.strategy
        step, head = self.forward()
        verdict = self._verify(step.gather_nodes(head), drafts)
        strat.commit(verdict, step)
        if self.kv:
            rows, cols = kv_source(step, verdict, self.batch)
            for c in self.kv:
                c.commit(rows, cols, verdict.accepted + 1)
        if self.drafter is not None:
            if self.keep_hidden:  # hidden states of the pending token and the accepted path (B, 1+S, d)
                nodes = step.gather_nodes(self.hidden)  # (B, 1+T, d)
                self.drafter.observe_hidden(nodes.gather(1, verdict.path[..., None].expand(-1, -1, nodes.shape[-1])))
            self.drafter.observe(verdict)
        tokens, path = (None, None) if drafts is None else (drafts.tokens, verdict.path)
        self._emit(tokens, path, verdict.accepted, verdict.bonus)

    def _emit(self, drafts: Tensor | None, path: Tensor | None, accepted: Tensor, bonus: Tensor, *,
              fold: bool = True) -> None:
        """Append the accepted drafts of ``path`` and the bonus to every unfinished row, stopping after EOS and at
        the budget; update the finished flags, the report (B, 4 + S: emitted tokens, -1 past the count; count;
        accepted; done), ``seq_len`` (``fold``) and the pending token: one launch (``ops/step_glue.emit``)."""
        emit(self.pending, drafts, path, accepted, bonus, tokens=self.buf.tokens, length=self.buf.length,
             emitted=self.emitted, done=self.done, seq_len=self.seq_len, report=self.report,
             max_new=self.max_new_tokens, eos=self.eos_token_id, fold=fold)

    def report_of(self, host: Tensor) -> Report:
        """Decode a host copy of ``report``."""
        rows = host.tolist()
        S = self.depth
        return Report(tokens=[r[:r[1 + S]] for r in rows], accepted=[r[2 + S] for r in rows],
                      done=[bool(r[-1]) for r in rows])


def kv_source(step: StepInputs, verdict: Verdict, bsz: int) -> tuple[Tensor, Tensor]:
    """Row and columns that hold each sequence's accepted tokens (pending token + accepted path)."""
    path = verdict.path  # (B, 1+Smax) node numbers
    cols = path if step.node_col is None else step.node_col.gather(1, path)
    if step.node_row is None:
        rows = torch.arange(bsz, device=path.device)
    else:
        rows = step.node_row.gather(1, verdict.last_node[:, None])[:, 0]
    return rows, cols
