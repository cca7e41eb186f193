"""Counting a training step's device-to-host reads (host syncs on a GPU), on any device.

On CUDA each of these makes the host wait for every kernel queued before it:

- ``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` (``if t:``);
- ops whose OUTPUT SHAPE depends on the values: ``nonzero`` (and ``argwhere``), indexing with
  a boolean mask (a ``nonzero`` inside the kernel), ``masked_select``, ``unique``,
  ``repeat_interleave`` without ``output_size``; and ``equal`` (a bool);
- copies to the host: ``.tolist()``, ``.cpu()``, ``.numpy()`` (Python methods, patched here:
  on a CPU they do not reach the dispatcher).

:class:`HostReads` counts all of them on tensors of ``device`` (on a CPU run: every tensor,
which over-counts host-side work if there is any in the counted region, never under-counts the
ops above). What it cannot see on a CPU: a blocking host-to-device copy (``.to(device)``
without ``non_blocking``), which on CUDA waits for the stream too; the step's code makes those
non-blocking by construction (``grimoire.contract.layout.to_device``).
"""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Ops that read a device value back to the host (see the module docstring).
READ_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero_numpy.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.equal.default,
}

PYTHON_READS = ("tolist", "cpu", "numpy")


class HostReads(TorchDispatchMode):
    """``with HostReads("cpu") as reads: ...`` then ``reads.count`` / ``reads.where``."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.where: list[tuple[str, str]] = []
        self._saved: dict[str, object] = {}

    @property
    def count(self) -> int:
        return len(self.where)

    def _on_device(self, tensors) -> bool:
        return any(
            isinstance(t, torch.Tensor) and t.device.type == self.device.type for t in tensors
        )

    def _record(self, what: str) -> None:
        frames = [
            f
            for f in traceback.extract_stack()[:-2]
            if "grimoire" in f.filename or "transformers" in f.filename
        ]
        site = frames[-1] if frames else None
        self.where.append((what, f"{site.filename}:{site.lineno} {site.name}" if site else "?"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        repeat = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if (func in READ_OPS or repeat or _bool_index(func, args)) and self._on_device(
            [*args, *kwargs.values()]
        ):
            self._record(str(func))
        return func(*args, **kwargs)

    def __enter__(self):
        for name in PYTHON_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def read(t, *a, _original=original, _name=name, **k):
                if self._on_device([t]):
                    self._record(f"Tensor.{_name}")
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, read)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def _bool_index(func, args) -> bool:
    """Indexing with a boolean mask (``t[mask]``, ``t[mask] = v``): a ``nonzero`` inside."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


def step_reads(trainer, device: str = "cpu") -> list[list[tuple[str, str]]]:
    """Wrap ``trainer._optimizer_step`` so every step's reads are recorded; returns the list the
    steps append to (one list of ``(op, site)`` per step)."""
    per_step: list[list[tuple[str, str]]] = []
    step = trainer._optimizer_step

    def counted(micro):
        with HostReads(device) as reads:
            step(micro)
        per_step.append(reads.where)

    trainer._optimizer_step = counted
    return per_step
