"""One allocation for tensors a decode step streams: copies of them side by side, each at a
64-byte boundary, handed back as views in the same order.

With huge pages on (`worker.cpu_huge_pages`), torch puts each allocation of 2 MiB or more on
2 MiB pages, all but its last, partial page; one of less gets none. A model's quantized weights
allocated one tensor at a time (a projection's panels of 2.6 MiB: one huge page and 0.6 MiB of
4 KiB ones; its scales of 720 KiB: none) leave about a quarter of what each step reads on 4 KiB
pages, a TLB miss every 4 KiB of it. Gathered into one allocation, all but its last page are huge.
"""
from __future__ import annotations

import torch

ALIGN_BYTES = 64  # a cache line: each tensor starts on its own, as the kernels' loads expect


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (contiguous, one device) in one allocation, as views of it; the
    originals are left to their owners to drop."""
    if not tensors:
        return []
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError("an arena holds the tensors of one device")
    offsets, total = [], 0
    for t in tensors:
        total = -(-total // ALIGN_BYTES) * ALIGN_BYTES
        offsets.append(total)
        total += t.nbytes
    arena = torch.empty(total, dtype=torch.uint8, device=device)
    views = []
    for t, offset in zip(tensors, offsets):
        view = arena[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        views.append(view)
    return views
