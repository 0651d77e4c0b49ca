"""How much CPU memory a block of code took in this process, at its peak: the Llama notebook's RAM table.

Used in section 6 of llama_fsdp ("Load and shard, measured") and read back in section 8 ("Challenge 1, RAM").

Like the `TorchTracemalloc` tracker of the Hugging Face "Fine-tuning Llama 2 70B using PyTorch FSDP"
post, for the CPU side: resident memory (RSS) before, at the end, and at its peak, sampled by a
background thread, because a peak inside a C++ call (reading a checkpoint) is gone by the time
the block ends. The sampler is a Python thread, so it samples only while the measured code releases
the GIL (torch and safetensors do in their heavy calls); a peak inside one long GIL-holding call is missed.
"""

from __future__ import annotations

import threading

__all__ = ["PeakRSS"]

_MB = 2**20


class PeakRSS:
    """`with PeakRSS() as mem: ...`, then `mem.before_mb`, `mem.end_growth_mb`, `mem.peak_growth_mb`."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.before = self.end = self.peak = 0

    def _rss(self) -> int:
        return self._process.memory_info().rss

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> PeakRSS:
        import psutil

        self._process = psutil.Process()
        self.before = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.end = self._rss()
        self.peak = max(self.peak, self.end)

    @property
    def before_mb(self) -> float:
        return self.before / _MB

    @property
    def end_growth_mb(self) -> float:
        """What the block left behind (end - before)."""
        return (self.end - self.before) / _MB

    @property
    def peak_growth_mb(self) -> float:
        """The most the block held at once (peak - before): what decides an out-of-memory kill."""
        return (self.peak - self.before) / _MB

    def as_dict(self) -> dict[str, float]:
        return {
            "before_mb": round(self.before_mb, 1),
            "end_growth_mb": round(self.end_growth_mb, 1),
            "peak_growth_mb": round(self.peak_growth_mb, 1),
        }
