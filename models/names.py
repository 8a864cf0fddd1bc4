"""Module and parameter names as the model defines them, whatever wraps it."""

from __future__ import annotations

# Wrappers that torch.compile / activation checkpointing / FSDP insert into parameter names.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def strip_wrappers(native: str) -> str:
    """A parameter or module name without the parts wrappers insert (`_orig_mod.`, ...)."""
    for part in _WRAPPER_PARTS:
        native = native.replace(part, "")
    return native
