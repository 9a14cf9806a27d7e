"""The child process of `engine_choice.measure_engines`: both rollout engines built as a worker builds them and
timed in turns at the run's rollout shape (`time_engines`; the module docstring of `engine_choice` says how).
Run as `python -m yatt_ray.rollout.engine_timing '<spec json>'`; it prints its result on a line of its own
after `engine_choice.RESULT_MARK`."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

from yatt_ray.rollout.engine_choice import (
    CANDIDATES,
    LONG_CALL_S,
    RESULT_MARK,
    ROUNDS,
    WARM_UP_TOKENS,
    RolloutShape,
)


def time_engines(model_dir: str, shape: RolloutShape, engine_kwargs: dict[str, Any]) -> dict[str, float]:
    """The measurement itself, in this process (the child's part of `measure_engines`)."""
    import torch

    from yatt_ray.model_dir import read_config
    from yatt_ray.rollout import GenerateRequest, SamplingSpec, complete, make_engine

    if shape.threads > 0:
        torch.set_num_threads(shape.threads)  # the vLLM engine restores it after its start-up
    if shape.beside_trainer:
        from yatt_ray.host_memory import keep_freed_memory

        keep_freed_memory()  # as `train.cpu_shims` sets it in a training worker
    cfg = read_config(model_dir)
    vocab = int((cfg.get("text_config") or cfg)["vocab_size"])
    engines = {kind: make_engine(kind, model_dir, **engine_kwargs) for kind in CANDIDATES}

    def once(kind: str, call: int, prompts: int = shape.prompts, tokens: int = shape.max_new_tokens) -> float:
        draw = torch.Generator().manual_seed(call)  # new prompts each call, the same for both engines
        ids = torch.randint(0, vocab, (prompts, shape.prompt_tokens), generator=draw).tolist()
        spec = SamplingSpec(n=shape.n, max_new_tokens=tokens, seed=call, ignore_eos=True)
        start = time.perf_counter()
        complete(engines[kind].generate(GenerateRequest(ids, spec)))
        return time.perf_counter() - start

    try:
        for kind in CANDIDATES:  # the first call's lazy set-up (vLLM's kernels, the HF engine's caches)
            once(kind, 0, prompts=1, tokens=min(WARM_UP_TOKENS, shape.max_new_tokens))
        best = dict.fromkeys(CANDIDATES, math.inf)
        rounds = ROUNDS
        call = 1
        while call <= rounds:
            for kind in CANDIDATES if call % 2 else CANDIDATES[::-1]:  # each goes first in turn
                best[kind] = min(best[kind], once(kind, call))
            if call == 1 and max(best.values()) > LONG_CALL_S:
                rounds = 2
            call += 1
    finally:
        for engine in engines.values():
            engine.close()
    return best


def _main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    seconds = time_engines(spec["model_dir"], RolloutShape(**spec["shape"]), spec["engine_kwargs"])
    print(RESULT_MARK + json.dumps(seconds), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
