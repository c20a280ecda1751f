"""Isolation oracles: a second turn under pressure answers from its own KV, token for token.

Through the real engine on CPU (in-process, float32, the six-layer tiny GLM-5 with
sharp weights and index top-K 32), the two worst cases of one request's KV ending up
in another's:

- a session's second turn takes a device prefix hit while pressure relief demotes a
  decoding victim and leases the victim a hot buffer: the hit's blocks sat unreferenced
  in the free queue, where the lease could take them, and the resolver would then write
  the victim's rows into the session's prefix;
- a decode instance (ExampleConnector, `kv_consumer`) whose host pool is full of cached
  pages: a session's second turn finds its first turn's pages in the host pool while,
  in the same step, another session's import lands in the host pool and needs pages.

Each is compared with one all-resident run computing the same prompts in the same
prefill chunks with the same requests in each forward (`alike`), so a difference in a
token means a wrong KV row, not rounding. The engine runs HiSparse's ownership check
after every schedule and every output (VLLM_HISPARSE_CHECK_OWNERSHIP=1).
"""

from __future__ import annotations

import random

import pytest
from engine import model_dir, running_llm
from oracle_runs import SIX_LAYERS, alike, multiprocessing_off

from vllm import SamplingParams

pytestmark = pytest.mark.slow

BLOCK = 64
PAGE_GIB = 6 * BLOCK * 576 * 4 / (1 << 30)  # float32 latent rows of six layers


@pytest.fixture(scope="module")
def model():
    return model_dir(SIX_LAYERS)


@pytest.fixture(autouse=True)
def ownership_checked(monkeypatch):
    monkeypatch.setenv("VLLM_HISPARSE_CHECK_OWNERSHIP", "1")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_completion(engine, outputs: dict[str, list[int]], max_steps: int = 3000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    raise AssertionError(f"unfinished after {max_steps} steps")


def second_turn_beside_a_victim(model, **overrides) -> tuple[dict[str, list[int]], int, dict | None]:
    """R's first turn alone; then V, which is decoding when R's second turn arrives.

    Returns every request's tokens, the tokens R2 took from the device prefix cache, and
    HiSparse's counters (None without HiSparse)."""
    first_turn = tokens(1, 320)
    outputs: dict[str, list[int]] = {}
    with running_llm(model, dtype="float32", **overrides) as llm:
        engine = llm.llm_engine
        engine.add_request("R1", {"prompt_token_ids": first_turn}, greedy(4))
        run_to_completion(engine, outputs)
        engine.add_request("V", {"prompt_token_ids": tokens(2, 640)}, greedy(120))
        for _ in range(8):
            engine.step()
        engine.add_request("R2", {"prompt_token_ids": [*first_turn, *tokens(3, 64)]}, greedy(24))
        cached = {}
        for _ in range(3000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                cached.setdefault(out.request_id, out.num_cached_tokens)
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        scheduler = engine.engine_core.engine_core.scheduler
        stats = scheduler.hisparse.stats() if scheduler.hisparse is not None else None
    return outputs, cached.get("R2", 0), stats


@pytest.mark.parametrize("num_blocks", [113, 114, 115, 116])
def test_a_second_turns_device_prefix_hit_is_its_own_while_relief_demotes_a_victim(model, num_blocks):
    pressure = dict(
        num_gpu_blocks_override=num_blocks,
        max_num_batched_tokens=128,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
    )
    pressed, resident = alike(
        multiprocessing_off(lambda: second_turn_beside_a_victim(model, **pressure)),
        multiprocessing_off(lambda: second_turn_beside_a_victim(model, max_num_batched_tokens=1024)),
        same_steps=True,
    )
    outputs, cached, stats = pressed
    ref_outputs, ref_cached, _ = resident
    assert cached == ref_cached == 320, "R2 took its first turn's five pages from the device"
    assert stats["pages_demoted"] > 0 and stats["hot_leases"] > 0, "relief demoted the victim"
    assert outputs["V"] == ref_outputs["V"]
    assert outputs["R2"] == ref_outputs["R2"], "R2 answered from another request's KV"
