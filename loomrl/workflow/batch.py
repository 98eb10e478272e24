"""The data that flows between model function calls, one row per sample.

A :class:`Batch` maps keys (the names MFCs declare as inputs and outputs) to per-sample values: a Python list
with one item per sample (token id lists of varying length) or a tensor whose first dimension is the sample.
Per-token tensors are *response-aligned* and right-padded: column ``t`` is response token ``t``, and ``mask``
marks the real ones. Rows carry stable sample ids, so a batch can be split across devices and put back
together in any order without changing what any sample means.

Legend: B = samples, R = response tokens (right-padded), L = prompt + response tokens (right-padded).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


class Batch:
    """Per-sample columns keyed by name, with one stable id per row."""

    def __init__(self, ids: Sequence[int], data: Mapping[str, Any] | None = None):
        self.ids = list(ids)
        self._data: dict[str, Any] = {}
        if data:
            self.update(data)

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def keys(self) -> list[str]:
        return list(self._data)

    def update(self, columns: Mapping[str, Any]) -> None:
        for key, value in columns.items():
            rows = value.shape[0] if isinstance(value, torch.Tensor) else len(value)
            if rows != len(self.ids):
                raise ValueError(f"column '{key}' has {rows} rows, batch has {len(self.ids)}")
            self._data[key] = value

    def as_dict(self) -> dict[str, Any]:
        """The columns as a plain dict (a shallow copy)."""
        return dict(self._data)

    def columns(self, keys: Iterable[str]) -> Batch:
        """The same rows restricted to ``keys``, sharing storage (no copy)."""
        out = Batch(self.ids)
        out._data = {key: self._data[key] for key in keys}
        return out

    def select(self, rows: Sequence[int], keys: Iterable[str] | None = None) -> Batch:
        """The given rows (positions, not ids), optionally only some keys."""
        index = torch.tensor(list(rows), dtype=torch.long)
        out = Batch([self.ids[r] for r in rows])
        for key in self._data if keys is None else keys:
            value = self._data[key]
            if isinstance(value, torch.Tensor):
                out._data[key] = value.index_select(0, index.to(value.device))
            else:
                out._data[key] = [value[r] for r in rows]
        return out

    @staticmethod
    def concat(parts: Sequence[Batch]) -> Batch:
        """Rows of all parts in order; 2-D tensors are right-padded with zeros to the widest part."""
        out = Batch([i for p in parts for i in p.ids])
        for key in parts[0].keys():
            values = [p[key] for p in parts]
            if isinstance(values[0], torch.Tensor):
                if values[0].dim() == 2:
                    width = max(v.shape[1] for v in values)
                    values = [torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in values]
                out._data[key] = torch.cat(values, dim=0)
            else:
                out._data[key] = [x for v in values for x in v]
        return out


def response_tokens(batch: Batch) -> list[int]:
    """Tokens per sample that train MFCs weight their losses by: the response's sampled tokens (its ``mask``'s,
    which a multi-turn episode's observation tokens are not; the response length without a mask column; 1 per row
    without a response)."""
    if "mask" in batch:
        return [int(n) for n in (batch["mask"] != 0).sum(dim=1).tolist()]
    if "response_ids" in batch:
        return [len(r) for r in batch["response_ids"]]
    return [1] * len(batch)


def pad_right(
    rows: Sequence[Sequence[float]], value: float = 0.0, dtype=torch.float32, width: int | None = None
) -> torch.Tensor:
    """A list of variable-length rows as a right-padded B×R tensor."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), value, dtype=dtype)
    for b, r in enumerate(rows):
        if len(r):
            out[b, : len(r)] = torch.tensor(list(r), dtype=dtype)
    return out


def pack_sequences(
    prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+response sequences: (input_ids_BL, attention_mask_BL, prompt_len_B)."""
    seqs = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
    ids_BL = pad_right(seqs, pad_id, torch.long).to(device)
    mask_BL = pad_right([[1] * len(s) for s in seqs], 0, torch.long).to(device)
    prompt_len_B = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long, device=device)
    return ids_BL, mask_BL, prompt_len_B


def response_columns(x_BN: torch.Tensor, prompt_len_B: torch.Tensor, width: int) -> torch.Tensor:
    """Response-aligned view of a next-token quantity: column t is position prompt_len - 1 + t.

    Works for log-probs (B×(L-1), position j scores token j+1), for values (B×L, the value of the state
    before response token t) and for per-position vectors (B×L×X: logits, hidden states, which keep their
    trailing dim); positions past the sequence are clamped and must be masked by the caller.
    """
    idx_BR = (prompt_len_B[:, None] - 1 + torch.arange(width, device=x_BN.device)[None, :]).clamp(max=x_BN.shape[1] - 1)
    if x_BN.dim() == 3:
        idx_BR = idx_BR[:, :, None].expand(-1, -1, x_BN.shape[2])
    return x_BN.gather(1, idx_BR)


def pad_columns(x_BR: torch.Tensor, width: int) -> torch.Tensor:
    """Response-aligned outputs right-padded with zeros to ``width`` columns (a batch's response width, which
    a micro-batch's own may fall short of)."""
    if x_BR.shape[1] >= width:
        return x_BR
    return torch.nn.functional.pad(x_BR, (0, 0) * (x_BR.dim() - 2) + (0, width - x_BR.shape[1]))


def row_ends(attn_BL: torch.Tensor) -> torch.Tensor:
    """end_B: one past the last attended position of each right-padded row (0 for an all-padding row)."""
    return (attn_BL * torch.arange(1, attn_BL.shape[1] + 1, device=attn_BL.device)).amax(1)


def response_width(attn_BL: torch.Tensor, prompt_len_B: torch.Tensor) -> int:
    """The longest response part of right-padded rows (tokens after the prompt; at least 1): the width of
    their response-aligned outputs."""
    end_B = row_ends(attn_BL)
    return max(int((end_B - prompt_len_B.to(end_B.device)).max()), 1) if len(end_B) else 1


def response_mask(response_ids: Sequence[Sequence[int]], width: int | None = None) -> torch.Tensor:
    """1.0 on real response tokens, 0.0 on padding, shape B×R."""
    return pad_right([[1.0] * len(r) for r in response_ids], 0.0, torch.float32, width)


def micro_batch_slices(rows: int, micro_batches: int) -> list[slice]:
    """Contiguous row ranges of ``micro_batches`` near-equal micro-batches (sizes differ by at most one)."""
    if not 1 <= micro_batches <= rows:
        raise ValueError(f"micro_batches must be between 1 and the number of rows ({rows}), got {micro_batches}")
    base, extra = divmod(rows, micro_batches)
    slices, start = [], 0
    for k in range(micro_batches):
        stop = start + base + (1 if k < extra else 0)
        slices.append(slice(start, stop))
        start = stop
    return slices


PADDED_SPLIT_MAX_ROWS = 1024
"""Above this many rows :func:`padded_micro_batch_slices` cuts near-equal micro-batches (its search is quadratic in
the rows; with that many rows sorted by length, equal counts pad little anyway)."""


def padded_micro_batch_slices(lengths: Sequence[int], micro_batches: int) -> list[slice]:
    """Contiguous row ranges of ``micro_batches`` non-empty micro-batches of rows sorted by ``lengths``
    (ascending), cut where they compute the fewest tokens, each padded to its own longest row: the sum over
    micro-batches of rows × longest length (verl's dynamic batch size and OpenRLHF's packing serve the same end).
    On a heavy-tailed batch the longest rows get micro-batches of their own instead of padding a quarter of the
    batch each. Ties go to the earliest cut, so every rank given the same lengths cuts alike.

    Found exactly by dynamic programming over the cut points: ``best[j][i]``, the fewest tokens of the first
    ``i`` rows in ``j`` micro-batches, is ``min over s of best[j-1][s] + (i - s) × lengths[i-1]``."""
    rows = len(lengths)
    if not 1 <= micro_batches <= rows:
        raise ValueError(f"micro_batches must be between 1 and the number of rows ({rows}), got {micro_batches}")
    if micro_batches == 1:
        return [slice(0, rows)]
    if any(a > b for a, b in zip(lengths, lengths[1:])):
        raise ValueError("padded_micro_batch_slices: lengths must be sorted ascending")
    if rows > PADDED_SPLIT_MAX_ROWS:
        return micro_batch_slices(rows, micro_batches)
    length_I = torch.tensor([0, *lengths], dtype=torch.float64)  # length_I[i]: the i-th row's (1-based)
    at_I = torch.arange(rows + 1, dtype=torch.float64)
    # the span s..i costs (i - s) × length_I[i]: the cost matrix over (s, i), s < i
    span_SI = (at_I[None, :] - at_I[:, None]) * length_I[None, :]
    span_SI = span_SI.masked_fill(at_I[:, None] >= at_I[None, :], math.inf)
    best_I = span_SI[0].clone()  # one micro-batch: rows 0..i
    best_I[0] = math.inf
    cuts = []
    for _ in range(micro_batches - 1):
        total_SI = best_I[:, None] + span_SI
        best_I, arg_I = total_SI.min(dim=0)  # min picks the first (earliest) of equal cuts
        cuts.append(arg_I)
    slices, stop = [], rows
    for arg_I in reversed(cuts):
        start = int(arg_I[stop])
        slices.append(slice(start, stop))
        stop = start
    slices.append(slice(0, stop))
    return slices[::-1]
