"""Hugging Face safetensors in and out of a torchtitan model through its state-dict adapter, read and written by
reshard (:mod:`reshard.interop.torchtitan`'s ``initial_load_in_hf`` and ``last_save_in_hf``).

In: as torchtitan's DCP manager does it, with reshard in place of ``dcp.load`` and torchtitan's
``HuggingFaceStorageReader``: the adapter's ``to_hf`` turns the model's state dict (FSDP2/TP DTensors) into an
HF-keyed template (Q/K permuted, so new DTensors of the same layout), :func:`reshard.load` fills it from the
safetensors through :class:`~reshard.interop.HuggingFaceSource` (each rank reads only the bytes of its shards),
``from_hf`` turns it back and the model's ``load_state_dict`` takes it. Safetensors entries the model does not
use (``rotary_emb.inv_freq``, ...) are allowed, as DCP's reader allows them.

Out: the adapter's ``to_hf`` of the last step's model state is saved as the manager's reshard checkpoint of
that step (sharded, in parallel, checksummed) and then exported from it by rank 0 with
:func:`reshard.interop.export.export_safetensors` (streamed in slabs: no rank holds the whole model) into
``<folder>/step-<N>``, the directory torchtitan's own HF save writes.
"""

from __future__ import annotations

import datetime
from typing import Any

from reshard.flows.load import load
from reshard.flows.options import LoadOptions
from reshard.interop.export import export_safetensors
from reshard.interop.hf_source import HuggingFaceSource
from reshard.net.comm import Communicator
from reshard.storage import Storage

__all__ = ["export_hf", "load_hf_model"]


def load_hf_model(
    adapter: Any,
    model: Any,
    path: str,
    *,
    options: LoadOptions,
    storage_options: dict[str, Any] | None,
    timeout: datetime.timedelta | float | None,
) -> None:
    """Load the HF safetensors directory ``path`` into ``model`` (torchtitan's ``ModelWrapper``) through
    ``adapter`` (its ``to_hf`` / ``from_hf``). **Collective** over the default group: every rank calls it."""
    template = adapter.to_hf(model.state_dict())
    source = HuggingFaceSource(path, storage_options=storage_options, allow_unused=True)
    try:
        loaded = load(template, source, strict=True, options=options, timeout=timeout)
    finally:
        source.close()
    model.load_state_dict(adapter.from_hf(loaded))


def export_hf(
    checkpoint: Storage,
    out: str,
    *,
    storage_options: dict[str, Any] | None,
    timeout: datetime.timedelta | float | None,
) -> None:
    """Export the committed reshard checkpoint ``checkpoint`` (HF keys already) to ``out`` as HF sharded
    safetensors, on rank 0 of the default group. **Collective** over the default group: every rank calls it and
    raises the same error when the export failed (an earlier export in ``out`` is replaced)."""
    comm = Communicator(None, timeout=timeout)

    def export() -> None:
        if comm.is_coordinator:
            export_safetensors(checkpoint, out, overwrite=True, storage_options=storage_options)

    comm.step("torchtitan HF export", export)
