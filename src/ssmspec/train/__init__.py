"""Offline training of small model pairs (issue 24): corpus (the stdlib's Python sources), byte-level BPE,
a differentiable forward through the model's strategy hook, the training loop, distillation of drafts,
export to Hugging Face checkpoint directories and a cache keyed by (corpus hash, config, seed).

``python -m ssmspec train`` (``train/command.py``) runs it; README "Training model pairs offline".
"""
