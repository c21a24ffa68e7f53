"""``--nproc_per_node auto|cpu|gpu|xpu|N``, with Ascend NPUs counted as GPUs."""

from __future__ import annotations

import importlib.util

import torch

from .args import UsageError


def _npu_count() -> int:
    if importlib.util.find_spec("torch_npu") is None:
        return 0
    import torch_npu  # noqa: F401  (registers torch.npu)

    return torch.npu.device_count() if torch.npu.is_available() else 0  # type: ignore[attr-defined]


def resolve_nproc_per_node(value: str) -> str:
    """A number as a string; torch's own resolution is used for everything but NPUs."""
    v = value.strip().lower()
    if v.isdigit():
        if int(v) < 1:
            raise UsageError(f"--nproc_per_node {value} must be at least 1")
        return v
    if v in ("gpu", "auto"):
        if torch.cuda.is_available():
            return str(torch.cuda.device_count())
        npus = _npu_count()
        if npus:
            return str(npus)
        if v == "gpu":
            raise UsageError(
                "--nproc_per_node gpu: no CUDA GPU or Ascend NPU found on this node; "
                "write --nproc_per_node cpu or a number"
            )
        return v  # torch resolves auto: another accelerator, else the CPU count
    if v == "xpu" and not torch.xpu.is_available():  # (torch's own check raises, with a traceback)
        raise UsageError("--nproc_per_node xpu: no Intel XPU found on this node; write --nproc_per_node cpu or a number")
    if v in ("cpu", "xpu") or v == torch._C._get_privateuse1_backend_name():
        return v
    raise UsageError(
        f"--nproc_per_node '{value}' is not valid: write a number, auto, cpu, gpu or xpu"
    )
