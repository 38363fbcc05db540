"""Weight streaming: the GPU slots that streamed blocks take turns in, and the copies into them.

There are two slots, one for the block computing and one for the next block arriving. A block
loaded into its slot evicts the slot's previous block, whose parameters point at their host
copy again; a compiled region called then runs eager and is counted in
`Acceleration.stats()["eager_nonresident_calls"]`. A copy into a slot waits for the work enqueued
before it (which includes the slot's previous block), and a block's compute waits for its copy.

offload_dtype="int8": the host copy is sent as int8 into the slot's staging buffer and
dequantized into the slot on the compute stream just before the block runs (one kernel launch
per block; none for the held weights, which are copied into the slot as they are, with the
weights not quantized). A copy waits only for the last dequantize out of its staging buffer, never for
compute, so the copy engine runs two blocks ahead.
"""

from __future__ import annotations

import torch

from .layout import ALIGN, BlockWeights
from .transfers import Transfers

SLOTS = 2  # one block computing, the next one arriving


class Slots:
    """The slots (and int8's staging buffers) of one conductor, and which block each holds."""

    def __init__(self, transfers: Transfers, int8: bool) -> None:
        self.transfers = transfers
        self.int8 = int8
        self.buffers: list[torch.Tensor] = []
        self.staging: list[torch.Tensor] = []  # int8: where the host copy lands before dequantizing
        self.staging_read: list[torch.cuda.Event | None] = []  # int8: the last dequantize out of each
        self.staged: list[BlockWeights | None] = []  # int8: the block in each staging buffer, not dequantized yet
        self.occupant: list[BlockWeights | None] = []  # the block each slot holds (int8: dequantized)

    def allocate(self, plan: list[BlockWeights]) -> None:
        """The streamed blocks' host copies, the slots (sized for the largest streamed block)
        and the resident blocks' GPU buffers. On failure nothing stays allocated."""
        streamed = [b for b in plan if b.streamed]
        device = self.transfers.device
        try:
            for block in streamed:
                block.host = self.transfers.host_empty(block.host_nbytes)
            slot_bytes = max((b.nbytes for b in streamed), default=0)
            self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in streamed[:SLOTS]]
            if self.int8:
                staging = max((b.host_nbytes for b in streamed), default=0)
                self.staging = [torch.empty(staging, dtype=torch.uint8, device=device) for _ in self.buffers]
                self.staging_read = [None] * len(self.staging)
            for block in plan:
                if not block.streamed:
                    block.home = torch.empty(block.nbytes, dtype=torch.uint8, device=device)
        except (RuntimeError, MemoryError):
            for block in plan:
                block.host = block.home = None
            self.clear()
            raise
        self.occupant = [None] * len(self.buffers)
        self.staged = [None] * len(self.buffers)

    def place(self, block: BlockWeights) -> None:
        """Move the block's frozen weights where `allocate` made room for them."""
        block.place(self.buffers[block.slot] if block.streamed else block.home, self.transfers.device)

    def load(self, block: BlockWeights) -> bool:
        """Start copying the block's weights to the GPU: into its slot, evicting the slot's block;
        int8: into the slot's staging buffer, and `wait` dequantizes them into the slot. False
        when they are there already."""
        if block in (self.occupant[block.slot], self.staged[block.slot]):
            return False
        transfers = self.transfers
        if self.int8:
            # The copy waits only for the last dequantize out of that buffer, not for the compute
            # of the slot's block (which may not have run yet): the copy engine gets up to two
            # blocks ahead of the compute, so it keeps going while the host is slower than a copy.
            replaced, self.staged[block.slot] = self.staged[block.slot], block
            if replaced is not None:
                replaced.loaded = None  # a prefetch that was never used
            target, after = self.staging[block.slot][: block.host_nbytes], self.staging_read[block.slot]
            transfers.copy(block.host, target, transfers.to_device, after, behind_compute=False)
        else:
            # Straight into the slot, behind the work enqueued so far (the previous occupant's).
            self._occupy(block)
            transfers.copy(block.host, self.buffers[block.slot][: block.nbytes], transfers.to_device, None)
        block.loaded = transfers.done(transfers.to_device)
        return True

    def wait(self, block: BlockWeights) -> None:
        """Order the compute stream after the block's copy; int8: dequantize it into its slot."""
        self.transfers.wait(block.loaded)
        block.loaded = None
        if block.streamed and self.staged[block.slot] is block:
            # On the compute stream, so after the slot's previous block has run.
            self.staged[block.slot] = None
            self._occupy(block)
            self._dequantize(block)
            if self.transfers.to_device is not None:
                self.staging_read[block.slot] = self.transfers.compute_done()

    def release(self, block: BlockWeights) -> None:
        """Forget the (loaded) block in its slot: no later load may point its parameters back
        at the host copy."""
        self.occupant[block.slot] = None

    def held(self) -> list[int]:
        """Indices of the streamed blocks whose weights are in a slot now."""
        return [b.index for b in self.occupant if b is not None]

    def nbytes(self) -> int:
        return sum(s.numel() for s in (*self.buffers, *self.staging))

    def clear(self) -> None:
        self.buffers, self.staging, self.staging_read, self.staged, self.occupant = [], [], [], [], []

    def _occupy(self, block: BlockWeights) -> None:
        """Give the block its slot: the slot's previous block points at its host copy again."""
        previous = self.occupant[block.slot]
        if previous is not None:
            previous.bind(previous.host_views)
            previous.loaded = None
        self.occupant[block.slot] = block
        block.bind(block.device_views)

    def _dequantize(self, block: BlockWeights) -> None:
        staging, slot = self.staging[block.slot], self.buffers[block.slot]
        if block.kept_end > ALIGN:
            slot[ALIGN : block.kept_end].copy_(staging[ALIGN : block.kept_end])
        block.int8(staging, slot)
