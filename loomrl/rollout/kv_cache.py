"""A slot-addressed KV cache for continuous batching, plugged into HF attention through the Cache interface.

transformers' DynamicCache grows every sequence of a batch together (one length for all rows, a concatenation
per step), and its continuous-batching manager samples with its own RNG, which would break per-sample random
streams. This cache preallocates ``slots × max_len`` keys and values per layer, writes each row's new entries
at that row's own positions, and hands the attention the rows' keys up to the longest live length; the
engine passes a 4-D additive mask (``position <= query position``), which HF attention uses as given. Memory
is allocated once; a finished sample frees its slot without touching the others.

Legend: S = slots, H = KV heads, M = max sequence length, D = head dim, B = rows in this forward, Q = query len.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import Cache


class SlotKVCache(Cache):
    """Per-layer ``S×H×M×D`` key/value buffers; :meth:`bind` selects the slots and positions of one forward."""

    def __init__(self, slots: int, max_len: int):
        super().__init__(layers=[])
        self.slots, self.max_len = slots, max_len
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._rows_B: torch.Tensor | None = None
        self._pos_BQ: torch.Tensor | None = None
        self._kv_len = 0
        self._contiguous = False

    def bind(self, rows: Sequence[int], pos_BQ: torch.Tensor, kv_len: int) -> None:
        """The next forward writes row b's Q new entries at ``pos_BQ[b]`` of slot ``rows[b]``. The slots come as
        host integers: deciding the forward's path from device values would make an accelerator wait for the
        host each step."""
        rows = list(rows)
        self._rows_B = torch.tensor(rows, dtype=torch.long, device=pos_BQ.device)
        self._pos_BQ, self._kv_len = pos_BQ, kv_len
        # Rows 0..n-1 in order are a plain slice of the buffers: no gather needed.
        self._contiguous = bool(rows) and rows == list(range(len(rows)))

    def _allocate(self, like_BHQD: torch.Tensor) -> None:
        _, heads, _, dim = like_BHQD.shape
        shape = (self.slots, heads, self.max_len, dim)
        self.keys.append(torch.zeros(shape, dtype=like_BHQD.dtype, device=like_BHQD.device))
        self.values.append(torch.zeros(shape, dtype=like_BHQD.dtype, device=like_BHQD.device))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            self._allocate(key_states)
        rows_B, pos_BQ = self._rows_B, self._pos_BQ
        k_SHMD, v_SHMD = self.keys[layer_idx], self.values[layer_idx]
        # Advanced indices around a slice put the indexed dims first: the target is B×Q×H×D.
        k_SHMD[rows_B[:, None], :, pos_BQ] = key_states.transpose(1, 2)
        v_SHMD[rows_B[:, None], :, pos_BQ] = value_states.transpose(1, 2)
        if self._contiguous:
            n = rows_B.shape[0]
            return k_SHMD[:n, :, : self._kv_len], v_SHMD[:n, :, : self._kv_len]
        return k_SHMD[rows_B, :, : self._kv_len], v_SHMD[rows_B, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` entries of slot ``src`` to slot ``dst`` (compaction)."""
        self.copy_slot(src, dst, length)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` entries of slot ``src`` to slot ``dst`` (a shared prompt's prefill)."""
        for k_SHMD, v_SHMD in zip(self.keys, self.values):
            k_SHMD[dst, :, :length] = k_SHMD[src, :, :length]
            v_SHMD[dst, :, :length] = v_SHMD[src, :, :length]

    def save_slot(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the first ``length`` entries of ``slot`` (per layer: keys H×length×D, values alike)."""
        return [(k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in zip(self.keys, self.values)]

    def restore_slot(self, slot: int, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write entries saved by :meth:`save_slot` back, into ``slot`` (any slot)."""
        for (k, v), (k_SHMD, v_SHMD) in zip(saved, zip(self.keys, self.values)):
            k_SHMD[slot, :, : k.shape[1]] = k
            v_SHMD[slot, :, : v.shape[1]] = v


def causal_slot_mask(pos_BQ: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive B×1×Q×K mask letting query (b, q) see keys at positions ``<= pos_BQ[b, q]``."""
    keys_K = torch.arange(kv_len, device=pos_BQ.device)
    allowed_BQK = keys_K[None, None, :] <= pos_BQ[:, :, None]
    mask = torch.zeros(allowed_BQK.shape, dtype=dtype, device=pos_BQ.device)
    return mask.masked_fill_(~allowed_BQK, torch.finfo(dtype).min)[:, None]
