"""Tools for fault drills and tests: kill a worker, damage a checkpoint, a filesystem that fails like a full
disk, and the prompt audit. Not imported by the library itself."""
