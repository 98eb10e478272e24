"""loomrl.models: tokenizers, a zoo of tiny HF architectures, per-token heads over HF models, and the published
architectures the planner prices (:mod:`loomrl.models.presets`).

Plain single-process PyTorch: parallelism is applied to these models from ``loomrl.parallel``, never here.
"""
