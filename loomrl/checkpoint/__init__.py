"""loomrl.checkpoint: atomic, resumable, layout-independent checkpoints of a run.

- :mod:`loomrl.checkpoint.store`: the checkpoint directory (written aside, checksummed, renamed into place),
  ``latest``, pruning, loading and export to Hugging Face form;
- :mod:`loomrl.checkpoint.shards`: sharded checkpoints, each process writing the pieces of a trained role it owns;
- :mod:`loomrl.checkpoint.optim_state`: optimizer state in the full, parameter-name-keyed form.
"""
