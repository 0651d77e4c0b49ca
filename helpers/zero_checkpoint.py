"""A DeepSpeed ZeRO checkpoint is split by rank, like the training state it holds: which of its files
each rank reads when it resumes, and how many ranks wrote it.

Used by the GPT-2 notebook's `load_checkpoint` (section 4) and its resume (section 9).

DeepSpeed (`deepspeed/runtime/engine.py`) names a checkpoint's files by data-parallel rank:
`[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt` holds rank r's partition of the optimizer state
(ZeRO stages 1-3), and at ZeRO-3 `zero_pp_rank_{r}_mp_rank_00_model_states.pt` its partition of the
weights; stages 0-2 keep the weights in one `mp_rank_00_model_states.pt` that every rank reads. When
it loads, a rank reads only its own `zero_pp_rank_{r}` files (`_get_all_zero_checkpoint_state_dicts`;
not so with `zero_optimization.elastic_checkpoint`, off by default), and it refuses a checkpoint that a
different number of ranks wrote (`_load_zero_checkpoint` raises `ZeRORuntimeException`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator

from basics.validate import ParameterError

__all__ = [
    "fetch_zero_checkpoint",
    "zero_rank_files",
    "zero_checkpoint_world_size",
    "check_zero_checkpoint_workers",
]

# One rank's shard: its optimizer-state partition, or (ZeRO-3) its weight partition.
_SHARD = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(optim|model)_states\.pt$")


def zero_rank_files(rank: int) -> Callable[[str], bool]:
    """The files of a DeepSpeed checkpoint that rank `rank` reads: a filter of relative paths, for
    `harness.storage.fetch_checkpoint(checkpoint, files=...)`.

    Everything but the other ranks' shards: this rank's `zero_pp_rank_{rank}` files, and the files
    every rank reads (`latest`, the stage 0-2 `mp_rank_00_model_states.pt`, the notebook's own). With 2
    ranks that is about half of the checkpoint instead of all of it.
    """

    def wanted(path: str) -> bool:
        shard = _SHARD.search(path)
        return shard is None or int(shard.group(1)) == rank

    return wanted


def _listing(checkpoint) -> tuple[object, str, list[str]]:
    """`(filesystem, root, relative paths of its files)` of a Ray `Checkpoint` or a local folder."""
    import pyarrow.fs as pafs

    from harness.storage import listed_with_deadline  # a stalled bucket: StorageStalled, not a hang

    if hasattr(checkpoint, "filesystem"):  # a Ray Checkpoint (itself refuses to be used as a path)
        fs, root = checkpoint.filesystem, checkpoint.path
    else:
        fs, root = pafs.LocalFileSystem(), os.path.abspath(checkpoint)
    root = root.rstrip("/")
    return fs, root, list(listed_with_deadline(fs, root))


def zero_checkpoint_world_size(checkpoint) -> int | None:
    """How many ranks wrote a DeepSpeed checkpoint (a Ray `Checkpoint` or a local folder): one more
    than the highest rank of its optimizer-state shards. None without such shards (ZeRO stage 0, which
    loads at any world size). Reads only the listing, not the files.

    Where the folder holds several DeepSpeed tags (`global_step...` folders), the one `latest` names.
    """
    from harness.storage import read_small  # with a deadline: a stalled bucket fails, never hangs

    fs, root, paths = _listing(checkpoint)
    ranks: dict[str, set[int]] = {}  # tag folder -> the ranks of its optimizer shards
    for path in paths:
        shard = _SHARD.search(path)
        if shard and shard.group(2) == "optim":
            ranks.setdefault(os.path.dirname(path), set()).add(int(shard.group(1)))
    if not ranks:
        return None
    if len(ranks) > 1:  # several tags in one folder: the one `latest` names
        for folder, folder_ranks in ranks.items():
            parent, tag = os.path.split(folder)
            latest = os.path.join(parent, "latest")
            if latest in paths and read_small(fs, f"{root}/{latest}").strip() == tag:
                return max(folder_ranks) + 1
    return max(max(r) for r in ranks.values()) + 1


def check_zero_checkpoint_workers(checkpoint, num_workers: int, name: str = "NUM_WORKERS") -> int | None:
    """Refuse, naming `name`, to resume a DeepSpeed ZeRO checkpoint on a different number of workers.

    ZeRO partitions the optimizer state (and at stage 3 the weights) into one shard per rank, and
    DeepSpeed cannot split a checkpoint's shards again for another world size: it would fail inside
    every worker's `load_checkpoint` with a `ZeRORuntimeException`. This says so first, with the two
    ways out. Returns the checkpoint's world size (None: not partitioned, any number works).
    """
    saved = zero_checkpoint_world_size(checkpoint)
    if saved is None or saved == num_workers:
        return saved
    where = checkpoint.path if hasattr(checkpoint, "filesystem") else checkpoint
    raise ParameterError(
        f"{name}={num_workers}, but the DeepSpeed ZeRO checkpoint at {where} was saved by {saved} workers: "
        f"its optimizer state is split into {saved} shards, one per rank (zero_pp_rank_0 to "
        f"zero_pp_rank_{saved - 1}), and DeepSpeed cannot split them again for {num_workers}. Resume with "
        f"{name}={saved}. Or convert a copy of the checkpoint to DeepSpeed's universal format "
        "(python -m deepspeed.checkpoint.ds_to_universal --input_folder DIR/global_stepN "
        "--output_folder DIR/global_stepN_universal) and load that with "
        '"checkpoint": {"load_universal": True} in the DeepSpeed config.'
    )


@contextlib.contextmanager
def fetch_zero_checkpoint(checkpoint, rank: int, world_size: int) -> Iterator[str]:
    """A local folder with what rank `rank` of `world_size` reads of a DeepSpeed checkpoint (a Ray
    `Checkpoint`): its own shard and the files every rank reads, not the other ranks' shards
    (`zero_rank_files`), after checking that as many workers saved it (`check_zero_checkpoint_workers`).
    Where the checkpoint is in a bucket, the copy is this process's own, deleted at the end of the block
    (`harness.storage.fetch_checkpoint`)."""
    from harness.storage import fetch_checkpoint

    check_zero_checkpoint_workers(checkpoint, world_size)
    with fetch_checkpoint(checkpoint, files=zero_rank_files(rank)) as folder:
        yield folder
