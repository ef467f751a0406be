"""Which operators a GPU would wait on: an audit of every operator a prefill or a decoding step runs.

A CUDA stream runs ahead of the Python that queues it until an operator needs a value back on the host (`.item()`,
`nonzero`, a boolean-mask index, whose output size depends on the data) or copies host data in (`torch.tensor(...)`
of a Python list is copied and the stream waited for). Inside a decoder layer each such operator stalls the GPU once
per layer and per chunk; a CUDA graph cannot record one at all. On a CPU nothing stalls, but the same operators run,
so this audit (a `TorchDispatchMode`, which sees every operator) finds them on machines without a GPU.

`HostReadAudit` records the offenders and counts all operators, and those that launch a kernel on a GPU (not a view
or a bare allocation, `launches_kernel`), apart inside and outside the model's decoder layers (`watch(model)`: hooks
on each layer); `audit_prefill` runs one prefill under it and reports per layer and per pass
(a chunked feed runs one pass per chunk). `benchmarks/prefill_audit.py` prints the table for every method;
docs/PERFORMANCE.md gives it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvsieve.engine import prefill
from kvsieve.models import architecture

# Operators that read a tensor back to the host, or copy host data in, and so stall a CUDA stream (and cannot be
# recorded in a CUDA graph).
HOST_READS = {
    "aten._local_scalar_dense",  # .item(), int(t), bool(t), .tolist()
    "aten.is_nonzero",
    "aten.equal",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.unique_dim",
    "aten.lift_fresh",  # torch.tensor(python data): a host-to-device copy on CUDA (an empty one copies nothing)
}


# Operators that launch no kernel besides views (`OpOverload.is_view`): shape arithmetic and bare allocations.
NO_KERNEL = {
    "aten.promote_types",
    "aten.result_type",
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.unbind",
    "aten.split",
    "aten.split_with_sizes",
    "aten.chunk",
}


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Whether `func` would launch a kernel on a GPU: it computes or copies, rather than making a view of a tensor
    (slice, expand, unsqueeze, select, ...) or an uninitialised allocation. Each costs a launch of a few
    microseconds on a GPU whatever its size, which is what many small operators add up to."""
    return not func.is_view and str(func.overloadpacket) not in NO_KERNEL


def is_host_read(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether the operator `func` called with `args` reads back to the host or copies host data in: one of
    HOST_READS (a copy of no element excepted), an index by a boolean mask, or `repeat_interleave` without its
    output size."""
    name = str(func.overloadpacket)  # e.g. "aten.nonzero"
    if name == "aten.lift_fresh":
        return args[0].numel() > 0
    indices = [t for arg in args if isinstance(arg, list | tuple) for t in arg if isinstance(t, torch.Tensor)]
    return (
        name in HOST_READS
        or (name.startswith("aten.index") and any(t.dtype == torch.bool for t in indices))
        or (name == "aten.repeat_interleave" and kwargs.get("output_size") is None)
    )


class HostReadAudit(TorchDispatchMode):
    """Every operator run inside `with HostReadAudit() as audit:`, counted (`seen`), and those that read back to
    the host (`offenders`); after `watch(model)`, also apart inside and outside the model's decoder layers."""

    def __init__(self) -> None:
        super().__init__()
        self.offenders: list[str] = []
        self.seen = 0
        self.kernels = 0  # operators that launch a kernel (`launches_kernel`)
        self.depth = 0  # decoder layers running now (`watch`)
        self.in_layers = 0  # operators run inside a decoder layer
        self.kernels_in_layers = 0
        self.reads_in_layers: list[str] = []
        self.layer_calls = 0
        self.passes = 0  # calls of the first decoder layer: forward passes through the model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen += 1
        self.in_layers += self.depth > 0
        if launches_kernel(func):
            self.kernels += 1
            self.kernels_in_layers += self.depth > 0
        if is_host_read(func, args, kwargs):
            self.offenders.append(str(func))
            if self.depth:
                self.reads_in_layers.append(str(func))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def watch(self, model: torch.nn.Module) -> Iterator[HostReadAudit]:
        """Count inside and outside `model`'s decoder layers while the block runs (forward hooks, removed after; a
        layer left by an exception, as GemFilter's selection pass stops at its filter layer, counts as left)."""
        layers = architecture(model).layers
        handles = []
        for index, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(lambda *_, first=index == 0: self._enter(first)))
            handles.append(layer.register_forward_hook(lambda *_: self._leave(), always_call=True))  # also on a raise
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, first: bool) -> None:
        self.depth += 1
        self.layer_calls += 1
        self.passes += first

    def _leave(self) -> None:
        self.depth -= 1


@dataclass(frozen=True)
class PrefillAudit:
    """What one prefill ran: operators and host reads inside the decoder layers (per layer call) and outside them
    (per forward pass, i.e. per chunk of a chunked feed)."""

    passes: int
    layer_calls: int
    operators_in_layers: int
    operators_outside: int
    kernels_in_layers: int
    kernels_outside: int
    reads_in_layers: list[str] = field(default_factory=list)
    reads_outside: list[str] = field(default_factory=list)

    @property
    def operators_per_layer(self) -> float:
        return self.operators_in_layers / max(self.layer_calls, 1)

    @property
    def operators_per_pass(self) -> float:
        """Operators outside the layers per forward pass (a chunk's own arithmetic and pruning bookkeeping)."""
        return self.operators_outside / max(self.passes, 1)

    @property
    def kernels_per_layer(self) -> float:
        """Operators that launch a kernel (`launches_kernel`) per decoder layer call."""
        return self.kernels_in_layers / max(self.layer_calls, 1)

    @property
    def kernels_per_pass(self) -> float:
        """Operators that launch a kernel outside the layers per forward pass."""
        return self.kernels_outside / max(self.passes, 1)

    @property
    def reads_per_pass(self) -> float:
        return len(self.reads_outside) / max(self.passes, 1)


def audit_prefill(model: torch.nn.Module, prompt: torch.Tensor, spec: object) -> PrefillAudit:
    """Run `kvsieve.engine.prefill(model, prompt, method=spec)` under a `HostReadAudit` and report it."""
    audit = HostReadAudit()
    with torch.no_grad(), audit.watch(model), audit:
        prefill(model, prompt, method=spec)
    outside = list(audit.offenders)
    for read in audit.reads_in_layers:
        outside.remove(read)
    return PrefillAudit(
        passes=audit.passes,
        layer_calls=audit.layer_calls,
        operators_in_layers=audit.in_layers,
        operators_outside=audit.seen - audit.in_layers,
        kernels_in_layers=audit.kernels_in_layers,
        kernels_outside=audit.kernels - audit.kernels_in_layers,
        reads_in_layers=list(audit.reads_in_layers),
        reads_outside=outside,
    )
