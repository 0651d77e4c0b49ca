"""Checkpoints and results in `STORAGE_PATH` (a local or NFS folder, or a bucket), each read and write with a
deadline, so that a stalled store fails a save in minutes instead of hanging the run.

The names the notebooks call: `dcp_writer`/`dcp_reader` (Llama's sharded checkpoints, written and read in
place), `fetch_checkpoint` (GPT-2 and GLUE resume from a local copy; `trainer_rank_files` picks a rank's
files), `checkpoint_in_place` (Dolly reads its shards where they are stored), `upload_folder`, `write_json` and
`read_json`. The deadlines, retries and parallel streams behind them are `harness.storage`.
"""

from harness.storage import (
    StorageStalled,
    checkpoint_in_place,
    dcp_reader,
    dcp_writer,
    fetch_checkpoint,
    read_json,
    trainer_rank_files,
    upload_folder,
    uri,
    write_json,
)

__all__ = [
    "dcp_writer",
    "dcp_reader",
    "fetch_checkpoint",
    "trainer_rank_files",
    "checkpoint_in_place",
    "upload_folder",
    "write_json",
    "read_json",
    "uri",
    "StorageStalled",
]
