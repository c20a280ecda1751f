# SPDX-License-Identifier: Apache-2.0
"""DSA through the real engine on CPU: greedy tokens do not depend on how the KV got there.

The same prompts, greedy, in float32 (so different batch shapes do not perturb
rounding): ample KV vs a pool small enough to force preemption, prefix-cache
miss vs hit, whole prefill vs 64-token chunks. Every run must produce identical
tokens, and each run proves its mechanism happened (the preemption counter,
cached tokens, prompts longer than the chunk).
"""

from __future__ import annotations

import random

import pytest
from engine import metric_total, running_llm

from vllm import SamplingParams

pytestmark = pytest.mark.slow_test

SHARED_PREFIX = 128  # two 64-token pages
PROMPT_LENGTHS = (150, 190, 230, 260)
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def prompts(vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(1234)
    prefix = [rng.randrange(3, vocab_size) for _ in range(SHARED_PREFIX)]
    return [prefix + [rng.randrange(3, vocab_size) for _ in range(n - SHARED_PREFIX)] for n in PROMPT_LENGTHS]


def generate(llm, batch: list[list[int]]):
    return llm.generate([{"prompt_token_ids": ids} for ids in batch], GREEDY, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(sparse_glm5_dir):
    """Ample KV, prefix caching on: a cold pass, then the same prompts again from the cache."""
    with running_llm(sparse_glm5_dir, dtype="float32") as llm:
        cold = generate(llm, prompts())
        warm = generate(llm, prompts())
    return cold, warm


def test_prompts_are_longer_than_the_index_topk(sparse_glm5_dir):
    import json

    topk = json.loads((sparse_glm5_dir / "config.json").read_text())["index_topk"]
    assert min(PROMPT_LENGTHS) > 4 * topk, "every prompt must exercise sparse selection"


def test_generation_is_not_degenerate(reference):
    cold, _ = reference
    for out in tokens(cold):
        assert len(out) == GREEDY.max_tokens
        assert len(set(out)) > 3, f"greedy output repeats one token: {out}"
    assert len({tuple(t) for t in tokens(cold)}) == len(PROMPT_LENGTHS)


def test_prefix_cache_hit_gives_the_same_tokens_as_a_miss(reference):
    cold, warm = reference
    assert all(o.num_cached_tokens in (0, None) for o in cold[:1]), "first prompt is a cold miss"
    assert all(o.num_cached_tokens >= SHARED_PREFIX for o in warm), [o.num_cached_tokens for o in warm]
    assert tokens(warm) == tokens(cold)


def test_preemption_under_a_small_pool_keeps_greedy_tokens(reference, sparse_glm5_dir):
    cold, _ = reference
    # 7 blocks leave 6 usable pages of 64 tokens (one max-length request): two 3-page
    # prompts fill them and both need a fourth page while decoding, so one is preempted.
    with running_llm(
        sparse_glm5_dir,
        dtype="float32",
        num_gpu_blocks_override=7,
        max_model_len=384,
        enable_prefix_caching=False,
    ) as llm:
        before = metric_total(llm, "vllm:num_preemptions")
        squeezed = generate(llm, prompts())
        preemptions = metric_total(llm, "vllm:num_preemptions") - before
    assert preemptions > 0, "the pool was meant to force preemption"
    assert tokens(squeezed) == tokens(cold)


def test_chunked_prefill_gives_the_same_tokens_as_whole_prefill(reference, sparse_glm5_dir):
    cold, _ = reference
    with running_llm(
        sparse_glm5_dir,
        dtype="float32",
        max_num_batched_tokens=64,
        max_num_seqs=4,
        enable_prefix_caching=False,
    ) as llm:
        chunked = generate(llm, prompts())
    assert max(PROMPT_LENGTHS) > 64 * 3, "prompts span several chunks"
    assert tokens(chunked) == tokens(cold)
