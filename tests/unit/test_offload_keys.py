# SPDX-License-Identifier: Apache-2.0
"""The OffloadingConnector makes a request's offload keys from its new block hashes only.

Patch 0019: `RequestOffloadState.update_offload_keys` runs for every scheduled request
each step. It takes the hashes past those it has keys for by list slice; with
`itertools.islice` it stepped over every earlier hash first, so each step cost each
running request its whole history (2,200 hashes at 142K tokens) per offloaded group.
Played with upstream's state on a real Request; its hashes count what is read of them.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    RequestOffloadState,
    SchedulerOffloadConfig,
)
from vllm.v1.hisparse.capacity.engine import make_request
from vllm.v1.kv_offload.base import make_offload_key

HASHES = 2_200  # a 142K-token session's pages


class CountedHashes(list):
    """A request's block hashes that count the entries read of them."""

    read = 0

    def __iter__(self):
        for block_hash in super().__iter__():
            self.read += 1
            yield block_hash

    def __getitem__(self, index):
        found = super().__getitem__(index)
        self.read += len(found) if isinstance(index, slice) else 1
        return found


def group(group_idx: int, hashes_per_chunk: int) -> GroupOffloadConfig:
    return GroupOffloadConfig(
        group_idx=group_idx,
        tokens_per_block=64,
        tokens_per_chunk=64 * hashes_per_chunk,
        hashes_per_chunk=hashes_per_chunk,
        kv_event_group_spec=None,  # type: ignore[arg-type]  # read only when events are emitted
        sliding_window_size_in_chunks=None,
    )


def test_a_step_makes_offload_keys_from_the_new_hashes_without_reading_the_history():
    config = SchedulerOffloadConfig(
        kv_group_configs=(group(0, 1), group(1, 4)),
        blocks_per_chunk=1,
        tokens_per_hash=64,
        num_workers=1,
        offload_prompt_only=False,
        supports_partial_tail=False,
    )
    request = make_request([1] * 64, max_tokens=1, request_id="r", block_hasher=None)
    hashes = CountedHashes(f"{i:08d}".encode() for i in range(HASHES))
    request.block_hashes = hashes
    state = RequestOffloadState(config, request, None, None)  # type: ignore[arg-type]

    state.update_offload_keys()
    first, every_fourth = (s.offload_keys for s in state.group_states)
    assert first == [make_offload_key(h, 0) for h in hashes]
    assert every_fourth == [make_offload_key(h, 1) for h in hashes[3::4]]

    # A decode step adds a page: the keys grow by what it completes, and only the new
    # hashes are read (islice read all 2,200 before them, in each group).
    for step in range(4):
        hashes.append(f"new{step:05d}".encode())
        hashes.read = 0
        state.update_offload_keys()
        assert hashes.read <= 2, f"step {step}: read {hashes.read} hashes for one new page"
    assert first == [make_offload_key(h, 0) for h in list.__iter__(hashes)]
    assert every_fourth == [make_offload_key(h, 1) for h in list.__getitem__(hashes, slice(3, None, 4))]
    assert len(every_fourth) == (HASHES + 4) // 4
