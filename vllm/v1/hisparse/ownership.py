# SPDX-License-Identifier: Apache-2.0
"""The ownership invariant of Hybrid HiSparse's scheduler side, checked across all holders.

Reference counts say how many hold a block; this module checks who. It owns
the statement of the invariant and its check, run by tests after every step
(and by a running engine with VLLM_HISPARSE_CHECK_OWNERSHIP=1):

- every reference to a device block is accounted for by exactly one holder each:
  a request's block table (a prefix shared between tables is read only), a hot
  lease (of a running request or of a pending admission), a staging set (this
  step's or a plan's still in flight), upstream's deferred-free queue, or a copy
  in flight of an ended request;
- a lease or staging block has exactly one reference: it is in no block table,
  no other lease or staging set, no held history, and is no pending admission's
  prefix-hit block;
- a block of a finished session's history held on the device (histories.py) is
  held once, by one history;
- the null block and vLLM's free queue keep their upstream meaning: the free
  queue holds exactly the blocks nobody references;
- a request's block table agrees with its residency: a HOST page is the null
  block in every sparse-MLA group, a resident page its own blocks;
- a copy in flight pins its source (its page in the request's table, or held
  blocks once the request ended) and its destination host page until reported;
- a host page has at most one writer (a copy in flight, or an import landing),
  which holds it alone and unindexed; a page a pending admission will read is
  retained by that admission; every host pool reference has a holder.

A step's plan is checked as it leaves the scheduler (`check_plan`): a restore writes
only into its own request's page.

It reads every holder through its owner's methods and changes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.hisparse.admission import Admissions
    from vllm.v1.hisparse.kv_cache_access import KVCacheBlockAccess
    from vllm.v1.hisparse.plan import HiSparseStepPlan
    from vllm.v1.hisparse.residency import ResidencyManager


class OwnershipError(AssertionError):
    """A device block, host page or copy has other owners than the invariant allows."""


def ownership_violations(
    blocks: KVCacheBlockAccess,
    residency: ResidencyManager,
    admissions: Admissions,
    staging: Iterable[int],
    histories: Counter[int] | None = None,
) -> list[str]:
    """Every violation of the invariant in the module docstring, as readable lines.
    `staging`: the staging blocks held now (this step's and every plan's in flight);
    `histories`: block -> references the held histories hold."""
    problems: list[str] = []

    # Every block table entry, counted per block (the null block's entries dropped after).
    null = blocks.null_block_id
    tables: Counter[int] = Counter()
    for _, block_ids in blocks.table_block_ids():
        tables.update(block_ids)
    tables.pop(null, None)
    records = list(admissions.records())
    exclusive: Counter[int] = Counter(residency.leased_blocks())
    exclusive.update(b for record in records for b in record.lease)
    exclusive.update(staging)
    hits = {b.block_id for record in records for b in record.hit}
    deferred = blocks.deferred_references()
    held = Counter(residency.held_blocks())
    histories = histories if histories is not None else Counter()
    for block_id, holders in histories.items():
        if holders != 1:
            problems.append(f"block {block_id} is held by {holders} histories")

    for block_id, holders in exclusive.items():
        if holders > 1:
            problems.append(f"block {block_id} is in {holders} leases or staging sets")
        if block_id in tables:
            owners = sorted({r for r, ids in blocks.table_block_ids() if block_id in ids})
            problems.append(
                f"block {block_id} is in the block table of {owners} and in a lease or staging set"
            )
        if block_id in hits:
            problems.append(f"block {block_id} is leased or staged and a pending admission's prefix hit")
        if block_id in deferred or block_id in held or block_id in histories:
            problems.append(f"block {block_id} is leased or staged and also held or being freed")
    free_queue = blocks.free_queue_ids()
    if len(free_queue) != len(set(free_queue)):
        problems.append("a block is in the free queue twice")
    # Each block's references against its holders, the pool's tens of thousands of blocks
    # read in two passes, a line made only for a block whose count is wrong.
    references = tables.copy()
    for counts in (exclusive, deferred, held, histories):
        references.update(counts)
    expected = references.get
    pool = blocks.pool_blocks()
    for block in [block for block in pool if block.ref_cnt != expected(block.block_id, 0)]:
        b = block.block_id
        if block.is_null:
            continue
        problems.append(
            f"block {b}: {block.ref_cnt} references, {references[b]} holders (tables {tables[b]}, "
            f"leases/staging {exclusive[b]}, deferred frees {deferred[b]}, "
            f"copies of ended requests {held[b]}, held histories {histories[b]})"
        )
    unreferenced = {block.block_id for block in pool if block.ref_cnt == 0}
    unreferenced.discard(null)
    if set(free_queue) != unreferenced:
        problems.append(
            f"the free queue holds {sorted(set(free_queue) ^ unreferenced)[:8]} wrongly: it must "
            "hold exactly the unreferenced blocks"
        )

    # A request's pages in its block table against its residency, a column at a time.
    for request_id, req in residency.requests.items():
        num_pages = len(req.pages)
        columns = [column[:num_pages] for column in blocks.page_columns(request_id, 0)]
        if any(len(column) < num_pages for column in columns):
            problems.append(f"{request_id}: {num_pages} pages, fewer in its block table")
            continue
        in_table = list(zip(*([b.block_id for b in column] for column in columns), strict=True))
        host = (null,) * len(columns)
        wanted = [host if ids is None else ids for ids in req.pages.block_ids]
        if in_table != wanted:
            for index, (found, want) in enumerate(zip(in_table, wanted, strict=True)):
                if found != tuple(want):
                    problems.append(
                        f"{request_id} page {index} ({req.pages[index].state.value}): table holds "
                        f"{list(found)}, residency {list(want)}"
                    )

    writers: Counter[int] = Counter(copy.host_page for copy in residency.copies_in_flight())
    writers.update(record.host_pages[p] for record in records for p in record.landed)
    host_pool = residency.host_pool
    for host_page, n in writers.items():
        if n > 1:
            problems.append(f"host page {host_page} has {n} writers")
        if host_pool.refs(host_page) != 1 or host_pool.is_indexed(host_page):
            problems.append(
                f"host page {host_page} is being written and has {host_pool.refs(host_page)} references"
                + (", indexed by a block hash" if host_pool.is_indexed(host_page) else "")
            )
    try:
        residency.check(other_host_references=admissions.host_references())
    except AssertionError as error:
        problems.append(f"residency: {error}")
    return problems


def plan_violations(blocks: KVCacheBlockAccess, plan: HiSparseStepPlan) -> list[str]:
    """A step's plan against the block tables as the plan leaves the scheduler, as readable
    lines: each restore (host -> device before the forward) writes into blocks that are,
    in every sparse-MLA group, its own request's page, and no block is written by two. A
    block the restore would fill that is free, leased, staged or another request's page is
    another owner's KV overwritten."""
    problems: list[str] = []
    null = blocks.null_block_id
    written: Counter[int] = Counter()
    for restore in plan.restores:
        written.update(restore.block_ids)
        found = blocks.page_in_table(restore.request_id, restore.page_index)
        if found is None:
            problems.append(f"restore {restore}: its request has no such page in its block table")
        elif found != tuple(restore.block_ids) or null in found:
            problems.append(f"restore {restore}: the request's table holds {list(found)} at that page")
    problems += [f"block {b} is written by {n} restores" for b, n in written.items() if n > 1]
    return problems


def check_plan(blocks: KVCacheBlockAccess, plan: HiSparseStepPlan) -> None:
    """Raise `OwnershipError` naming what in the step's plan writes into blocks not its own."""
    problems = plan_violations(blocks, plan)
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise OwnershipError(f"Hybrid HiSparse plan writes outside its owner:\n  {shown}{more}")


def check_ownership(
    blocks: KVCacheBlockAccess,
    residency: ResidencyManager,
    admissions: Admissions,
    staging: Iterable[int],
    histories: Counter[int] | None = None,
) -> None:
    """Raise `OwnershipError` naming what is wrong, if anything is."""
    problems = ownership_violations(blocks, residency, admissions, staging, histories)
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise OwnershipError(f"Hybrid HiSparse ownership violated:\n  {shown}{more}")
