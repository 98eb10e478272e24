"""loomrl.role: a role's model on this process, from its spec to the passes the ops ask for.

- :class:`RoleSpec`, :func:`role_specs`: what a process needs to build a role (from the trainer's config);
- :func:`build_model`, :func:`make_role`, :func:`adamw`: the model, its optimizer and the :class:`Role`;
- :class:`ModelPasses`: forward and backward passes of a whole model, a pipeline stage or a data-parallel or
  FSDP shard, and the gradients' sum and clipping (the ops' only way to run a model);
- :func:`resolve_device`, :func:`resolve_dtype`: the ``device`` and ``precision`` settings resolved.

Below both the trainer and the runtime: the reference executor and the workers build roles alike.
"""

from loomrl.role.build import adamw, build_model, make_role
from loomrl.role.devices import resolve_device, resolve_dtype, set_threads
from loomrl.role.passes import ModelPasses
from loomrl.role.spec import RoleSpec, role_specs

__all__ = [
    "ModelPasses",
    "RoleSpec",
    "adamw",
    "build_model",
    "make_role",
    "resolve_device",
    "resolve_dtype",
    "role_specs",
    "set_threads",
]
