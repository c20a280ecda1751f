# SPDX-License-Identifier: Apache-2.0
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

pytestmark = pytest.mark.slow_test

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


def example_connector(role: str, storage) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }


A1, B = tokens(11, 400), tokens(12, 400)


@pytest.fixture(scope="module")
def storage(model, tmp_path_factory):
    """A prefill instance (no HiSparse) stored both sessions' prompts, each computed in one chunk."""
    folder = tmp_path_factory.mktemp("example-connector")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with running_llm(
            model, dtype="float32", max_num_batched_tokens=4096,
            kv_transfer_config=example_connector("kv_producer", folder),
        ) as llm:  # fmt: skip
            llm.generate([{"prompt_token_ids": p} for p in (A1, B)], greedy(1), use_tqdm=False)
    return folder


def decode_instance_turns(model, storage, **overrides) -> tuple[dict[str, list[int]], dict | None]:
    """A decode instance: a local session decodes; A's first turn is imported; then A's second
    turn and B's import arrive together. Every request's tokens, and HiSparse's counters."""
    outputs: dict[str, list[int]] = {}
    with running_llm(
        model, dtype="float32", max_model_len=768, max_num_batched_tokens=1024,
        kv_transfer_config=example_connector("kv_consumer", storage), **overrides,
    ) as llm:  # fmt: skip
        engine = llm.llm_engine
        engine.add_request("local", {"prompt_token_ids": tokens(10, 450)}, greedy(120))
        for _ in range(3):
            engine.step()
        engine.add_request("A1", {"prompt_token_ids": A1}, greedy(2))
        while "A1" not in outputs:
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        second_turn = [*A1, *outputs["A1"], *tokens(13, 62)]
        engine.add_request("A2", {"prompt_token_ids": second_turn}, greedy(16))
        engine.add_request("B", {"prompt_token_ids": B}, greedy(16))
        run_to_completion(engine, outputs)
        scheduler = engine.engine_core.engine_core.scheduler
        stats = scheduler.hisparse.stats() if scheduler.hisparse is not None else None
    return outputs, stats


def test_a_decode_instances_pending_host_hit_keeps_its_pages_while_an_import_needs_room(model, storage):
    """Thirteen host pages: the local session's seven copies and A's six imported pages fill
    the pool. When A's second turn finds its pages there, B's import in the same step can
    only land in the host pool by evicting them; retained by A2's admission, they stay
    A2's, and B lands on the device instead."""
    pressure = dict(
        num_gpu_blocks_override=110,
        attention_config={"hisparse_config": {"host_pool_gib": 13.5 * PAGE_GIB}},
    )
    pressed, resident = alike(
        multiprocessing_off(lambda: decode_instance_turns(model, storage, **pressure)),
        multiprocessing_off(lambda: decode_instance_turns(model, storage)),
        same_steps=True,
    )
    outputs, stats = pressed
    ref_outputs, _ = resident
    assert stats["host_pages_total"] == 13
    assert stats["pages_imported_to_host"] >= 6, "A's first turn landed in the host pool"
    assert stats["host_prefix_pages_reused"] == 6, "A's second turn took its first turn from the host pool"
    assert outputs == ref_outputs


def test_a_step_the_workers_cannot_resolve_for_a_request_fails_that_request_alone(model, monkeypatch):
    """An injected fault: the worker's pass partition puts every token of the first second-turn
    step that needs passes in one pass, so a request's selections overflow its hot and staging
    rows. The workers' plan raises the overflow in that request's own error word: the request
    ends with an error and returns everything it held; the other requests finish, and the
    engine serves on."""
    from vllm.v1.hisparse import resolution

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    partition_passes = resolution.partition_passes
    faulted: list[bool] = []
    armed: list[bool] = []

    def one_pass_once(*args, **kwargs):
        token_pass, num_passes = partition_passes(*args, **kwargs)
        if armed and not faulted and num_passes > 1:
            faulted.append(True)
            return token_pass.zero_(), 1
        return token_pass, num_passes

    monkeypatch.setattr(resolution, "partition_passes", one_pass_once)
    rng = random.Random(5)
    first = [[rng.randrange(3, 512) for _ in range(n)] for n in (300, 360, 420)]
    with running_llm(
        model, dtype="float32", num_gpu_blocks_override=110, max_num_batched_tokens=128,
        attention_config={"hisparse_config": {"host_pool_gib": 0.05}},
    ) as llm:  # fmt: skip
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        outs = llm.generate([{"prompt_token_ids": p} for p in first], greedy(40), use_tqdm=False)
        scheduler.kv_cache_manager.reset_prefix_cache()  # second turns start from the host pool
        armed.append(True)
        second = [p + list(o.outputs[0].token_ids) + tokens(21, 24) for p, o in zip(first, outs, strict=True)]
        outs2 = llm.generate([{"prompt_token_ids": p} for p in second], greedy(40), use_tqdm=False)
        reasons = [o.outputs[0].finish_reason for o in outs2]
        stats = scheduler.hisparse.stats()
        assert faulted, "a second-turn step needed passes"
        assert 1 <= reasons.count("error") < len(reasons), reasons
        assert all(r in ("error", "length") for r in reasons)
        assert stats["requests_failed"] == reasons.count("error") and stats["request_steps_none"] > 0
        again = llm.generate([{"prompt_token_ids": second[0]}], greedy(8), use_tqdm=False)
        assert len(again[0].outputs[0].token_ids) == 8, "the engine serves on"
        assert scheduler.hisparse.residency.host_pool.num_referenced == 0
        assert not scheduler.hisparse.residency.requests and not list(scheduler.hisparse.admissions.records())
