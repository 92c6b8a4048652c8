"""Kernels, one folder per op: ``naive.py`` is the fp32 per-token ground truth, Triton files sit beside
it, and the public function of each op dispatches Triton on CUDA (or under TRITON_INTERPRET=1) and the
reference elsewhere (see ``dispatch.use_triton``)."""
