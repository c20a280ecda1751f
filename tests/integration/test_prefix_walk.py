# SPDX-License-Identifier: Apache-2.0
"""The prefix walk's page lookup (`KVCacheBlockAccess.page_lookup`) answers exactly what
upstream's `BlockPool.get_cached_block` answers, for every page of every request, in the
sparse-MLA groups and in the others, with pages demoted from the device by pressure."""

from __future__ import annotations

import pytest
import tiny_models
from scheduler_harness import HISPARSE, SchedulerHarness, tiny_glm5_dir


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_glm5_dir(tiny_models.TinyModelSpec(arch="glm5", index_topk=32, num_hidden_layers=6)))


def test_the_page_lookup_answers_as_upstreams_cached_block_lookup(model):
    h = SchedulerHarness.create(model=model, memory_bytes=20 << 20, attention_config=HISPARSE)
    for i in range(8):
        h.add_request([(i * 7919 + t * 104729) % 3000 + 10 for t in range(512)], max_tokens=16)
    h.run_until_done()
    blocks = h.hisparse.blocks
    pool = h.block_pool
    hashes = [block_hash for request in h.requests.values() for block_hash in request.block_hashes]
    hashes.append(type(hashes[0])(bytes(len(hashes[0]))))  # a page nobody computed
    found = {"mla": 0, "other": 0}
    for name, group_ids in (("mla", blocks.mla_group_ids), ("other", blocks.other_group_ids)):
        lookup = blocks.page_lookup(group_ids)
        for block_hash in hashes:
            expected = pool.get_cached_block(block_hash, list(group_ids))
            assert lookup(block_hash) == expected
            found[name] += expected is not None
    # Both answers occur: pages cached in every group, and pages some group lost (pressure
    # demoted sparse-MLA pages; the indexer's stay cached here, and the page nobody
    # computed is in no group).
    assert 0 < found["mla"] < len(hashes) - 1 and 0 < found["other"] < len(hashes), found
