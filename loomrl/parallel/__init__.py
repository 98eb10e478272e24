"""loomrl.parallel: data and tensor parallelism applied from outside to plain HF models, and their communicators.

- :class:`Layout`, :func:`check_layout`: the parallel degrees of a role and whether they fit a model;
- :class:`AllocationGroups`: the one registry of a worker's communicators, per allocation of the plan;
- :func:`apply_tensor_parallel`: DTensor tensor parallelism for Llama and Qwen2;
- :func:`apply_fsdp`: FSDP2 full sharding of a trained role over its data-parallel group;
- :func:`sync_gradients`: summed (not averaged) data-parallel gradients;
- :func:`full_state_dict`, :func:`load_full_state_dict`: unsharded weights in and out;
- :func:`execute_reallocation`: runs a :class:`loomrl.plan.realloc_plan.ReallocPlan` (planned without torch in
  :mod:`loomrl.plan`) with batched point-to-point and broadcasts.

Gradient clipping (:func:`loomrl.parallel.pipeline_runner.clip_grads`) takes ``torch.nn.utils.get_total_norm``
of the gradients, which completes the norms of DTensor shards over their mesh, sums the squares over the
pipeline stages, and after :func:`sync_gradients` every DP rank holds the same gradients, hence the same norm.
A 16-bit parameter of a trained role keeps its gradient in fp32 (:mod:`loomrl.parallel.main_grad`); both
read gradients through :func:`~loomrl.parallel.main_grad.grad_of`.
"""

from loomrl.parallel.allocations import AllocationGroups
from loomrl.parallel.data_parallel import local_shard, sync_gradients
from loomrl.parallel.fsdp import apply_fsdp
from loomrl.parallel.full_state import full_state_dict, load_full_state_dict
from loomrl.parallel.realloc_exec import ReallocVerificationError, build_broadcast_groups, execute_reallocation
from loomrl.parallel.tensor_parallel import apply_tensor_parallel
from loomrl.plan.layout import TP_ARCHITECTURES, Layout, check_layout

__all__ = [
    "AllocationGroups",
    "ReallocVerificationError",
    "TP_ARCHITECTURES",
    "Layout",
    "apply_fsdp",
    "apply_tensor_parallel",
    "build_broadcast_groups",
    "execute_reallocation",
    "check_layout",
    "full_state_dict",
    "load_full_state_dict",
    "local_shard",
    "sync_gradients",
]
