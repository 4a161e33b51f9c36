"""Run the engine contract against one in-process VLLMEngine; write results as JSON.

Usage: python tests/engines/_vllm_contract.py MODEL_DIR OUT_JSON

Runs in its own process because an in-process vLLM engine mutates its host process. One engine
serves every check (vLLM's import dominates start-up); "host_state" records what creating the
engine and generating once left changed in this process.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from composer_lightning.engines import VLLMEngine
from composer_lightning.models.random import load_policy
from tests.engines import engine_contract as contract


def main(model_dir: str, out_path: str) -> None:
    results: dict = {"timing": {}}
    policy = load_policy(model_dir)
    torch.manual_seed(1234)
    before = contract.host_snapshot()
    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="float32", seed=0)
    results["timing"]["engine_start_s"] = time.perf_counter() - t0
    for name, check in {**contract.CHECKS, **contract.VLLM_CHECKS}.items():
        t0 = time.perf_counter()
        try:
            info = check(engine, policy)
            results[name] = {"ok": True, "info": info}
        except Exception:  # reported per case to the pytest process
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results["timing"][name] = time.perf_counter() - t0
        if name == "shapes":  # engine created and generated once
            changes = contract.host_changes(before)
            # Known and documented, not undone: vLLM initialises a world-size-1 gloo group.
            known = {"torch_distributed_initialized": torch.distributed.is_initialized()}
            results["host_state"] = {"ok": not changes, "info": {"changes": changes, **known}}
            if changes:
                results["host_state"]["error"] = f"host process changed: {changes}"
    with open(out_path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM's interpreter teardown takes seconds and adds nothing here


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
