"""Mamba-2 sequence scan (prefill): chunked SSD form. The pure-PyTorch chunk scan serves CPU and GPU
prefill; decode-time kernels live in their own op folders."""
from ssmspec.ops.ssd.naive import ssd_chunk_scan_ref, ssm_recurrence_ref

ssd_chunk_scan = ssd_chunk_scan_ref

__all__ = ["ssd_chunk_scan", "ssd_chunk_scan_ref", "ssm_recurrence_ref"]
