"""bf16 on CPU only where the CPU computes it: `trainer.precision: bf16-mixed` checked at launch.

`bf16-mixed` keeps fp32 master weights and optimizer state and runs the matmuls in bf16. On a
CPU with bf16 units (AVX512-BF16, AMX) that is faster than fp32: SmolLM2's update 1.49× on these
machines (`bench/roofline.py`). Without them PyTorch emulates bf16 and the same step runs several
times slower (7.8× measured on an AVX2 CPU). So a config that asks for `bf16-mixed` on CPU (the
shipped real-model configs do) keeps it where the units are and trains in `32-true` elsewhere,
and either way the launch says so in one line. `COMPOSER_CPU_BF16=1` keeps an emulated
`bf16-mixed` (to check bf16 numerics on a CPU without the units); a GPU run is not touched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

#: The mixed bf16 precisions this check applies to (Lightning's spellings).
_BF16_MIXED = ("bf16-mixed", "bf16")
#: torch.cpu's probes of bf16 units, by the name a user sees in `lscpu`.
_UNITS = (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))


def cpu_bf16_units() -> str | None:
    """The bf16 units this CPU has ("AVX512-BF16", "AMX", or both joined by " and "), None
    when it has neither (bf16 is then emulated)."""
    import torch

    found = [name for name, probe in _UNITS if getattr(torch.cpu, probe, lambda: False)()]
    return " and ".join(found) or None


def _on_cpu(accelerator: Any) -> bool:
    name = str(accelerator if accelerator is not None else "auto").lower()
    if name == "cpu":
        return True
    if name != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def resolve_cpu_precision(
    trainer: Any, units: str | None = None, env: Mapping[str, str] | None = None
) -> str | None:
    """Keep `bf16-mixed` on a CPU with bf16 units; make it `32-true` on one without.

    Args:
        trainer: the `trainer` section of the parsed configuration (changed in place).
        units: the CPU's bf16 units (`cpu_bf16_units()`'s answer); detected when None.
        env: the environment (`os.environ` when None); `COMPOSER_CPU_BF16=1` keeps an
            emulated bf16-mixed.

    Returns:
        The launch's line about the precision, or None when the run is not bf16-mixed on CPU.
    """
    if trainer is None or str(trainer.get("precision")) not in _BF16_MIXED:
        return None
    if not _on_cpu(trainer.get("accelerator")):
        return None
    units = cpu_bf16_units() if units is None else units
    if units:
        return (
            f"trainer.precision bf16-mixed on this CPU's bf16 units ({units}): fp32 master "
            "weights and optimizer state, bf16 matmuls"
        )
    if (os.environ if env is None else env).get("COMPOSER_CPU_BF16") == "1":
        return (
            "trainer.precision bf16-mixed kept (COMPOSER_CPU_BF16=1) on a CPU without bf16 "
            "units (AVX512-BF16 or AMX): emulated, several times slower than 32-true"
        )
    trainer["precision"] = "32-true"
    return (
        "trainer.precision bf16-mixed -> 32-true: this CPU has no bf16 units (AVX512-BF16 or "
        "AMX), where bf16 is emulated and several times slower; COMPOSER_CPU_BF16=1 keeps it"
    )
