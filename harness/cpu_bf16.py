"""bf16 matrix products at fp32 speed on a CPU without bf16 instructions (most laptops: AVX2 only).

There torch multiplies bf16 matrices in scalar loops, 6-50 times slower than fp32 (measured on a 2-core AMD
EPYC with AVX2: a 256x512 by 512x1024 product in 37 ms, 276 ms with the weight not transposed, against
6 ms in fp32), and a smoke run's bf16 steps take 5 times as long. `install` registers CPU kernels for
`mm`, `addmm`, `bmm` and `baddbmm` that multiply bf16 inputs in fp32 and round the product to bf16 once:
what bf16 hardware does (fp32 accumulation), so the losses are those of a CPU with bf16 instructions to
within the order of the sums. Other dtypes, and every GPU, go to torch's own kernels.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

__all__ = ["install", "install_after_torch", "needed"]

_library = None  # the registration, kept alive for the process's lifetime


def needed() -> bool:
    """Whether this CPU lacks the bf16 instructions torch's fast kernels (oneDNN) use."""
    import torch

    return not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def install(force: bool = False) -> bool:
    """Register the kernels where `needed()` (or `force`), once per process; return whether they are in
    place."""
    global _library
    if _library is not None:
        return True
    if not (force or needed()):
        return False
    import torch

    aten, bf16 = torch.ops.aten, torch.bfloat16

    def product(op, shape, *tensors, **kwargs):
        # op.out: torch's own kernel (only op.default is replaced below), in fp32 where a factor is bf16.
        upcast = tensors[-1].dtype == bf16
        args = [t.float() for t in tensors] if upcast else tensors
        out = op.out(*args, **kwargs, out=args[-1].new_empty(shape))
        return out.to(bf16) if upcast else out

    kernels = {
        "mm": lambda a, b: product(aten.mm, (a.shape[0], b.shape[1]), a, b),
        "bmm": lambda a, b: product(aten.bmm, (a.shape[0], a.shape[1], b.shape[2]), a, b),
        "addmm": lambda c, a, b, *, beta=1, alpha=1: product(
            aten.addmm, (a.shape[0], b.shape[1]), c, a, b, beta=beta, alpha=alpha
        ),
        "baddbmm": lambda c, a, b, *, beta=1, alpha=1: product(
            aten.baddbmm, (a.shape[0], a.shape[1], b.shape[2]), c, a, b, beta=beta, alpha=alpha
        ),
    }
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        for name, kernel in kernels.items():
            library.impl(name, kernel, "CPU")
    _library = library
    return True


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `torch` is first imported, it runs `install` after torch's own code.

    A lookup that does not import (`importlib.util.find_spec("torch")`, as transformers' `is_torch_available`
    does before any import of torch) gets a spec whose loader is wrapped too, and the finder stays in place
    until torch's module has really been executed: the import that follows finds it again."""

    _looking = False

    def find_spec(self, name, path, target=None):
        if name != "torch" or self._looking:
            return None
        self._looking = True
        try:
            spec = importlib.util.find_spec("torch")  # the finders after this one
        finally:
            self._looking = False
        if spec is None or spec.loader is None:
            return spec
        run_torch = spec.loader.exec_module

        def exec_module(module):
            run_torch(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            install()

        spec.loader.exec_module = exec_module
        return spec


def install_after_torch() -> None:
    """`install` in this process as soon as it imports torch (now, if it has): for a Ray worker, whose
    setup hook should not import torch into processes that never use it (3 s each on 2 cores)."""
    if "torch" in sys.modules:
        install()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())
