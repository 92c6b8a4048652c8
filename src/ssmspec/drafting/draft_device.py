"""Where a draft model runs: the target's device (``None``: the one-GPU mode, its own CUDA stream) or a device of
its own (``draft_device``: e.g. ``cuda:1``, the draft on a second GPU; seed 002's setting).

``resolve_draft_device`` checks a requested device before anything is allocated and names the fix when it cannot
run: a malformed name, a GPU this machine does not have (or that CUDA_VISIBLE_DEVICES hides), a CUDA draft for a CPU
target or the reverse. Naming the target's own CPU is allowed: the drafter then runs its two-device path (every
transfer) on one device -- what the CPU tests use to check the transfers. Naming the target's own GPU is refused:
that path orders its streams through cross-device copies, which fence the streams of both devices, and a copy
within one GPU fences only one (the drafter checks when it starts, ``AsyncDraft.reset``; benches before they time,
``bench/saguaro_e2e.remote_drafts``).
"""
from __future__ import annotations

import torch

SAME = (None, "same", "null", "none")  # spellings of "the target's device" (Hydra configs may write null or same)


def parse_draft_device(spec) -> torch.device | None:
    """``spec`` (None / 'same' / a device name) -> None or a torch.device; a name that is no device fails."""
    if spec is None or (isinstance(spec, str) and spec.lower() in SAME[1:]):
        return None
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"draft_device must name a device such as cuda:1 (or null: the target's GPU, the draft "
                         f"on its own stream), got {spec!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"draft_device {spec!r}: only cpu and cuda devices can run a draft")
    if dev.type == "cuda":
        if dev.index is None:
            raise ValueError(f"draft_device {spec!r}: name the GPU, e.g. cuda:1")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dev.index >= count:
            have = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
            raise ValueError(f"draft_device {dev} does not exist: this machine has {count} visible CUDA device(s) "
                             f"({have}); set draft_device=null to draft on the target's GPU (its own stream), or "
                             f"run where a second GPU is visible")
    return dev


def resolve_draft_device(spec, target: torch.device) -> torch.device | None:
    """The draft's device for a target on ``target`` (None: the target's device, no transfers)."""
    dev, target = parse_draft_device(spec), torch.device(target)
    if dev is not None and dev.type != target.type:
        raise ValueError(f"draft_device {dev} cannot serve a target on {target}: the draft and the target must both "
                         f"be CUDA devices (or both CPU); set draft_device=null")
    if dev is not None and dev.type == "cuda":
        index = target.index if target.index is not None else torch.cuda.current_device()
        if dev.index == index:
            raise ValueError(f"draft_device {dev} is the target's own GPU: set draft_device=null there (the draft on "
                             f"its own stream of that GPU) or name a second GPU; the transfer path orders its streams "
                             f"through cross-device copies, which one GPU does not have")
    return dev
