# SPDX-License-Identifier: Apache-2.0
"""The page layout (`hisparse_config.kv_layout: "page"`) through the real engine on CPU.

One sparse-MLA KV cache group (a page is one block) and a resident group whose blocks
hold m pages, laid out so the indexer's kernels read each block as m 64-token pages.
Three concurrent two-turn sessions of the six-layer tiny GLM-5 (sharp weights, index
top-K 32), long enough for whole resident blocks, in fp32:

- the first turns' greedy tokens equal those of upstream's one-group layout without
  HiSparse: the workers' views of the interleaved resident pages are the bytes the
  indexer wrote (a page read from another page's bytes changes its top-K, and tokens);
- under pressure, with pages copied, demoted, read back by the resolver and second turns
  starting from the host pool, both turns equal the page layout with everything resident,
  and upstream's one group: second turns hit their whole history at page granularity,
  as upstream's do, though a resident block holds 17 pages (a hit ending inside one
  gets a private copy of it, copied by the workers through the split views);
- so do they with the OffloadingConnector beside HiSparse (the announcement's two flags),
  and with an MTP drafter, whose layers join the resident group.

Each reference replays the pressure run's prefill chunks, as the other oracles do.
"""

from __future__ import annotations

import itertools

import pytest
import tiny_models
from engine import model_dir, offloading_connector, prefill_chunks, scheduled_chunks, scheduled_steps
from oracle_runs import REPLAY_BUDGET, SIX_LAYERS, alike, first_turns, multiprocessing_off, two_turns

from vllm.v1.hisparse import kv_grouping

pytestmark = pytest.mark.slow_test

PAGE = 64
# Pages per resident block of this model in fp32: its six indexer layers' pages are 17.5
# times narrower than its six sparse-MLA layers' (`choose_resident_block_multiple`).
M = 17
# Each first turn covers one whole resident block and part of the next.
LENGTHS = (1100, 1240, 1380)
LONG = dict(max_model_len=2048, lengths=LENGTHS)
SIX_LAYERS_MTP = tiny_models.TinyModelSpec(
    arch="glm5", init_std=0.2, index_topk=32, num_hidden_layers=6, num_nextn_predict_layers=1
)
# Too few blocks for the sessions' ~70 pages (a page costs 1 + 1/17 blocks), enough to hold
# each session's first resident block between its turns; the host pool holds every page.
PRESSURE = dict(num_gpu_blocks_override=56, max_num_batched_tokens=128)


def page_layout(**fields) -> dict:
    return {"hisparse_config": {"host_pool_gib": 0.25, "kv_layout": "page", **fields}}


@pytest.fixture(scope="module")
def model():
    return model_dir(SIX_LAYERS)


def layouts(monkeypatch) -> list[list[int]]:
    """Records the block size of every KV cache group the engines of the test build."""
    seen: list[list[int]] = []
    build = kv_grouping.interleave_resident_pages

    def spy(groups, tensors):
        seen.append([g.kv_cache_spec.block_size for g in groups])
        return build(groups, tensors)

    from vllm.v1.core import kv_cache_utils

    monkeypatch.setattr(kv_cache_utils, "interleave_resident_pages", spy)
    return seen


def block_copies(monkeypatch) -> list:
    """Records the resident blocks the workers copy for hits that end inside one."""
    from vllm.v1.worker import gpu_model_runner

    copies: list = []
    copy = gpu_model_runner.copy_kv_cache_blocks_inplace

    def spy(kv_caches, num_blocks, block_copies):
        copies.extend(block_copies)
        return copy(kv_caches, num_blocks, block_copies)

    monkeypatch.setattr(gpu_model_runner, "copy_kv_cache_blocks_inplace", spy)
    return copies


def test_the_page_layout_keeps_the_tokens_with_and_without_pressure(model, monkeypatch):
    seen = layouts(monkeypatch)
    copies = block_copies(monkeypatch)
    recorded: dict = {}
    steps: list = []
    pressed, resident = alike(
        multiprocessing_off(
            lambda: two_turns(model, churn=True, attention_config=page_layout(), **LONG, **PRESSURE)
        ),
        multiprocessing_off(
            lambda: two_turns(model, attention_config=page_layout(), **LONG, **REPLAY_BUDGET)
        ),
        recorded=recorded,
        same_steps=True,
        recorded_steps=steps,
    )
    assert seen and all(blocks == [PAGE, M * PAGE] for blocks in seen), "both runs ran the page layout"
    del seen[:]
    tokens, tokens2, cached2, stats, preemptions, exported = pressed
    ref_tokens, ref_tokens2, ref_cached2, ref_stats, *_ = resident
    # Pressure happened, and every kind of residency was exercised.
    assert stats["pages_demoted"] > 0 and stats["pages_copied_to_host"] > 0
    assert stats["request_steps_mixed"] > 0
    assert stats["host_prefix_pages_reused"] > 0, "second turns took their history from the host pool"
    assert stats["rows_loaded"] > 0 and stats["rows_hit"] > 0
    assert preemptions == 0
    for name in ("pages_demoted", "rows_loaded", "host_prefix_pages_reused"):
        assert exported[f"vllm:hisparse_{name}"] == stats[name]
    assert ref_stats["pages_demoted"] == 0, "the reference kept everything resident"
    # Each second turn hits its whole history (the first turn's prompt and output but its
    # last token) to the page, in both runs alike; some hits end inside a resident block,
    # whose private copy the workers made.
    histories = [len(p) + len(t) - 1 for p, t in zip(first_turns(LENGTHS), tokens, strict=True)]
    assert cached2 == [n // PAGE * PAGE for n in histories], (cached2, histories)
    assert any(c % (M * PAGE) for c in cached2)
    assert copies, "a hit inside a resident block took a private copy of it"
    copied = stats["resident_blocks_copied"]
    assert 0 < copied <= len(copies), "(`copies` holds the reference's too)"
    assert exported["vllm:hisparse_resident_blocks_copied"] == copied
    assert cached2 == ref_cached2
    assert tokens == ref_tokens
    assert tokens2 == ref_tokens2

    # Upstream's one group without HiSparse computes the first turns in the same chunks and
    # steps, and its second turns hit the same pages: both turns' tokens are equal.
    first_steps = list(itertools.takewhile(lambda step: all(len(p) in LENGTHS for p in step), steps))
    replayed: dict = {}
    with (
        pytest.MonkeyPatch.context() as mp,
        prefill_chunks(record=replayed, replay=recorded),
        scheduled_steps(replay=first_steps),
    ):
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        plain_tokens, plain_tokens2, plain_cached2, *_ = two_turns(model, **LONG, **REPLAY_BUDGET)
    chunks = {prompt: n for prompt, n in scheduled_chunks(recorded).items() if len(prompt) in LENGTHS}
    assert len(chunks) == len(LENGTHS)
    assert {prompt: n for prompt, n in scheduled_chunks(replayed).items() if len(prompt) in LENGTHS} == chunks
    assert seen and all(blocks == [PAGE] for blocks in seen), "the plain run has upstream's one group"
    assert plain_tokens == tokens
    assert plain_cached2 == cached2
    assert plain_tokens2 == tokens2


def test_the_page_layout_with_the_offloading_connector_keeps_the_tokens(model):
    """Both announcement flags on the page layout: the OffloadingConnector stores and loads
    the resident group's m-page blocks (the indexer's), HiSparse demotes sparse-MLA pages
    under pressure and restores a connector hit's pages from its host pool after the device
    prefix cache is dropped between turns. Equal to the same layout with room for all,
    computed in the same chunks and steps: the connector's loads are waited for, so they
    do not move requests between forwards (a forward of another batch may round a row
    differently, and swap a near-tie in the indexer's top-K)."""

    def offloading(**overrides):
        with offloading_connector("CPUOffloadingSpec", label="test-hisparse-page-layout") as kv_transfer:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
                return two_turns(
                    model,
                    reset=True,
                    kv_transfer_config=kv_transfer,
                    attention_config=page_layout(),
                    **LONG,
                    **overrides,
                )

    pressed, reference = alike(
        lambda: offloading(**PRESSURE), lambda: offloading(**REPLAY_BUDGET), same_steps=True
    )
    tokens, tokens2, cached2, stats, preemptions, offload = pressed
    assert stats["pages_demoted"] > 0 and stats["rows_loaded"] > 0 and preemptions == 0
    assert stats["pages_restored"] > 0, "a connector hit took its sparse-MLA pages back to the device"
    assert offload["vllm:kv_offload_store_bytes"] > 0 and offload["vllm:kv_offload_load_bytes"] > 0
    assert all(c > 0 and c % (M * PAGE) == 0 for c in cached2), cached2
    assert cached2 == reference[2]
    assert (tokens, tokens2) == reference[:2]


def test_the_page_layout_with_an_mtp_drafter_keeps_the_tokens():
    """An MTP drafter's layers join the resident group (its sparse-MLA layer too, read as
    64-token kernel pages of the m-page blocks): drafts are verified for requests with host
    pages, second turns start from the host pool, and tokens equal the layout with room for
    all, computed in the same chunks and steps."""
    model = model_dir(SIX_LAYERS_MTP)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    # The drafter's latent layer makes resident blocks wider (m = 4): more blocks for the
    # same pressure.
    pressure = dict(PRESSURE, num_gpu_blocks_override=72)
    pressed, resident = alike(
        multiprocessing_off(
            lambda: two_turns(
                model, churn=True, speculative_config=mtp, attention_config=page_layout(), **LONG, **pressure
            )
        ),
        multiprocessing_off(
            lambda: two_turns(
                model, speculative_config=mtp, attention_config=page_layout(), **LONG, **REPLAY_BUDGET
            )
        ),
        same_steps=True,
    )
    tokens, tokens2, cached2, stats, preemptions, _ = pressed
    assert stats["pages_demoted"] > 0 and stats["rows_loaded"] > 0 and preemptions == 0
    assert stats["speculative_steps_with_host_pages"] > 0
    assert stats["host_prefix_pages_reused"] > 0
    # Each second turn hits its history to the page, less the page the drafter recomputes
    # (as upstream's hits do), in both runs alike.
    histories = [len(p) + len(t) - 1 for p, t in zip(first_turns(LENGTHS), tokens, strict=True)]
    assert cached2 == [(n // PAGE - 1) * PAGE for n in histories], (cached2, histories)
    assert cached2 == resident[2]
    assert (tokens, tokens2) == resident[:2]
