# SPDX-License-Identifier: Apache-2.0
"""The plain-torch DSA ops against brute-force models of their contracts."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.attention.backends.mla import cpu_dsa
from vllm.v1.attention.ops import dsa_torch

HEAD_DIM = 128
BLOCK = 64


def new_indexer_cache(num_blocks: int, head_dim: int = HEAD_DIM) -> torch.Tensor:
    return torch.zeros(num_blocks, BLOCK, head_dim + 4, dtype=torch.uint8)


def brute_dequant(cache: torch.Tensor, slot: int) -> torch.Tensor:
    """Decode one token's key straight from the raw bytes of its block."""
    head_dim = cache.shape[2] - 4
    block, offset = divmod(slot, BLOCK)
    raw = cache[block].flatten()
    values = raw[offset * head_dim : (offset + 1) * head_dim].view(torch.float8_e4m3fn).float()
    scale_at = BLOCK * head_dim + offset * 4
    scale = raw[scale_at : scale_at + 4].view(torch.float32)
    return values * scale


def test_fp8_group_scales_are_powers_of_two_and_values_round_trip():
    x = torch.randn(5, 3, 256, generator=torch.Generator().manual_seed(0)) * 7
    values, scales = dsa_torch.quantize_fp8_groups(x, 128, 1e-10, use_ue8m0=True)
    assert values.dtype == torch.float8_e4m3fn and values.shape == x.shape
    assert scales.shape == (5, 3, 2)
    assert torch.equal(torch.log2(scales), torch.round(torch.log2(scales)))
    restored = values.float().unflatten(-1, (2, 128)) * scales.unsqueeze(-1)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of the group maximum.
    group_max = x.unflatten(-1, (2, 128)).abs().amax(-1, keepdim=True)
    assert ((restored - x.unflatten(-1, (2, 128))).abs() <= group_max * 2**-3).all()


def test_indexer_cache_uses_the_cuda_block_layout():
    cache = new_indexer_cache(3)
    k = torch.randn(4, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([0, 65, -1, 190])
    dsa_torch.write_indexer_k_cache(k, cache, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.allclose(brute_dequant(cache, slot), k[i], rtol=0.07, atol=1e-3)
    values, scales = dsa_torch.read_indexer_k_rows(cache, torch.tensor([65, 190]))
    assert torch.equal(
        values * scales[:, None], torch.stack([brute_dequant(cache, 65), brute_dequant(cache, 190)])
    )
    untouched = torch.ones(3 * BLOCK, dtype=torch.bool)
    untouched[[0, 65, 190]] = False
    for slot in torch.nonzero(untouched).flatten().tolist()[::17]:
        assert not brute_dequant(cache, slot).any()


@settings(max_examples=60, deadline=None)
@given(
    num_queries=st.integers(1, 12),
    num_keys=st.integers(1, 40),
    topk=st.integers(1, 48),
    seed=st.integers(0, 2**16),
)
def test_topk_is_causal_padded_and_picks_the_largest_logits(num_queries, num_keys, topk, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_queries, num_keys, generator=gen)
    positions = torch.randint(0, num_keys, (num_queries,), generator=gen)
    out = dsa_torch.select_topk_positions(logits, positions, topk)
    assert out.shape == (num_queries, topk) and out.dtype == torch.int32
    for t in range(num_queries):
        visible = int(positions[t]) + 1
        chosen = [p for p in out[t].tolist() if p >= 0]
        assert out[t, len(chosen) :].eq(-1).all(), "-1 padding only at the end"
        assert len(chosen) == min(topk, visible)
        assert len(set(chosen)) == len(chosen) and max(chosen) < visible
        best = sorted(range(visible), key=lambda p: -float(logits[t, p]))[: len(chosen)]
        assert sorted(float(logits[t, p]) for p in chosen) == sorted(float(logits[t, p]) for p in best)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    num_reqs=st.integers(1, 4),
    width=st.integers(1, 5),
    block_size=st.sampled_from([1, 4, 64]),
    extra_stride=st.integers(0, 3),
)
def test_positions_map_through_the_block_table(data, num_reqs, width, block_size, extra_stride):
    block_ids = data.draw(st.permutations(range(num_reqs * width)))
    table = torch.tensor(block_ids).view(num_reqs, width)
    num_tokens = data.draw(st.integers(1, 6))
    req_ids = torch.tensor(
        data.draw(st.lists(st.integers(0, num_reqs - 1), min_size=num_tokens, max_size=num_tokens))
    )
    limit = width * block_size
    positions = torch.tensor(
        data.draw(
            st.lists(
                st.lists(st.integers(-1, limit - 1), min_size=3, max_size=3),
                min_size=num_tokens,
                max_size=num_tokens,
            )
        )
    )
    stride = block_size + extra_stride
    rows = dsa_torch.positions_to_slots(positions, req_ids, table, block_size, stride)
    for t, k in itertools.product(range(num_tokens), range(3)):
        pos = int(positions[t, k])
        expected = -1 if pos < 0 else int(table[req_ids[t], pos // block_size]) * stride + pos % block_size
        assert int(rows[t, k]) == expected


def brute_sparse_attention(q, rows_table, selected, scale, v_dim):
    """Softmax over exactly the selected rows, one query and head at a time."""
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float64)
    for t in range(q.shape[0]):
        ids = [r for r in selected[t].tolist() if r >= 0]
        for h in range(q.shape[1]):
            scores = [float(q[t, h].double() @ rows_table[r].double()) * scale for r in ids]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for w, r in zip(weights, ids, strict=True):
                out[t, h] += (w / total) * rows_table[r, :v_dim].double()
    return out


def test_sparse_attention_reads_exactly_the_indexer_choice_and_differs_from_dense():
    gen = torch.Generator().manual_seed(7)
    seq_len, topk, heads, latent, rope, index_heads = 96, 8, 3, 32, 16, 4
    width = latent + rope
    table = torch.tensor([[2, 0]])  # request 0 lives in blocks 2 and 0
    k_cache = new_indexer_cache(3)
    kv_cache = torch.randn(3, BLOCK, width, generator=gen)
    positions = torch.arange(seq_len)
    slots = dsa_torch.positions_to_slots(positions[None], torch.tensor([0]), table, BLOCK)[0]
    keys = torch.randn(seq_len, HEAD_DIM, generator=gen)
    dsa_torch.write_indexer_k_cache(keys, k_cache, slots)

    q_index, _ = dsa_torch.quantize_fp8_groups(
        torch.randn(seq_len, index_heads, HEAD_DIM, generator=gen), HEAD_DIM, 1e-10, True
    )
    weights = torch.rand(seq_len, index_heads, generator=gen)
    k_values, k_scales = dsa_torch.read_indexer_k_rows(k_cache, slots)
    logits = dsa_torch.indexer_logits(q_index, weights, k_values, k_scales)
    chosen = dsa_torch.select_topk_positions(logits, positions, topk)

    # Brute force of the indexer from the raw cache bytes.
    for t in (0, 5, 40, 95):
        keys_deq = torch.stack([brute_dequant(k_cache, int(s)) for s in slots[: t + 1]])
        brute = [
            sum(
                max(float(q_index[t, h].float() @ keys_deq[s]), 0.0) * float(weights[t, h])
                for h in range(index_heads)
            )
            for s in range(t + 1)
        ]
        expected = sorted(range(t + 1), key=lambda s: -brute[s])[: min(topk, t + 1)]
        got = [p for p in chosen[t].tolist() if p >= 0]
        assert sorted(got) == sorted(expected)

    q = torch.randn(seq_len, heads, width, generator=gen)
    rows_table, stride = cpu_dsa.latent_rows(kv_cache)
    selected_rows = dsa_torch.positions_to_slots(
        chosen, torch.zeros(seq_len, dtype=torch.long), table, BLOCK, stride
    )
    out = dsa_torch.sparse_mla_attention(q, rows_table, selected_rows, width**-0.5, latent)
    brute = brute_sparse_attention(q, rows_table, selected_rows, width**-0.5, latent)
    assert torch.allclose(out.double(), brute, atol=1e-5)

    dense_rows = dsa_torch.positions_to_slots(
        torch.where(positions[None] <= positions[:, None], positions[None], -1),
        torch.zeros(seq_len, dtype=torch.long),
        table,
        BLOCK,
        stride,
    )
    dense = dsa_torch.sparse_mla_attention(q, rows_table, dense_rows, width**-0.5, latent)
    assert torch.allclose(out[:topk], dense[:topk], atol=1e-6), "with <= top-K visible keys, sparse is dense"
    assert (out[topk:] - dense[topk:]).abs().amax() > 1e-2, "beyond top-K keys the selection must matter"


def test_sparse_attention_drops_padding_only_where_every_query_has_it():
    """Queries early in a prefill select few rows; their -1 padding, front-packed or
    scattered, changes neither the rows a query attends nor its result."""
    gen = torch.Generator().manual_seed(7)
    latent, width, num_rows = 8, 12, 40
    kv_rows = torch.randn(num_rows, width, generator=gen)
    q = torch.randn(6, 2, width, generator=gen)
    rows = torch.full((6, 16), -1, dtype=torch.long)
    for t in range(6):
        rows[t, : 2 * t + 1] = torch.randperm(num_rows, generator=gen)[: 2 * t + 1]
    scattered = rows.gather(1, torch.argsort(torch.rand(6, 16, generator=gen), dim=1))
    expected = brute_sparse_attention(q, kv_rows, rows, width**-0.5, latent)
    for selection in (rows, scattered):
        out = dsa_torch.sparse_mla_attention(q, kv_rows, selection, width**-0.5, latent)
        assert torch.allclose(out.double(), expected, atol=1e-6)
    packed = dsa_torch._packed_rows(scattered)
    assert packed.shape == (6, 11), "as wide as the widest selection"
    for t in range(6):
        assert packed[t][packed[t] >= 0].tolist() == scattered[t][scattered[t] >= 0].tolist(), "order kept"
    no_padding = rows[:, :1]
    assert dsa_torch._packed_rows(no_padding) is no_padding


def test_cpu_indexer_fills_the_shared_buffer_per_request(monkeypatch):
    """Two requests in one step, the second continuing a chunked prefill."""
    gen = torch.Generator().manual_seed(3)
    topk, index_heads = 6, 2
    k_cache = new_indexer_cache(4)
    table = torch.tensor([[1, 0], [3, 2]])
    # request 0: 5 new tokens from position 0; request 1: 4 new tokens after 70 cached ones.
    seq_lens = [5, 74]
    positions = torch.tensor([0, 1, 2, 3, 4, 70, 71, 72, 73])
    req_ids = torch.tensor([0] * 5 + [1] * 4)
    slot_of = dsa_torch.positions_to_slots(positions[:, None], req_ids, table, BLOCK)[:, 0]
    earlier = torch.arange(70)
    earlier_slots = dsa_torch.positions_to_slots(earlier[None], torch.tensor([1]), table, BLOCK)[0]
    dsa_torch.write_indexer_k_cache(torch.randn(70, HEAD_DIM, generator=gen), k_cache, earlier_slots)

    meta = cpu_dsa.CPUDSAMetadata(
        num_actual_tokens=9,
        num_reqs=2,
        query_start_loc=torch.tensor([0, 5, 9]),
        seq_lens=torch.tensor(seq_lens),
        block_table=table,
        slot_mapping=slot_of,
        req_id_per_token=req_ids,
        query_positions=positions,
        block_size=BLOCK,
        topk_tokens=topk,
        num_decodes=2,
        num_decode_tokens=9,
    )
    monkeypatch.setattr(
        cpu_dsa, "get_forward_context", lambda: SimpleNamespace(attn_metadata={"layer.k_cache": meta})
    )
    buffer = torch.full((16, topk), 7, dtype=torch.int32)
    q_index, _ = dsa_torch.quantize_fp8_groups(
        torch.randn(9, index_heads, HEAD_DIM, generator=gen), HEAD_DIM, 1e-10, True
    )
    weights = torch.rand(9, index_heads, generator=gen)
    keys = torch.randn(9, HEAD_DIM, generator=gen)
    cpu_dsa.run_cpu_sparse_attn_indexer("layer.k_cache", k_cache, q_index, keys, weights, topk, buffer, False)

    for req, (start, stop) in enumerate([(0, 5), (5, 9)]):
        key_slots = dsa_torch.positions_to_slots(
            torch.arange(seq_lens[req])[None], torch.tensor([req]), table, BLOCK
        )[0]
        values, scales = dsa_torch.read_indexer_k_rows(k_cache, key_slots)
        logits = dsa_torch.indexer_logits(q_index[start:stop], weights[start:stop], values, scales)
        expected = dsa_torch.select_topk_positions(logits, positions[start:stop], topk)
        assert torch.equal(buffer[start:stop], expected)
    assert (buffer[1, 2:] == -1).all(), "position 1 sees two keys"
    assert (buffer[5:9] >= 0).all() and (buffer[5:9] <= 73).all()
    assert (buffer[9:] == 7).all(), "rows past this step's tokens are left alone"


def test_profile_runs_leave_the_buffer_alone(monkeypatch):
    monkeypatch.setattr(cpu_dsa, "get_forward_context", lambda: SimpleNamespace(attn_metadata=None))
    buffer = torch.full((4, 2), 5, dtype=torch.int32)
    out = cpu_dsa.run_cpu_sparse_attn_indexer(
        "x", new_indexer_cache(1), torch.empty(0), None, torch.empty(0), 2, buffer, False
    )
    assert out is buffer and (buffer == 5).all()


@pytest.mark.parametrize(
    "bad", [torch.zeros(2, BLOCK, 132, dtype=torch.float32), torch.zeros(2, 132, dtype=torch.uint8)]
)
def test_indexer_cache_with_the_wrong_layout_is_refused(bad):
    with pytest.raises(ValueError, match="indexer K cache must be 3-D uint8"):
        dsa_torch.read_indexer_k_rows(bad, torch.tensor([0]))
