"""ssmspec's Hydra launcher ``gpu_queue``: a multirun's jobs as a queue of ``ssmspec run`` subprocesses,
one per GPU (``hydra/launcher=gpu_queue``). See launcher.py; the queue itself is gpu_queue.py."""
