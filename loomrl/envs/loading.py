"""Environments by name: a built-in, ``'module:Class'`` or ``'path/to/file.py:Class'``, as reward functions are
named."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from loomrl.data.reward_functions import import_attribute
from loomrl.envs.base import Environment
from loomrl.envs.builtin import BUILTIN_ENVIRONMENTS
from loomrl.errors import DataError


@functools.cache
def load_environment(spec: str) -> Callable[[], Environment]:
    """The class (a factory of fresh environments) that ``spec`` names: a built-in (:data:`BUILTIN_ENVIRONMENTS`),
    ``'module:Class'`` or ``'path/to/file.py:Class'``; a one-line :class:`~loomrl.errors.DataError` otherwise."""
    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec]
    if ":" not in spec:
        raise DataError(
            f"environment '{spec}': not a built-in ({', '.join(BUILTIN_ENVIRONMENTS)}) nor of the form "
            "'module:Class' or 'file.py:Class'"
        )
    cls = import_attribute(spec, "environment", "Class")
    module_name, _, attr = spec.rpartition(":")
    if cls is None:
        raise DataError(f"environment '{spec}': module '{module_name}' has no class '{attr}'")
    has = {name for name in ("reset", "step", "run") if callable(getattr(cls, name, None))}
    if not inspect.isclass(cls) or "reset" not in has or not has & {"step", "run"}:
        missing = " and no ".join(n for n in ("reset", "step") if n not in has)
        what = "is not a class" if not inspect.isclass(cls) else f"has no {missing} method"
        raise DataError(
            f"environment '{spec}': '{attr}' {what} (an environment has reset(row) and step(text); an agent "
            "reset(row) and run(base_url, messages))"
        )
    return cls


def is_agent(factory: Callable[[], object]) -> bool:
    """Whether an environment class is an agent (:class:`~loomrl.envs.base.Agent`): it drives its episode through
    the rollout endpoint (``run``) rather than answering turns (``step``)."""
    return callable(getattr(factory, "run", None)) and not callable(getattr(factory, "step", None))
