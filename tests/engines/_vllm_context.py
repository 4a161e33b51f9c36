"""Start VLLMEngine on a model whose own context (131,072 tokens, 16 KiB of KV cache each:
2 GiB) does not fit its 1 GiB KV cache; write what happened as JSON.

Usage: python tests/engines/_vllm_context.py MODEL_DIR OUT_JSON

Runs in its own process (an in-process vLLM engine changes its host process). First a start
without `tokens_needed`: vLLM takes the model's 131,072 tokens and refuses; then one given the
run's need (22 tokens), which holds a context sized for it and generates.
"""

from __future__ import annotations

import json
import os
import sys

from composer_lightning.engines import EngineContext, SamplingConfig, VLLMEngine
from composer_lightning.runtime.errors import ConfigError


def main(model_dir: str, out_path: str) -> None:
    results: dict = {}
    refused = VLLMEngine(model_dir, kv_cache_gib=1)
    try:
        refused.start(EngineContext())
        results["refused"] = None
    except ConfigError as err:
        results["refused"] = str(err)
    sized = VLLMEngine(model_dir, kv_cache_gib=1)
    sized.start(EngineContext(tokens_needed=22))
    results["max_model_len"] = sized.llm.llm_engine.model_config.max_model_len
    out = sized.generate([[0, 5, 6]], 2, SamplingConfig(max_tokens=4, seed=0))
    results["generated"] = [len(c.token_ids) for c in out[0]]
    with open(out_path, "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # vLLM's interpreter teardown takes seconds and adds nothing here


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
