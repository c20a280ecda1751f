"""Random resolver inputs with known true KV rows, and a list-based model of the contract."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from vllm.v1.hisparse.resolver import HotBufferTooSmall, HotState

BLOCK = 4
WIDTH = 3


@dataclass
class Scenario:
    positions: torch.Tensor
    req_ids: torch.Tensor
    page_table: torch.Tensor
    host_page_table: torch.Tensor
    kv_rows: torch.Tensor
    host_rows: torch.Tensor
    hot: HotState
    truth: dict[tuple[int, int], torch.Tensor]
    stride: int
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
) -> Scenario:
    rng = random.Random(seed)
    stride = BLOCK + rng.choice([0, 2])
    truth = {
        (r, p): torch.tensor([float(r), float(p), rng.random()])
        for r in range(num_reqs)
        for p in range(pages * BLOCK)
    }
    num_device_blocks = num_reqs * pages + num_reqs * hot_slots
    kv_rows = torch.full((num_device_blocks * stride, WIDTH), -9.0)
    host_rows = torch.full((num_reqs * pages * BLOCK, WIDTH), -7.0)
    page_table = torch.full((num_reqs, pages), -1, dtype=torch.int64)
    host_page_table = torch.full((num_reqs, pages), -1, dtype=torch.int64)
    block_ids = list(range(num_device_blocks))
    rng.shuffle(block_ids)
    host_ids = list(range(num_reqs * pages))
    rng.shuffle(host_ids)
    for r in range(num_reqs):
        for page in range(pages):
            resident = rng.random() < resident_p
            if resident:
                block = block_ids.pop()
                page_table[r, page] = block
                for o in range(BLOCK):
                    kv_rows[block * stride + o] = truth[(r, page * BLOCK + o)]
            if not resident or rng.random() < 0.5:
                host = host_ids.pop()
                host_page_table[r, page] = host
                for o in range(BLOCK):
                    host_rows[host * BLOCK + o] = truth[(r, page * BLOCK + o)]
    step = 10
    rows = torch.zeros(num_reqs, hot_slots, dtype=torch.int64)
    held = torch.full((num_reqs, hot_slots), -1, dtype=torch.int64)
    stamps = torch.full((num_reqs, hot_slots), -1, dtype=torch.int64)
    for r in range(num_reqs):
        slot_rows = [block_ids.pop() * stride for _ in range(hot_slots)]
        rows[r] = torch.tensor(slot_rows)
        off_device = [p for p in range(pages * BLOCK) if page_table[r, p // BLOCK] < 0]
        for slot, p in enumerate(rng.sample(off_device, min(hot_fill, len(off_device), hot_slots))):
            held[r, slot] = p
            stamps[r, slot] = rng.randrange(0, step)
            kv_rows[slot_rows[slot]] = truth[(r, p)]
    req_ids = torch.tensor([rng.randrange(num_reqs) for _ in range(tokens)])
    positions = torch.tensor(
        [[rng.choice([-1, *range(pages * BLOCK)]) for _ in range(topk)] for _ in range(tokens)]
    )
    return Scenario(
        positions,
        req_ids,
        page_table,
        host_page_table,
        kv_rows,
        host_rows,
        HotState(rows, held, stamps),
        truth,
        stride,
        step,
    )


def brute_force(s: Scenario) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """The contract, written out with plain lists."""
    held = s.hot.positions.tolist()
    stamps = s.hot.stamps.tolist()
    rows = s.hot.rows.tolist()
    out = []
    for t, entries in enumerate(s.positions.tolist()):
        r = int(s.req_ids[t])
        line = []
        for p in entries:
            if p < 0:
                line.append(-1)
                continue
            block = int(s.page_table[r, p // BLOCK])
            if block >= 0:
                line.append(block * s.stride + p % BLOCK)
                continue
            if p in held[r]:
                slot = held[r].index(p)
            else:
                candidates = [i for i in range(len(held[r])) if stamps[r][i] != s.step]
                if not candidates:
                    raise HotBufferTooSmall
                slot = min(candidates, key=lambda i: (stamps[r][i], i))
                held[r][slot] = p
            stamps[r][slot] = s.step
            line.append(rows[r][slot])
        out.append(line)
    return out, held, stamps
