"""Test-wide settings: nothing may reach the network, and torch uses one thread per process."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# One thread per test process: CI has two cores, and multi-process tests run several processes at once.
torch.set_num_threads(1)
