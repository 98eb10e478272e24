"""loomrl.workflow: an RLHF algorithm described as a validated graph of model function calls (MFCs)."""

from loomrl.workflow.graph import MFC, MFCKind, Workflow

__all__ = ["MFC", "MFCKind", "Workflow"]
