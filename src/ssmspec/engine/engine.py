"""Engine: builds a ``DecodeStep`` for one run and drives it -- eagerly, or captured once as CUDA graphs and
replayed. ``generate()`` and every step-time benchmark go through it, so what a benchmark times is the loop
users run.

    eng = Engine(model, batch=4, prefill_len=128, max_new_tokens=256, strategy="replay", drafter=d)
    eng.prefill(ids, valid)               # eager; sets states, KV caches and the first token
    while ...:
        eng.launch()                      # one step: drafts -> target step (graph replays after the first)
        rep = eng.collect()               # host copy of the previous step's report (non-blocking pipeline)

    samples_ms = eng.time_steps(warmup=3, iters=20)   # benchmarks: CUDA events around each replay

A drafter with ``speculate()`` (asynchronous speculation, ``drafting/async_draft.py``) fills its speculation
cache while the target verifies (``engine/speculate.py``): per launch the cache lookup, the backup only when a
row missed (a host decision), then the speculate graph on a side stream concurrently with the target's graph.

The first ``launch`` runs eagerly (on a side stream under CUDA: lazy initialisation, Triton compilation,
cuBLAS workspaces), then the drafter's graph and the target's graph are captured and every later launch
replays them. Each launch copies the step's small report into one of two pinned host buffers without
blocking; ``collect`` waits only for the step before the newest one, so the device always has the next step
queued while the host reads the last.
"""
from __future__ import annotations

import functools
import logging
import time

import torch
from torch import Tensor

from ssmspec.engine.graphs import capture_on
from ssmspec.engine.memory import check_fits, plan_bytes
from ssmspec.engine.speculate import Speculation
from ssmspec.engine.step import DecodeStep, Report, default_verifier
from ssmspec.models.model import HybridLM
from ssmspec.strategies import SpecConfig, StrategyBase, make_strategy
from ssmspec.verify.distributions import SamplingConfig

log = logging.getLogger("ssmspec.engine")


def _register(graph: torch.cuda.CUDAGraph, gens) -> None:
    """Let a graph advance the philox offsets of the custom generators it draws from (else every replay
    would repeat the captured random numbers). Each is registered with its own GPU current: torch keeps a
    registered generator's seed and offset for the graph in two tensors made on the current device, and refills
    them there at every replay, on that device's current stream. Registered while the target's GPU was current, the
    draft GPU's graphs read their offsets across the devices, unordered with the refill: on a loaded machine (a
    second pytest worker on both GPUs; torch 2.11, two H200s) sampled runs with the draft on cuda:1 drew an earlier
    round's random numbers again in 4 of 4 runs, and in 0 of 6 registered on the draft's GPU."""
    for g in gens:
        if g is None or g.device.type != "cuda":
            continue
        if not hasattr(graph, "register_generator_state"):
            raise RuntimeError("this torch cannot capture draws from a custom CUDA generator in a graph "
                               "(CUDAGraph.register_generator_state is missing); run eagerly (cuda_graph=False)")
        with torch.cuda.device(g.device):  # its per-graph offsets live on the current device (docstring)
            graph.register_generator_state(g)


def _on_its_gpu(method):
    """Run an ``Engine`` method with the engine's GPU as the current device: Triton launches its kernels on the
    current device's stream and ``torch.cuda.graph`` captures on one, so without this a model on cuda:1 with
    cuda:0 current launched its kernels on the wrong GPU. Nothing to switch on the CPU or when it is current."""
    @functools.wraps(method)
    def on_its_gpu(self, *args, **kwargs):
        if not self.cuda:
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.model.device):
            return method(self, *args, **kwargs)
    return on_its_gpu


class Engine:
    """One run's decode step and its driver (module doc)."""

    def __init__(self, model: HybridLM, *, batch: int, prefill_len: int, max_new_tokens: int,
                 strategy: str | StrategyBase = "autoregressive", drafter=None, verifier=None,
                 sampling: SamplingConfig = SamplingConfig(), spec: SpecConfig | None = None,
                 eos_token_id: int | None = None, cuda_graph: bool | None = None,
                 kv_capacity: int | None = None, prefill: bool = True) -> None:
        cfg = model.cfg
        self.model = model
        strat = make_strategy(strategy) if isinstance(strategy, str) else strategy
        if spec is None:
            spec = drafter.spec if drafter is not None else SpecConfig()
        if drafter is None and spec.draft_len:
            raise ValueError("draft_len > 0 needs a drafter")
        if drafter is not None and hasattr(drafter, "check_target"):
            drafter.check_target(cfg)  # a draft model the target cannot verify is refused before anything runs
        strat.check_spec(spec)
        if batch < 1 or prefill_len < 1 or max_new_tokens < 1:
            raise ValueError(f"need batch, prefill_len and max_new_tokens >= 1, got {batch}, {prefill_len}, "
                             f"{max_new_tokens}")
        dev = model.device
        self.cuda = dev.type == "cuda"
        self.graphed = self.cuda if cuda_graph is None else bool(cuda_graph)
        if self.graphed and not self.cuda:
            raise ValueError("cuda_graph=True needs the model on a CUDA device; use cuda_graph=False on CPU")
        need = prefill_len + max_new_tokens + spec.nodes + 1  # the last step may append a whole window
        if kv_capacity is None:
            kv_capacity = need
        if cfg.attention_layers and kv_capacity > cfg.max_seq_len:
            raise ValueError(f"prompt of {prefill_len} tokens + {max_new_tokens} new tokens (+{spec.nodes + 1} per "
                             f"step in flight) needs {kv_capacity} KV slots but {cfg.name} allocates max_seq_len="
                             f"{cfg.max_seq_len}; shorten the prompt, lower max_new_tokens, or raise model.max_seq_len")
        verifier = verifier if verifier is not None else default_verifier(spec, sampling)
        parts = plan_bytes(cfg, strat, batch=batch, spec=spec, kv_capacity=kv_capacity, prefill_len=prefill_len,
                           dtype=model.dtype, prefill=prefill,  # prefill False: start_synthetic only
                           verifier=verifier)
        self.planned_bytes = check_fits(parts, dev, what=f"a run of {cfg.name} at batch {batch} with {prefill_len} "
                                        f"prompt + {max_new_tokens} new tokens ({strat.name})",
                                        fix="lower the batch, the context or max_new_tokens")
        self.generator = torch.Generator(device=dev).manual_seed(sampling.seed)
        self.step = DecodeStep(model, strat, batch=batch, spec=spec, drafter=drafter, verifier=verifier,
                               generator=self.generator, kv_capacity=kv_capacity, prefill_len=prefill_len,
                               max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        self.strategy, self.drafter, self.verifier, self.spec = strat, drafter, verifier, spec
        self.launches = 0
        self.loop_wall_ms: float | None = None  # wall-clock ms of the last time_steps loop
        self.draft_seconds: list[float] = []  # drafting time of every collected step (CUDA events / perf_counter)
        self.speculation = Speculation(drafter, dev, cuda=self.cuda) if callable(getattr(drafter, "speculate", None)) \
            else None  # asynchronous speculation (module doc)
        self._graphs: tuple | None = None  # (draft graph or None, target graph) once captured
        self._inflight: list = []  # launched steps not collected yet: (host report, done event, timing events)
        if self.cuda:
            self._host = [torch.empty(self.step.report.shape, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._stream = torch.cuda.Stream(dev)

    @property
    def drafter_on_device(self) -> bool:
        return self.drafter is None or bool(getattr(self.drafter, "on_device", False))

    def cache_bytes(self) -> int:
        return self.step.cache_bytes()

    # start -----------------------------------------------------------------------------------------
    @_on_its_gpu
    @torch.no_grad()
    def prefill(self, ids: Tensor, valid: Tensor, prompts: list[list[int]] | None = None) -> Report:
        """Left-padded prompts (B, T) -> first token of every sequence (eager; returns its report)."""
        self.step.grow_bound = not self.graphed
        self.step.prefill(ids, valid)
        if self.drafter is not None:
            if prompts is None:  # the valid tokens of each row, wherever the padding is
                prompts = [[t for t, v in zip(row, keep) if v] for row, keep in zip(ids.tolist(), valid.tolist())]
            # the token buffer is sized for the padded width; a drafter sizes its KV cache for its longest prompt,
            # so the padding every prompt is short of the width joins its budget of new tokens
            pad = ids.shape[1] - max((len(p) for p in prompts), default=ids.shape[1])
            self.drafter.reset(prompts, batch=ids.shape[0], device=ids.device,
                               max_new_tokens=self.step.max_new_tokens + pad)
            if self.step.keep_hidden:  # the drafter reads the prompt's hidden states (the mtp drafter)
                self.drafter.observe_prompt(ids, valid, self.step.prompt_hidden)
                self.step.prompt_hidden = None
        return self.step.report_of(self.step.report.cpu())

    @_on_its_gpu
    @torch.no_grad()
    def start_synthetic(self, context: int, pending: Tensor) -> None:
        """Benchmarks: caches as if ``context`` tokens had been prefilled (``DecodeStep.start_synthetic``)."""
        self.step.grow_bound = not self.graphed
        self.step.start_synthetic(context, pending)
        if self.drafter is not None:
            self.drafter.reset(self.step.buf.to_lists(), batch=self.step.batch, device=self.model.device,
                               max_new_tokens=self.step.max_new_tokens)

    # steps -----------------------------------------------------------------------------------------
    def _eager(self) -> None:
        self.draft_part()
        self.target_part()

    def draft_part(self) -> None:
        """An eager step's drafting: the speculation cache's draft, or ``step.draft`` into ``set_drafts``."""
        s = self.step
        if self.speculation is not None:
            self.speculation.draft(s)
        else:
            s.set_drafts(s.draft())

    def target_part(self) -> None:
        """An eager step's target step (under the speculation cache, overlapped with its speculation)."""
        s = self.step
        if self.speculation is not None:
            self.speculation.overlap(s.target_step)
        else:
            s.target_step()

    def draft_ms(self) -> list[float]:
        """ms of drafting in every step the last ``time_steps`` timed (0 without a drafter): the drafter's
        graph replay (or its eager call), measured by the same events as the step (``Engine.time_steps``)."""
        return [s * 1e3 for s in self.draft_seconds]

    def _capture(self) -> None:
        s, gens = self.step, list(getattr(self.drafter, "generators", lambda: [])())
        draft_graph = None
        if self.speculation is not None:  # lookup, backup and speculate graphs (engine/speculate.py)
            draft_graph = self.speculation.capture(s, _register)
        elif self.drafter is not None and self.drafter_on_device:
            draft_graph = torch.cuda.CUDAGraph()
            _register(draft_graph, gens)
            with capture_on(draft_graph, self.model.device):
                s.set_drafts(s.draft())
        target_graph = torch.cuda.CUDAGraph()
        _register(target_graph, [self.generator])
        with capture_on(target_graph, self.model.device):
            s.target_step()
        self._graphs = (draft_graph, target_graph)

    @_on_its_gpu
    @torch.no_grad()
    def launch(self) -> None:
        """Queue one decode step (see module doc); never waits for the device except on the first call and,
        with a speculating drafter, on its one backup flag a step (``engine/speculate.py``).
        Reports go to two pinned buffers in turn: call ``collect(keep=1)`` after every launch (at most two
        steps in flight), as generate() and time_steps() do."""
        s = self.step
        if self.cuda:
            start, mid = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        if not self.graphed:
            self.draft_part()
            t_mid = mid.record() if self.cuda else time.perf_counter()
            self.target_part()  # with a speculating drafter: speculate, then the target (the overlapped streams)
        elif self._graphs is None:  # first step: eager on a side stream, then capture (not executed)
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._eager()
            torch.cuda.current_stream().wait_stream(self._stream)
            torch.cuda.synchronize()
            mid.record()  # the first step's drafting is not split from its target step (it is untimed warmup)
            try:
                self._capture()
            except RuntimeError as e:  # a host sync or CPU tensor inside the step: name the fix
                raise RuntimeError(f"the decode step could not be captured as a CUDA graph ({str(e).splitlines()[0]}); "
                                   f"something in the drafter, verifier or strategy waits on the host (.item(), "
                                   f".tolist(), float(tensor), a data-dependent shape) -- remove it, or run "
                                   f"eagerly with cuda_graph=False") from e
        else:
            draft_graph, target_graph = self._graphs
            if self.speculation is not None:  # lookup, and the backup when a row missed
                self.speculation.replay_draft(draft_graph)
            elif draft_graph is not None:
                draft_graph.replay()
            elif self.drafter is not None:  # host drafter: eager drafts into the graph's static inputs
                s.copy_drafts(s.draft())
            mid.record()
            if self.speculation is not None:  # the draft speculates on a side stream while the target verifies
                self.speculation.overlap(target_graph.replay)
            else:
                target_graph.replay()
        self.strategy.after_step()  # host-launched work after the step, outside the graphs (usually none)
        self.launches += 1
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            host = self._host[self.launches % 2]
            host.copy_(s.report, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._inflight.append((host, done, (start, mid, end)))
        else:
            now = time.perf_counter()
            self._inflight.append((s.report.clone(), None, (now - t0, t_mid - t0)))

    def collect(self, *, keep: int = 1) -> list[tuple[Report, float]]:
        """Reports of launched steps, oldest first, leaving the newest ``keep`` in flight (0: all). Each
        comes with its step's time in seconds (CUDA events; perf_counter on CPU)."""
        out = []
        while len(self._inflight) > keep:
            host, done, timing = self._inflight.pop(0)
            if done is not None:
                done.synchronize()
                seconds = timing[0].elapsed_time(timing[2]) * 1e-3
                drafting = timing[0].elapsed_time(timing[1]) * 1e-3
            else:
                seconds, drafting = timing
            self.draft_seconds.append(drafting)
            out.append((self.step.report_of(host), seconds))
        return out

    @_on_its_gpu
    @torch.no_grad()
    def time_steps(self, *, warmup: int, iters: int) -> list[float]:
        """ms per decode step: ``warmup`` untimed steps (the first one captures the graphs), then ``iters``
        steps, each timed with CUDA events (perf_counter on CPU). Steps are real: caches grow. The host reads
        each report one step late (as generate() does), so the device never waits for it; the accepted
        counts of the timed steps are kept in ``self.accepted`` (one list per step), and the wall-clock time of
        the whole timed loop (first launch to the last report on the host) in ``self.loop_wall_ms``: where it
        exceeds the samples' sum, the device sat idle between steps (host work the events do not see); the
        drafting part of every timed step in ``draft_ms()``."""
        if iters < 1 or warmup < 0:
            raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
        for _ in range(max(warmup, 1 if self.graphed else 0)):
            self.launch()
            self.collect(keep=1)
        self.collect(keep=0)
        if self.cuda:
            torch.cuda.synchronize(self.model.device)
        t0 = time.perf_counter()
        samples, self.accepted, self.draft_seconds = [], [], []
        for _ in range(iters):
            self.launch()
            for rep, seconds in self.collect(keep=1):
                samples.append(seconds * 1e3)
                self.accepted.append(rep.accepted)
        for rep, seconds in self.collect(keep=0):
            samples.append(seconds * 1e3)
            self.accepted.append(rep.accepted)
        self.loop_wall_ms = (time.perf_counter() - t0) * 1e3
        return samples
