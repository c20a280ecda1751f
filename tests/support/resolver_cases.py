# SPDX-License-Identifier: Apache-2.0
"""Random resolver inputs with known true KV rows, and a list-based model of the contract."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from vllm.v1.attention.ops import dsa_torch
from vllm.v1.hisparse.resolver import HotState

BLOCK = 4
WIDTH = 3


class StagingOverflow(Exception):
    """The model's verdict: the step needs more staging slots than it was given."""


@dataclass
class Scenario:
    positions: torch.Tensor  # [T, K]
    token_requests: torch.Tensor  # [T]: request row m, -1 for a fully resident request
    rows: torch.Tensor  # [T, K]: the backend's own conversion (HOST pages -> null block)
    host_page_table: torch.Tensor  # [R, P]
    table_rows: torch.Tensor  # [M]
    kv_rows: torch.Tensor
    host_rows: torch.Tensor
    hot: HotState
    slot_rows: torch.Tensor  # [M, H + S]
    staging_slots: torch.Tensor  # [M]
    truth: dict[tuple[int, int], torch.Tensor]  # (batch request, position) -> its KV row
    batch_request: list[int]  # per token: its request in the batch
    step: int


def build(
    seed: int,
    num_reqs: int,
    pages: int,
    hot_slots: int,
    tokens: int,
    topk: int,
    resident_p: float,
    hot_fill: int,
    staging: int = 0,
) -> Scenario:
    """Requests 0..num_reqs-1 of a batch; those with a HOST page get hot state rows m, in
    a host page table whose rows are a shuffled subset of a larger table."""
    rng = random.Random(seed)
    stride = BLOCK + rng.choice([0, 2])
    truth = {
        (r, p): torch.tensor([float(r), float(p), rng.random()])
        for r in range(num_reqs)
        for p in range(pages * BLOCK)
    }
    num_device_blocks = 1 + num_reqs * pages + num_reqs * (-(-(hot_slots + staging) // BLOCK))
    kv_rows = torch.full((num_device_blocks * stride, WIDTH), -9.0)
    host_rows = torch.full((num_reqs * pages * BLOCK, WIDTH), -7.0)
    block_table = torch.zeros((num_reqs, pages), dtype=torch.int64)  # 0: the null block
    block_ids = list(range(1, num_device_blocks))
    rng.shuffle(block_ids)
    host_ids = list(range(num_reqs * pages))
    rng.shuffle(host_ids)
    host_of: dict[tuple[int, int], int] = {}
    for r in range(num_reqs):
        for page in range(pages):
            if rng.random() < resident_p:
                block = block_ids.pop()
                block_table[r, page] = block
                for o in range(BLOCK):
                    kv_rows[block * stride + o] = truth[(r, page * BLOCK + o)]
            else:
                host = host_ids.pop()
                host_of[(r, page)] = host
                for o in range(BLOCK):
                    host_rows[host * BLOCK + o] = truth[(r, page * BLOCK + o)]
    mixed = sorted({r for r, _ in host_of})
    table_size = len(mixed) + 2
    free_table_rows = list(range(table_size))
    rng.shuffle(free_table_rows)
    table_rows = torch.tensor([free_table_rows[m] for m in range(len(mixed))], dtype=torch.int64)
    host_page_table = torch.full((table_size, pages), -1, dtype=torch.int64)
    for (r, page), host in host_of.items():
        host_page_table[table_rows[mixed.index(r)], page] = host
    step = 10
    held = torch.full((len(mixed), hot_slots), -1, dtype=torch.int64)
    stamps = torch.full((len(mixed), hot_slots), -1, dtype=torch.int64)
    slot_rows = torch.zeros((len(mixed), hot_slots + staging), dtype=torch.int64)
    for m, r in enumerate(mixed):
        blocks = [block_ids.pop() for _ in range(-(-(hot_slots + staging) // BLOCK))]
        rows = [b * stride + o for b in blocks for o in range(BLOCK)]
        slot_rows[m] = torch.tensor(rows[: hot_slots + staging])
        off_device = [p for p in range(pages * BLOCK) if (r, p // BLOCK) in host_of]
        for slot, p in enumerate(rng.sample(off_device, min(hot_fill, len(off_device), hot_slots))):
            held[m, slot] = p
            stamps[m, slot] = rng.randrange(0, step)
            kv_rows[slot_rows[m, slot]] = truth[(r, p)]
    batch_request = [rng.randrange(num_reqs) for _ in range(tokens)]
    token_requests = torch.tensor([mixed.index(r) if r in mixed else -1 for r in batch_request])
    positions = torch.tensor(
        [[rng.choice([-1, *range(pages * BLOCK)]) for _ in range(topk)] for _ in range(tokens)]
    )
    rows = dsa_torch.positions_to_slots(positions, torch.tensor(batch_request), block_table, BLOCK, stride)
    return Scenario(
        positions=positions,
        token_requests=token_requests,
        rows=rows,
        host_page_table=host_page_table,
        table_rows=table_rows,
        kv_rows=kv_rows,
        host_rows=host_rows,
        hot=HotState(held, stamps),
        slot_rows=slot_rows,
        staging_slots=torch.full((len(mixed),), staging, dtype=torch.int64),
        truth=truth,
        batch_request=batch_request,
        step=step,
    )


def brute_force(s: Scenario) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The contract, written out with plain lists: (rows, held positions, stamps) after the step."""
    held = s.hot.positions.tolist()
    stamps = s.hot.stamps.tolist()
    hot_slots = s.hot.positions.shape[1]
    table = s.host_page_table.tolist()
    table_rows = s.table_rows.tolist()
    slot_of: dict[tuple[int, int], int] = {}
    for m in range(len(held)):
        wanted = sorted(
            {
                p
                for t, entries in enumerate(s.positions.tolist())
                if int(s.token_requests[t]) == m
                for p in entries
                if p >= 0 and table[table_rows[m]][p // BLOCK] >= 0
            }
        )
        hits = [p for p in wanted if p in held[m]]
        selected = {held[m].index(p) for p in hits}
        eligible = sorted((i for i in range(hot_slots) if i not in selected), key=lambda i: (stamps[m][i], i))
        for p in hits:
            slot_of[(m, p)] = held[m].index(p)
            stamps[m][held[m].index(p)] = s.step
        for i, p in enumerate(p for p in wanted if p not in hits):
            if i < len(eligible):
                slot = eligible[i]
                held[m][slot] = p
                stamps[m][slot] = s.step
            else:
                if i - len(eligible) >= int(s.staging_slots[m]):
                    raise StagingOverflow
                slot = hot_slots + i - len(eligible)
            slot_of[(m, p)] = slot
    out = []
    for t, entries in enumerate(s.positions.tolist()):
        m = int(s.token_requests[t])
        line = []
        for k, p in enumerate(entries):
            if (m, p) in slot_of:
                line.append(int(s.slot_rows[m, slot_of[(m, p)]]))
            else:
                line.append(int(s.rows[t, k]))
        out.append(line)
    return out, held, stamps


def servable_cases(num_seeds: int):
    """(seed, shape) of `build`'s cases over `num_seeds` seeds of varied shapes that the
    contract can serve: some request has HOST pages, and the step needs no more staging
    than it was given (the model's verdict)."""
    for seed in range(num_seeds):
        shape = dict(
            num_reqs=1 + seed % 3,
            pages=1 + seed % 5,
            hot_slots=4 + seed % 9,
            tokens=1 + seed % 4,
            topk=1 + seed % 6,
            resident_p=(0.0, 0.5, 0.9)[seed % 3],
            hot_fill=seed % 7,
            staging=seed % 5,
        )
        if not len(build(seed, **shape).table_rows):
            continue
        try:
            brute_force(build(seed, **shape))
        except StagingOverflow:
            continue
        yield seed, shape
