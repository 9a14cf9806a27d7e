"""A filesystem for fault drills: ``faulty://<local path>`` behaves like the local disk until told to fail.

While a file named ``FAIL_WRITES`` exists in the root of a store (or any folder above the file being
written), opening a file for writing there raises ``OSError(ENOSPC, "No space left on device")``, like a full
disk. Tests and release/fault_injection.py create and delete that file while a run is going; nothing else uses
this protocol. fsspec finds it through the package's `fsspec.specs` entry point (setup.cfg), in every process
(the training workers too), so nothing is registered when the library is imported.
"""

from __future__ import annotations

import errno
import os

from fsspec.implementations.local import LocalFileSystem

PROTOCOL = "faulty"
FAIL_WRITES = "FAIL_WRITES"


class FaultyFileSystem(LocalFileSystem):
    """The local filesystem, whose writes fail with ENOSPC below a folder holding a ``FAIL_WRITES`` file."""

    protocol = PROTOCOL
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3 :]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        if any(c in mode for c in "wax") and _failing(self._strip_protocol(path)):
            raise OSError(errno.ENOSPC, "No space left on device (faulty:// drill)", path)
        return super()._open(path, mode=mode, **kwargs)


def _failing(path: str) -> bool:
    folder = os.path.dirname(path)
    while True:
        if os.path.exists(os.path.join(folder, FAIL_WRITES)):
            return True
        parent = os.path.dirname(folder)
        if parent == folder:
            return False
        folder = parent
