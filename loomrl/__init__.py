"""loomrl: RLHF / RL-for-LLM training as a dataflow of model function calls.

An algorithm is a workflow (a graph of model function calls, MFCs); an execution plan says where and how
each call runs; an executor runs the plan. See docs/architecture.md.
"""

__version__ = "0.1.0"
