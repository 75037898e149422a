"""Plans, strategy plans, cost profiles and their measurement reports as JSON files, written so that an interrupted write never
leaves a truncated file in place of the previous one.

Pure Python: nothing here imports JAX.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, Optional


def write_json(path: str | os.PathLike, data: Any, indent: Optional[int] = 1, sort_keys: bool = True) -> None:
    """``data`` as JSON (keys sorted unless ``sort_keys`` is False, a final newline) to ``path``, its
    folder made where missing: written to a temporary file beside it and renamed over it, so a
    reader sees the old file or the new one, whole (the rename is atomic on one file system). The temporary name is unique across
    hosts (processes on hosts sharing a network file system may have equal pids) and the file gets
    the permissions the umask gives any new file."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "x") as f:
            json.dump(data, f, indent=indent, sort_keys=sort_keys)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class JsonFile:
    """``dumps``, ``save`` and ``load`` for a class with ``to_json`` and ``from_json``."""

    json_indent = 1

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)

    def save(self, path: str | os.PathLike) -> None:
        write_json(path, self.to_json(), self.json_indent)

    @classmethod
    def load(cls, path: str | os.PathLike):
        with open(path) as f:
            return cls.from_json(json.load(f))


__all__ = ["JsonFile", "write_json"]
