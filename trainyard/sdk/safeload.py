"""Loading a checkpoint never unpickles code.

A checkpoint directory is data written by training processes; whoever can write into it (or
forge a resume path) must not get code run in every rank that resumes from it. DCP reads tensors
with torch.load(weights_only=True) already, but not the rest:
- DefaultLoadPlanner.load_bytes reads the non-tensor values (the trainer's dict, optimizer
  hyperparameters) with weights_only=False: SafeLoadPlanner reads them with weights_only=True;
- FileSystemReader.read_metadata reads `.metadata` with pickle.load: SafeFileSystemReader
  unpickles it allowing only DCP's metadata classes, torch.Size, dtypes, layouts and paths.
What the SDK saves (tensors, ints, floats, bools, strings, tuples, None) loads this way; a plain
value of a custom class in the caller's state does not (save its state_dict() instead).
"""
from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"), ("builtins", "set"),
            ("builtins", "frozenset"), ("builtins", "slice")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _METADATA_MODULE:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:  # its classes, nothing it imported
                return obj
        raise pickle.UnpicklingError(f"a checkpoint's .metadata may not name {module}.{name}")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with an allow-list (see the module doc)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor values load with weights_only=True."""

    def load_bytes(self, read_item, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
