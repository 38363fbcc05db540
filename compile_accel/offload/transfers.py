"""The copies between host and GPU memory: the side streams they run on, the events that order
them against the compute stream, and the host memory they copy to and from.

Copies to the GPU (weights, activations coming back) and to the host (activations leaving) run
on streams of their own, so that PCIe carries both directions at once and the compute stream
only waits where it reads what a copy writes. On the CPU, or with async_transfers=False, there
are no side streams: every copy runs where it is issued, and no events are recorded.
"""

from __future__ import annotations

import torch

from ..stats import warn


class Transfers:
    """Copy streams and host memory for one conductor.

    device: the compute device; cuda: whether it is a CUDA device (else plain copies).
    to_device, to_host: the side streams (None without async transfers).
    pin_memory: host memory is page-locked; a failed pinned allocation turns it off (with a
        warning) and host memory is pageable from then on.
    """

    def __init__(self, device: torch.device, async_transfers: bool, pin_memory: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin_memory = pin_memory
        self.to_device = torch.cuda.Stream(device) if async_transfers else None
        self.to_host = torch.cuda.Stream(device) if async_transfers else None

    def host_empty(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of host memory, pinned unless pinning failed."""
        if self.pin_memory:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as error:
                self.pin_memory = False
                warn(
                    f"could not allocate pinned host memory ({str(error).splitlines()[0]}); using pageable memory, "
                    "so copies to the GPU are slower and do not overlap compute. Free host memory or lower "
                    "offload_fraction to get pinned transfers"
                )
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(
        self,
        source: torch.Tensor,
        target: torch.Tensor,
        stream: torch.cuda.Stream | None,
        after: torch.cuda.Event | None,
        behind_compute: bool = True,
    ) -> None:
        """target <- source on `stream`, behind `after` and (unless told otherwise) the compute
        enqueued so far."""
        if stream is None:
            target.copy_(source)
        else:
            ready = self.compute_done() if behind_compute else None
            with torch.cuda.stream(stream):
                if ready is not None:
                    stream.wait_event(ready)
                if after is not None:
                    stream.wait_event(after)
                target.copy_(source, non_blocking=self.pin_memory)
                # GPU memory that dies before the copy is done is reused only after it.
                for tensor in (source, target):
                    if tensor.is_cuda:
                        tensor.record_stream(stream)

    @staticmethod
    def done(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """An event at the copies enqueued on `stream` so far (None without side streams: those
        copies are done already)."""
        return stream.record_event() if stream is not None else None

    def compute_done(self) -> torch.cuda.Event:
        """An event at the compute enqueued so far."""
        return torch.cuda.current_stream(self.device).record_event()

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for `event` (None: nothing to wait for)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
