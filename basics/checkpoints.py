"""How a rank moves a streamed checkpoint: in how many streams, at what assumed rate, in files of what size,
and within what share of the process group's timeout. The planner states a checkpoint's time with these
(`basics.plan`); the writer and the reader hold to them (`harness.storage`)."""

from __future__ import annotations

__all__ = ["STREAMS", "STREAM_RATE", "COLLECTIVE_SHARE", "STREAM_FILE_BYTES"]

# A rank writes STREAMS files of a checkpoint at once, and reads STREAMS byte ranges at once: one stream
# to an object store is far slower than the node's network (at 70B a rank's 52 GB one file after another
# would take 17 min at 50 MB/s). The plan states a checkpoint's time at STREAM_RATE per stream, an assumption
# (yours: the time between two steps around a checkpoint in the run log).
STREAMS = 4
STREAM_RATE = 50e6  # bytes/s per stream
# A save or a load must end within this share of the process group's timeout (`COLLECTIVE_TIMEOUT_S`):
# the other ranks wait for this one in DCP's next collective, and past the timeout the watchdog kills
# them. A slow rank fails first, with `StorageStalled` saying why, and the checkpoint is not registered.
COLLECTIVE_SHARE = 0.8

# The most bytes of tensors in one file of a streamed checkpoint. torch's writer keeps every tensor of a
# file on the host until the file is closed (`_write_files_from_queue` in
# torch/distributed/checkpoint/filesystem.py), and pyarrow's S3 stream buffers the parts it has not
# uploaded yet: several files per rank bound both by this, instead of the rank's whole shard.
STREAM_FILE_BYTES = 1 << 30
