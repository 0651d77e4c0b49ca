"""`STORAGE_PATH`: a local or NFS folder, or a bucket, checked before any GPU time is spent.

Used by `harness.checks.check_parameters` and `harness.checks.check_cluster` (the "Set up" cell of every notebook),
and by their result cells (`uri`), so that the same code reads checkpoints from a folder or a bucket;
`fetch_checkpoint` by the training functions of the GPT-2 and GLUE notebooks when they resume, and
`checkpoint_in_place` by Dolly's, which reads its shards where they are stored.

Ray Train resolves `STORAGE_PATH` with `pyarrow.fs.FileSystem.from_uri`; so do these checks, so
that they see what Ray will see. For an S3-compatible store other than AWS, the standard AWS
variables set the endpoint and keys (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ...).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import os
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from basics.checkpoints import COLLECTIVE_SHARE, STREAM_FILE_BYTES, STREAMS
from basics.validate import ParameterError

__all__ = [
    "redact",
    "check_storage_path",
    "uri",
    "dcp_writer",
    "dcp_reader",
    "StorageStalled",
    "fetch_checkpoint",
    "checkpoint_in_place",
    "trainer_rank_files",
]

SCHEMES = "a local or NFS folder, s3://bucket/prefix, gs://bucket/prefix or hdfs://host/path"


def is_uri(path: str) -> bool:
    return "://" in str(path)


# `scheme://user:secret@bucket/...`: pyarrow reads credentials from a URI's user part. The secret may hold
# a "/" (AWS secret keys do), so the user part is whatever precedes the first "@" if it has a ":" or no "/".
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<user>[^@]*)@(?P<rest>.*)$", re.DOTALL)


def redact(value):
    """`value` with any credentials in a URI's user part replaced by `***` (`s3://***@bucket/prefix`); the
    bucket and prefix stay readable. Anything else is returned as it is."""
    if not isinstance(value, str):
        return value
    match = _USERINFO.match(value)
    if not match or ("/" in match["user"] and ":" not in match["user"]):
        return value
    return f"{match['scheme']}://***@{match['rest']}"


_USERINFO_ANYWHERE = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://[^/\s@'\"]+@")


def redact_all(text: str) -> str:
    """`text` (a message, an argument) with the user part of every URI in it replaced by `***`, wherever it
    stands (`MODEL_NAME='https://***@host/m'`)."""
    return _USERINFO_ANYWHERE.sub(lambda m: f"{m['scheme']}://***@", text)


def shown(text: str, shell: bool = False) -> str:
    """`text` (a path, or a URI) with the home folder written `~` (`$HOME` where `shell`: a command to copy),
    for the lines a notebook prints: short enough for the docs' pages, and without the machine's user."""
    home = os.path.expanduser("~")
    if not isinstance(text, str) or home in ("", "/"):
        return text
    return text.replace(home.rstrip("/") + "/", ("$HOME" if shell else "~") + "/")


def write_probe(fs, path: str) -> None:
    """Create `path` and write, read back and delete one small object there."""
    fs.create_dir(path, recursive=True)
    probe = f"{path.rstrip('/')}/.write-check-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(probe) as f:
        f.write(b"ok")
    with fs.open_input_stream(probe) as f:
        assert f.read() == b"ok"
    fs.delete_file(probe)


def _custom_endpoint(value: str) -> tuple[str, str] | None:
    """`(endpoint, where it was set)` for an S3 URI with its own endpoint; None for AWS itself or another store."""
    if "endpoint_override=" in value:
        return value.split("endpoint_override=", 1)[1].split("&", 1)[0], "endpoint_override"
    if value.startswith("s3://") and os.environ.get("AWS_ENDPOINT_URL"):
        return os.environ["AWS_ENDPOINT_URL"], "AWS_ENDPOINT_URL"
    return None


def _check_endpoint_answers(name: str, value: str, endpoint: str, where: str) -> None:
    """A custom S3 endpoint that does not accept connections fails in seconds (pyarrow retries for 15 s)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=5).close()
    except OSError as exc:
        raise ParameterError(f"{name}={value!r}: cannot reach the bucket's endpoint{where}: {exc}.") from None


def check_storage_path(name: str, value: str) -> str:
    """The storage must be a folder or bucket this process can write to; else `ParameterError`.

    A folder: its nearest existing parent must be writable (nothing is created). A URI: the scheme must
    be one pyarrow (and so Ray Train) knows, the bucket must exist, and a small test object is
    written and deleted, which proves the endpoint, the credentials and the permissions at once.
    """
    import pyarrow as pa
    import pyarrow.fs as pafs

    if not isinstance(value, str) or not value:
        raise ParameterError(f"{name}={value!r}: must be {SCHEMES}.")
    if redact(value) != value:
        raise ParameterError(
            f"{name}={redact(value)!r}: credentials in the URI are not accepted: Ray and pyarrow would repeat "
            "them in logs, results and the job's records. Remove them, and give every node the bucket's "
            "credentials instead: instance credentials, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in "
            "each node's environment (for gs://, GOOGLE_APPLICATION_CREDENTIALS)."
        )
    if not is_uri(value) or value.startswith("file://"):
        folder = Path(value.removeprefix("file://")).expanduser().absolute()
        parent = next(p for p in [folder, *folder.parents] if p.exists())
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ParameterError(f"{name}={value!r}: {parent} is not a folder this process can write to.")
        return value
    custom = _custom_endpoint(value)
    where = f" at {custom[0]} ({custom[1]})" if custom else ""
    if custom:  # pyarrow's errors do not name it; AWS itself or another store: theirs say what failed
        _check_endpoint_answers(name, value, custom[0], where)
    bucket = value.split("://", 1)[1].split("/", 1)[0]
    try:
        fs, path = pafs.FileSystem.from_uri(value)
        info = fs.get_file_info(bucket)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        raise ParameterError(f"{name}={value!r}: unsupported storage ({exc}). Use {SCHEMES}.") from None
    except OSError as exc:
        raise ParameterError(
            f"{name}={value!r}: cannot reach the bucket {bucket!r}{where}: {exc}. Check the endpoint, "
            "the network and the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for S3)."
        ) from None
    if info.type == pafs.FileType.NotFound:
        raise ParameterError(
            f"{name}={value!r}: the bucket {bucket!r} does not exist{where}. Create it, or fix the name."
        )
    try:
        write_probe(fs, path)
    except OSError as exc:
        raise ParameterError(f"{name}={value!r}: cannot write to it{where}: {exc}.") from None
    return value


def uri(filesystem, path: str) -> str:
    """A path on a pyarrow filesystem (`checkpoint.filesystem`, `checkpoint.path`) as a URI or local path."""
    scheme = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs"}.get(filesystem.type_name)
    return f"{scheme}://{path}" if scheme else path


READ_BUFFER = 64 * 1024 * 1024


class _OpenOnFirstRead(io.RawIOBase):
    """A file on a pyarrow filesystem, opened by its first read rather than before: opening asks the
    storage (an S3 HEAD), and the first read is the call `dcp_reader` gives a deadline. Each read is one
    read at an offset (`read_at`: one ranged GET)."""

    def __init__(self, filesystem, path: str) -> None:
        super().__init__()
        self._fs, self._path, self._file, self._pos = filesystem, path, None, 0
        self._lock = threading.Lock()  # several streams read one file at once (`read_at` is safe for it)

    def _opened(self):
        with self._lock:
            if self._file is None:  # a try given up while opening leaves it None: the next try opens its own
                self._file = self._fs.open_input_file(self._path)
            return self._file

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read_at(self, nbytes: int, offset: int) -> bytes:
        return self._opened().read_at(nbytes, offset)

    def readinto(self, buffer) -> int:
        data = self.read_at(len(buffer), self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos}.get(whence)
        self._pos = (self._opened().size() if base is None else base) + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        super().close()


def _torch_fsspec_filesystem(filesystem):
    """torch's distributed-checkpoint filesystem over a pyarrow `filesystem` (Ray Train's storage)."""
    from fsspec.implementations.arrow import ArrowFSWrapper
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    class PyArrowFileSystem(FileSystem):
        def __init__(self) -> None:
            self.fs = ArrowFSWrapper(filesystem)

        def init_path(self, path, **kwargs):
            return path  # a path on `filesystem`, as Ray Train gives it (no scheme)

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if mode != "rb":
                with super().create_stream(path, mode) as stream:
                    abandoned = _ABANDONED.get(threading.get_ident())
                    yield stream if abandoned is None else _Abandonable(stream, abandoned)
                return
            # Reads through a 64 MB buffer: torch.load makes many small reads, and each unbuffered read
            # of an object store file is one ranged GET (seen: minutes for the smoke run's 310 MB shard).
            with _OpenOnFirstRead(filesystem, str(path)) as raw:
                yield io.BufferedReader(raw, buffer_size=READ_BUFFER)

    return PyArrowFileSystem()


# A file of a streamed checkpoint that the storage does not finish writing in time (a bucket that stalls:
# pyarrow's S3 client has no read timeout on Linux, and waits for as long as the bucket does) is written
# again, after a backoff: each try has STALL_S plus its size at MIN_WRITE_RATE, and after WRITE_TRIES tries
# the save fails (`StorageStalled`), so the step fails before its checkpoint is registered.
STALL_S = 60.0
LIST_S = 10.0  # a listing made only to measure (what a resume read of its checkpoint)
MIN_WRITE_RATE = 10e6  # bytes/s, far below what one process writes to S3, GCS or NFS
WRITE_TRIES = 5
_ABANDONED: dict = {}  # writing thread -> the Event set when its try is given up


def _current_cuda_device() -> int | None:
    """The calling thread's CUDA device where CUDA is in use (a rank's own GPU), else None."""
    import sys

    torch = sys.modules.get("torch")  # never import torch (or start CUDA) just to ask
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


class StorageStalled(OSError):
    """A checkpoint file was not written in `WRITE_TRIES` tries (`dcp_writer`)."""


class _Abandonable:
    """A try's output stream: once the try is given up, the thread still writing it (blocked on the stalled
    bucket) never writes or closes it again. Closing would complete the upload, with tensors the training
    has changed since, over the file the next try wrote."""

    def __init__(self, stream, abandoned) -> None:
        self._stream, self._abandoned = stream, abandoned

    def _check(self) -> None:
        if self._abandoned.is_set():
            threading.Event().wait()  # for ever: this thread's upload is never completed

    def write(self, data):
        self._check()
        written = self._stream.write(data)
        self._check()
        return written

    def close(self) -> None:
        self._check()
        self._stream.close()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def with_deadline(
    what: str,
    size: int,
    work,
    *,
    stall_s: float,
    min_rate: float,
    tries: int,
    stalls: list,
    done: str = "written",
    until: float | None = None,
):
    """`work()` in a thread that has `stall_s` plus `size` at `min_rate` to finish; after a stall or an
    OSError, given up (a write's stream never written or closed again), recorded in `stalls`, and run
    again after a backoff, up to `tries` tries; then `StorageStalled` (`what` was not `done`). `until`: a
    `time.monotonic()` by which all tries must end (a save's share of the collective timeout)."""
    import logging

    log = logging.getLogger(__name__)
    per_try = deadline = stall_s + size / min_rate
    problem = "no error"
    device = _current_cuda_device()  # this rank's GPU: a new thread's current device is GPU 0
    for attempt in range(1, tries + 1):
        if until is not None:
            deadline = min(per_try, until - time.monotonic())
            if deadline <= 0:
                raise StorageStalled(
                    f"{what}: not {done} in time: this rank's checkpoint {'save' if done == 'written' else 'load'} "
                    f"has used its {COLLECTIVE_SHARE:.0%} of the process group's timeout (COLLECTIVE_TIMEOUT_S), "
                    "after which the other ranks, waiting for this one, would be killed. The storage is too "
                    f"slow for this checkpoint (last: {problem}): raise COLLECTIVE_TIMEOUT_S, or write less "
                    "often to faster storage. This checkpoint is not used."
                )
        outcome = _try_once(work, deadline, device, name=f"dcp-{what.rsplit('/', 1)[-1]}")
        if "result" in outcome:
            if attempt > 1:
                log.warning("%s: %s on try %d of %d", what, done, attempt, tries)
            return outcome["result"]
        if "error" in outcome and not isinstance(outcome["error"], OSError):
            raise outcome["error"]  # not the storage: nothing to wait out
        problem = repr(outcome["error"]) if "error" in outcome else f"not done in {deadline:.0f} s"
        log.warning("%s: try %d of %d failed (%s)", what, attempt, tries, problem)
        stalls.append({"file": what.rsplit("/", 1)[-1], "try": attempt, "problem": problem})
        if attempt < tries:
            backoff = min(2 ** (attempt - 1), 30)  # 1, 2, 4, ... s
            time.sleep(backoff if until is None else max(0, min(backoff, until - time.monotonic())))
    raise StorageStalled(
        f"{what}: not {done} in {tries} tries ({deadline:.0f} s each, last: {problem}). The storage "
        + (
            "stalled or failed: this checkpoint is not registered, and the run restarts from the last one "
            "that is."
            if done == "written"
            else "stalled or failed while this checkpoint was read: what reads it fails (in training, the "
            "attempt: Ray Train's next one reads it again)."
        )
    )


def _try_once(work, deadline: float, device, name: str) -> dict:
    """`work()` in a thread of its own, on this rank's CUDA `device` (None: none), for at most `deadline`
    seconds: {"result": ...}, {"error": the exception it raised}, or {} if it was not done by then (it is
    then abandoned: a stream it writes to is never written or closed again)."""
    outcome: dict = {}
    abandoned = threading.Event()

    def run() -> None:
        _ABANDONED[threading.get_ident()] = abandoned
        try:
            if device is not None:  # DCP's loader takes the current device's stream
                import torch

                torch.cuda.set_device(device)
            outcome["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller, then tried again
            outcome["error"] = exc
        finally:
            _ABANDONED.pop(threading.get_ident(), None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(deadline)
    if "result" not in outcome:
        abandoned.set()
    return outcome


def _collective_deadline() -> float | None:
    """The `time.monotonic()` by which this rank's save or load must end: `COLLECTIVE_SHARE` of its process
    group's timeout from now; None without a process group (one process)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    import torch

    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda") if torch.device("cuda") in group._device_types else torch.device("cpu")
    timeout = group._get_backend(device).options._timeout.total_seconds()  # TorchConfig(timeout_s=...)
    return time.monotonic() + COLLECTIVE_SHARE * timeout


def _stream_pool(streams: int):
    """`streams` threads on this thread's CUDA device (a new thread's current device is GPU 0, and a
    context there would take that GPU's memory from the rank that owns it)."""
    from concurrent.futures import ThreadPoolExecutor

    device = _current_cuda_device()

    def on_device() -> None:
        if device is not None:
            import torch

            torch.cuda.set_device(device)

    return ThreadPoolExecutor(max_workers=streams, thread_name_prefix="dcp-stream", initializer=on_device)


def _in_streams(streams: int, calls: list[Callable]) -> list:
    """Each of `calls` run `streams` at a time (`_stream_pool`); their results in order. The first failure
    cancels the calls not started yet and is raised (those running end at their deadlines)."""
    pool = _stream_pool(streams)
    try:
        return [f.result() for f in [pool.submit(call) for call in calls]]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def dcp_writer(
    filesystem,
    path: str,
    file_bytes: int = STREAM_FILE_BYTES,
    stall_s: float = STALL_S,
    min_rate: float = MIN_WRITE_RATE,
    tries: int = WRITE_TRIES,
    streams: int = STREAMS,
):
    """A `torch.distributed.checkpoint` writer that writes straight to `path` on a pyarrow `filesystem`.

    Used by the Llama notebook's checkpoints ("5. Sharded checkpoints"): each rank streams its shard to
    the bucket (or NFS folder), with no local copy to stage and upload, in files of at most `file_bytes`
    of tensors (`__<rank>_0.distcp`, `__<rank>_1.distcp`, ...; a single tensor larger than that gets a
    file of its own), `streams` files at once, so that a rank holds at most `streams` files' tensors in
    host RAM. Pass it as `storage_writer=`, without `checkpoint_id` (which would reset it to a local path).

    A storage that stalls or fails costs time, not the checkpoint: each data file (and rank 0's index,
    `.metadata`) is written in a thread that has `stall_s` plus its size at `min_rate` to finish; a try
    that fails or runs out of time is given up and the file written again after a backoff, up to `tries`
    tries (`writer.stalls` lists each one given up), and then `StorageStalled` fails the save, before the
    checkpoint is reported. The whole save has `COLLECTIVE_SHARE` of the process group's timeout.
    """
    import queue

    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _item_size
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.futures import Future

    class BoundedFileWriter(FsspecWriter):
        def write_data(self, plan, planner):
            files, size = [[]], 0
            for item in plan.items:
                n = 0 if item.type == WriteItemType.BYTE_IO else _item_size(item)
                if files[-1] and size + n > file_bytes:
                    files.append([])
                    size = 0
                files[-1].append(item)
                size += n
            bounds["until"] = _collective_deadline()
            names = [f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(files))]
            entries = [(self.fs.concat_path(self.path, n), n, f) for n, f in zip(names, files, strict=True)]
            written = _in_streams(streams, [functools.partial(self._write_file, e, planner) for e in entries])
            done: Future = Future()
            done.set_result([result for results in written for result in results])
            return done

        def _write_file(self, entry, planner) -> list:
            """One data file (a queue of one entry: torch's writer takes files from a queue)."""

            def write() -> list:
                files: queue.Queue = queue.Queue()
                files.put(entry)
                return FsspecWriter._write_data(self, planner, files).value()

            size = sum(_item_size(i) for i in entry[2] if i.type != WriteItemType.BYTE_IO)
            return with_deadline(entry[0], size, write, **bounds)

        def finish(self, metadata, results) -> None:
            # Rank 0's index, `.metadata`: written to a temporary name, then renamed.
            path = f"{self.path}/.metadata"
            with_deadline(path, 0, lambda: FsspecWriter.finish(self, metadata, results), **bounds)

    writer = BoundedFileWriter(path, sync_files=False)  # fsync means nothing for an object store
    writer.stalls = []  # each try given up: {"file", "try", "problem"}
    bounds = dict(stall_s=stall_s, min_rate=min_rate, tries=tries, stalls=writer.stalls)
    writer.fs = _torch_fsspec_filesystem(filesystem)
    writer.path = path
    return writer


def upload_folder(local: str, filesystem, path: str, stall_s: float = STALL_S) -> None:
    """Copy the local folder `local` to `path` on a pyarrow `filesystem` (`pafs.copy_files`, 64 MiB parts),
    with a deadline: `stall_s` plus its size at `MIN_WRITE_RATE`. Past it, `StorageStalled`, at once: a
    stalled copy cannot be stopped, so it is not tried again beside itself."""
    import pyarrow.fs as pafs

    size = sum(f.stat().st_size for f in Path(local).rglob("*") if f.is_file())
    filesystem.create_dir(path)

    def copy() -> None:
        pafs.copy_files(local, path, destination_filesystem=filesystem, chunk_size=64 << 20)

    with_deadline(path, size, copy, stall_s=stall_s, min_rate=MIN_WRITE_RATE, tries=1, stalls=[])


def write_json(filesystem, path: str, value, stall_s: float = STALL_S, tries: int = WRITE_TRIES) -> None:
    """Write `value` as JSON to `path` on a pyarrow `filesystem`, with `dcp_writer`'s deadline and tries: a
    small file next to a checkpoint (the Llama notebooks' `trainer_state.json`) never waits on a stalled
    bucket for longer than the checkpoint's own files would."""
    import json

    data = json.dumps(value).encode()

    def write() -> None:
        with filesystem.open_output_stream(path) as f:
            f.write(data)

    with_deadline(path, len(data), write, stall_s=stall_s, min_rate=MIN_WRITE_RATE, tries=tries, stalls=[])


def read_json(filesystem, path: str, stall_s: float = STALL_S, tries: int = WRITE_TRIES):
    """Read the JSON file at `path` on a pyarrow `filesystem`, with `dcp_reader`'s deadline and tries."""
    import json

    return json.loads(read_small(filesystem, path, stall_s, tries))


def read_small(filesystem, path: str, stall_s: float = STALL_S, tries: int = WRITE_TRIES) -> str:
    """The text of a small file (a JSON, DeepSpeed's `latest`) at `path`, with `dcp_reader`'s deadline."""

    def read():
        with filesystem.open_input_stream(path) as f:
            return f.read().decode()

    return with_deadline(
        path, 1 << 20, read, stall_s=stall_s, min_rate=MIN_WRITE_RATE, tries=tries, stalls=[], done="read"
    )


def dcp_reader(
    filesystem,
    path: str,
    stall_s: float = STALL_S,
    min_rate: float = MIN_WRITE_RATE,
    tries: int = WRITE_TRIES,
    streams: int = STREAMS,
):
    """A `torch.distributed.checkpoint` reader for a checkpoint at `path` on a pyarrow `filesystem`.

    Each rank reads only the byte ranges it needs (its shard; or only the model's weights and not the
    optimizer state), each with one ranged read of exactly its bytes: torch's own reader reads items in
    no particular order through one buffered stream, and each short read after a long seek would refill
    the whole buffer. `reader.bytes_read` counts what it fetched (the `.metadata` index included). The
    Llama and Dolly notebooks resume with it, and Dolly's generation task reads the weights.

    `streams` ranges are fetched at once, ahead of torch's loop over them (at most `streams` waiting in
    host RAM). Each read has a deadline, as `dcp_writer`'s writes do (`stall_s` plus its size at `min_rate`,
    `tries` tries, `reader.stalls`, the whole load within `COLLECTIVE_SHARE` of the process group's
    timeout): a stalled bucket fails the load with `StorageStalled`, not the watchdog of the ranks
    waiting for this one.
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class RangeReader(FsspecReader):
        bytes_read = 0
        _metadata = None

        def read_metadata(self, *args, **kwargs):
            # DCP's index of the checkpoint (`.metadata`), fetched once: torch asks for it again in each
            # load, and a resume loads twice (the model, then the optimizer state).
            if self._metadata is None:
                read = functools.partial(FsspecReader.read_metadata, self, *args, **kwargs)
                self._metadata = with_deadline(f"{path}/.metadata", 0, read, **bounds)
                info = functools.partial(
                    filesystem.get_file_info, f"{path}/.metadata"
                )  # a HEAD: a deadline too
                self.bytes_read += with_deadline(f"{path}/.metadata", 0, info, **bounds).size
            metadata = copy.deepcopy(self._metadata)
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            # torch's loop asks for the ranges one at a time (`_slice_file`), grouped by file in plan order;
            # in that order, `streams` of them are fetched ahead of it.
            bounds["until"] = _collective_deadline()
            per_file: dict[str, list] = {}
            for item in plan.items:
                sinfo = self.storage_data[item.storage_index]
                per_file.setdefault(sinfo.relative_path, []).append(sinfo)
            files = {name: _OpenOnFirstRead(filesystem, f"{path}/{name}") for name in per_file}
            self._ahead = iter([s for sinfos in per_file.values() for s in sinfos])
            self._fetched: dict = {}
            self._pool = _stream_pool(streams)
            self._fetch = lambda sinfo: self._pool.submit(self._read, files[sinfo.relative_path], sinfo)
            try:
                self._top_up()
                return FsspecReader.read_data(self, plan, planner)
            finally:
                self._pool.shutdown(wait=True, cancel_futures=True)
                for file in files.values():
                    file.close()

        def _top_up(self) -> None:
            while len(self._fetched) < streams and (sinfo := next(self._ahead, None)) is not None:
                self._fetched[(sinfo.relative_path, sinfo.offset)] = self._fetch(sinfo)

        def _read(self, file, sinfo) -> bytes:
            what = f"{path}/{sinfo.relative_path} ({sinfo.length} bytes at {sinfo.offset})"
            read = functools.partial(file.read_at, sinfo.length, sinfo.offset)
            return with_deadline(what, sinfo.length, read, **bounds)

        def _slice_file(self, file, sinfo):
            # The range fetched ahead (or, asked for out of that order, fetched now).
            fetched = self._fetched.pop((sinfo.relative_path, sinfo.offset), None) or self._fetch(sinfo)
            self._top_up()
            self.bytes_read += sinfo.length
            return io.BytesIO(fetched.result())

    reader = RangeReader(path)
    reader.stalls = []  # each try given up: {"file", "try", "problem"}
    bounds = dict(stall_s=stall_s, min_rate=min_rate, tries=tries, stalls=reader.stalls, done="read")
    reader.fs = _torch_fsspec_filesystem(filesystem)
    reader.path = path
    LAST_READ[:] = [reader, filesystem, path]  # for this worker's observer: what resuming read
    return reader


def _file_sizes(fs, root: str) -> dict[str, int]:
    """{path relative to `root`: size in bytes} of every file under `root` on the pyarrow filesystem `fs`."""
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    return {i.path[len(root) :].lstrip("/"): i.size for i in infos if i.type == pafs.FileType.File}


@contextlib.contextmanager
def fetch_checkpoint(checkpoint, files: Callable[[str], bool] | None = None) -> Iterator[_FetchedFolder]:
    """A local folder with a Ray Train checkpoint's files, for this process only.

    The checkpoint's own folder where it is on a local (or NFS) filesystem; otherwise a private
    temporary copy, deleted at the end of the block. Ray's `Checkpoint.as_directory()` downloads to one
    folder per checkpoint, shared by every process on the node, and a process that arrives after
    another's download has finished downloads again into it, rewriting the files the first one is
    reading: on the project's two-node cluster (two Ray nodes on one machine, as two ranks on one
    8-GPU node) a resuming rank read an empty `trainer_state.json`.

    `files`, a filter of paths relative to the checkpoint (e.g. `helpers.zero_checkpoint.zero_rank_files(rank)`):
    copy only those, for a process that reads only part of a sharded checkpoint. The folder is a `str`
    that also says what it cost (`_FetchedFolder`): `bytes_fetched`, the size of the files chosen (copied;
    on a local or NFS filesystem, read where they are), and `checkpoint_bytes`, the whole checkpoint's.

    The listing and the copy have deadlines (`STALL_S`, and the copy's size at `MIN_WRITE_RATE`): a stalled
    bucket fails the block with `StorageStalled`, not a wait for as long as the bucket stalls.
    """
    import pyarrow.fs as pafs

    fs, root = checkpoint.filesystem, checkpoint.path.rstrip("/")
    bounds = dict(stall_s=STALL_S, min_rate=MIN_WRITE_RATE, stalls=[], done="read")
    sizes = with_deadline(root, 0, lambda: _file_sizes(fs, root), tries=WRITE_TRIES, **bounds)
    chosen = [path for path in sizes if files is None or files(path)]

    def fetched(folder: str) -> _FetchedFolder:
        got = _FetchedFolder(folder, sum(sizes[p] for p in chosen), sum(sizes.values()))
        LAST_FETCH[:] = [got.bytes_fetched, got.checkpoint_bytes]  # for this worker's observer
        return got

    if isinstance(fs, pafs.LocalFileSystem):
        yield fetched(checkpoint.path)
        return
    # A stalled copy cannot be stopped: it is not tried again beside itself, and its folder is removed
    # around it.
    with tempfile.TemporaryDirectory(prefix="checkpoint-", ignore_cleanup_errors=True) as folder:

        def copy() -> None:
            for path in chosen:
                os.makedirs(os.path.dirname(os.path.join(folder, path)), exist_ok=True)
                pafs.copy_files(
                    f"{root}/{path}",
                    os.path.join(folder, path),
                    source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem(),
                )

        with_deadline(root, sum(sizes[p] for p in chosen), copy, tries=1, **bounds)
        yield fetched(folder)


LAST_FETCH: list[int] = []  # (bytes fetched, checkpoint bytes) of this process's last fetch_checkpoint
LAST_READ: list = []  # (reader, filesystem, path) of this process's last dcp_reader


def take_last_fetch() -> tuple[int, int] | None:
    """What this process's last `fetch_checkpoint` fetched, or its last `dcp_reader` read, once: (bytes
    fetched, the checkpoint's bytes)."""
    got = tuple(LAST_FETCH) or None
    if got is None and LAST_READ:
        reader, fs, path = LAST_READ
        try:  # a LIST of the bucket, for a measurement: a stalled one costs the step LIST_S at most
            sizes = with_deadline(
                path,
                0,
                lambda: _file_sizes(fs, path),
                stall_s=LIST_S,
                min_rate=1,
                tries=1,
                stalls=[],
                done="listed",
            )
            got = (reader.bytes_read, sum(sizes.values()))
        except (StorageStalled, OSError):
            got = (reader.bytes_read, None)
    LAST_FETCH.clear()
    LAST_READ.clear()
    return got


def trainer_rank_files(rank: int) -> Callable[[str], bool]:
    """The files of a Hugging Face `Trainer` checkpoint that rank `rank` reads to resume, a filter for
    `fetch_checkpoint(checkpoint, files=...)`: all but the other ranks' random states
    (`rng_state_<r>.pth`). Under DDP every rank holds the whole model and optimizer state, so it needs
    the rest: the weights, `optimizer.pt`, `scheduler.pt`, `trainer_state.json`."""

    def wanted(path: str) -> bool:
        name = path.rsplit("/", 1)[-1]
        if name.startswith("rng_state_") and name.endswith(".pth"):
            return name == f"rng_state_{rank}.pth"
        return True

    return wanted


class _FetchedFolder(str):
    """A local folder (`fetch_checkpoint`'s) that is a `str`, and says what it cost: `bytes_fetched` of
    the `checkpoint_bytes` of the whole checkpoint."""

    bytes_fetched: int
    checkpoint_bytes: int

    def __new__(cls, path: str, bytes_fetched: int, checkpoint_bytes: int) -> _FetchedFolder:
        folder = super().__new__(cls, path)
        folder.bytes_fetched, folder.checkpoint_bytes = bytes_fetched, checkpoint_bytes
        return folder

    def __getnewargs__(self) -> tuple:  # copied (transformers deep-copies a path it is given) or pickled
        return str(self), self.bytes_fetched, self.checkpoint_bytes


class StoredFolder(str):
    """A folder of a Ray Train checkpoint, named by its URI (or local path), to be read where it is stored.

    `checkpoint_in_place(checkpoint, "checkpoint.ckpt")` gives one; passed as Lightning's `ckpt_path` to the
    FSDP strategy of `helpers.fsdp.fsdp_strategy_class`, each rank reads from the bucket (or NFS folder)
    only the byte ranges of its own shards, with `dcp_reader`, instead of downloading the whole
    checkpoint first. After the load, `bytes_read` says what the rank read, of `checkpoint_bytes`.
    """

    filesystem: object
    path: str
    checkpoint_bytes: int
    bytes_read: int

    def __new__(cls, filesystem, path: str, checkpoint_bytes: int) -> StoredFolder:
        folder = super().__new__(cls, uri(filesystem, path))
        folder.filesystem, folder.path = filesystem, path
        folder.checkpoint_bytes, folder.bytes_read = checkpoint_bytes, 0
        return folder


def checkpoint_in_place(checkpoint, subfolder: str = "") -> StoredFolder:
    """`subfolder` of a Ray Train `checkpoint`, to be read in place (`StoredFolder`); `checkpoint_bytes`
    is the size of the whole checkpoint."""
    fs, root = checkpoint.filesystem, checkpoint.path.rstrip("/")
    size = sum(listed_with_deadline(fs, root).values())
    return StoredFolder(fs, f"{root}/{subfolder}" if subfolder else root, size)


def listed_with_deadline(fs, root: str) -> dict[str, int]:
    """`root`'s files and sizes on `fs`, the listing given `fetch`'s deadline and tries (`STALL_S` each):
    a stalled bucket fails a resume with `StorageStalled`, not a wait for as long as it stalls."""
    bounds = dict(stall_s=STALL_S, min_rate=MIN_WRITE_RATE, stalls=[], done="listed")
    return with_deadline(root, 0, lambda: _file_sizes(fs, root), tries=WRITE_TRIES, **bounds)
