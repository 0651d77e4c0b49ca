"""Build the ops DeepSpeed compiles on first use, now: `python ci/build_deepspeed_ops.py [BUILDER ...]`.

On a machine without a GPU, DeepSpeed compiles two C++ ops the first time a process needs them, into
torch's extension cache (`TORCH_EXTENSIONS_DIR`): CPU Adam (ZeRO-Offload's optimizer) and its
shared-memory collectives (built whenever DeepSpeed starts on CPU). In a new virtualenv that is 75 s of
both cores of a 2-core machine, in the middle of whichever run comes first. This builds both, at once,
with exactly the calls a run makes (`load()` of the accelerator's op builders), so a run finds them built;
when they are built already, it takes a few seconds. A run that needs an op while this builds it waits on
torch's build lock, as for any other process's build. Interrupted (Ctrl-C, SIGINT), torch releases that
lock on the way out.

`make install` builds the shared-memory op (`ShareMemCommBuilder`, about 30 s of both cores here), which every
DeepSpeed run on CPU loads, so that a learner's first GPT-2 run compiles nothing. CPU Adam is needed only
with ZeRO-Offload: `make test` builds it (and anything else missing) at the lowest CPU priority from the
session's start (tests/conftest.py), in the time the tests leave idle. Arguments: the builders to build
(default: both).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")


def build(name: str) -> str:
    from deepspeed.accelerator import get_accelerator

    start = time.monotonic()
    builder = get_accelerator().create_op_builder(name)
    if builder is None or not builder.is_compatible():
        return f"{name}: not used on this machine"
    builder.load(verbose=False)
    return f"{builder.absolute_name()}: ready in {time.monotonic() - start:.0f} s"


def main(argv: list[str]) -> int:
    from deepspeed.accelerator import get_accelerator  # imported once, before the threads

    ops = argv or OPS
    if unknown := set(ops) - set(OPS):
        print(f"unknown op builder(s) {sorted(unknown)}; these are built: {', '.join(OPS)}", file=sys.stderr)
        return 2
    if get_accelerator().device_name() != "cpu":
        print(f"DeepSpeed runs on {get_accelerator().device_name()} here: no CPU ops to build")
        return 0
    with ThreadPoolExecutor(len(ops)) as pool:
        for line in pool.map(build, ops):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
