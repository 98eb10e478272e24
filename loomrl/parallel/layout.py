"""Layouts are plan data (:mod:`loomrl.plan.layout`); re-exported here for the code that applies them."""

from loomrl.plan.layout import TP_ARCHITECTURES, Layout, check_layout

__all__ = ["TP_ARCHITECTURES", "Layout", "check_layout"]
