"""Checkpoints and results in `STORAGE_PATH` (a local or NFS folder, or a bucket), each read and write with a
deadline, so that a stalled store fails a save in minutes instead of hanging the run.

The names the notebooks call: `dcp_writer`/`dcp_reader` (Llama's sharded checkpoints, written and read in
place), `checkpoint_folder` (GPT-2 and GLUE resume from a local copy; `trainer_rank_files` picks a rank's
files), `stored_folder` (Dolly reads its shards where they are stored), `upload_folder`, `write_json` and
`read_json`. The deadlines, retries and parallel streams behind them are `harness.storage`.
"""

from harness.storage import (
    StorageStalled,
    checkpoint_folder,
    dcp_reader,
    dcp_writer,
    read_json,
    stored_folder,
    trainer_rank_files,
    upload_folder,
    uri,
    write_json,
)

__all__ = [
    "dcp_writer",
    "dcp_reader",
    "checkpoint_folder",
    "trainer_rank_files",
    "stored_folder",
    "upload_folder",
    "write_json",
    "read_json",
    "uri",
    "StorageStalled",
]
