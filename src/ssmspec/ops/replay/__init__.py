"""ReplaySSM (seed 000): checkpoint state + ring buffer of recent inputs, output-only decode and verify.
The public functions dispatch to Triton once the kernels land; the reference serves every device now."""
from ssmspec.ops.replay.naive import replay_commit, replay_flush_flags, replay_verify_ref

replay_verify = replay_verify_ref

__all__ = ["replay_commit", "replay_flush_flags", "replay_verify", "replay_verify_ref"]
