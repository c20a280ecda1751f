# SPDX-License-Identifier: Apache-2.0
"""What every KV cache block and host page holds, played beside the scheduler harness.

The ownership check says who holds a block; this says what is in it. A worker that
keeps, for every device block and host page, a stand-in of the KV it holds: a forward
writes, at every position p it computes for request R, a value that names R's tokens
up to p (draft tokens included) into R's block holding p in every KV cache group (a
page's block, or in the page layout's resident group the block of several pages). The
step's plan moves those values as the workers would: HOST page runs and leases update
the worker's map of each request's host pages (a finished or preempted request's map
goes first), restores copy host pages into blocks before the forward, vLLM's
copy-on-write of resident blocks copies blocks, and page copies copy blocks to host
pages after it. Before the forward's writes are read, every position a
request attends over (those computed before the step) is read through its block table,
a HOST page through the worker's map, and must name that request's own tokens: KV of
another request, another prefix, a rejected draft, or a page never written, is found.

A forward's writes come before its reads here (each layer writes its KV before its
attention reads it): upstream caches a request's blocks as it allocates them, and a
later admission of the same schedule may hit a page the forward is about to write.

Drafts are random tokens and a rejected draft's correction always differs from it, so a
rejected draft's KV is told from the accepted token's. Connectors' loads and landings are
not played (use it without a KV connector), nor asynchronous scheduling with drafts (the
worker's placeholder corrections).
"""

from __future__ import annotations

import random
from typing import Any

from scheduler_harness import SchedulerHarness

from vllm.v1.hisparse.plan import NOT_ON_HOST

DRAFT_TOKENS = (700, 800)  # drafts are drawn from here
CORRECTION_TOKENS = (100, 200)  # the token sampled after the last accepted draft


class WrongKV(AssertionError):
    """A request read KV that is not its own."""


class KVContentHarness(SchedulerHarness):
    """The scheduler harness with a worker that keeps what each block and host page holds
    and checks every position each scheduled request attends over."""

    def __init__(self, *args: Any, content_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self.scheduler.connector is None, "connectors' loads are not played"
        assert not (self.num_speculative_tokens and self.batch_queue_size > 1), (
            "asynchronous scheduling with drafts is not played"
        )
        self._rng = random.Random(content_seed)
        self.block_content: dict[int, dict[int, int]] = {}
        # Host page -> the values of each sparse-MLA group's block, in the plan's group order.
        self.host_content: dict[int, list[dict[int, int]]] = {}
        # Request -> page index -> host page, as the worker holds it from the plans.
        self.worker_host_pages: dict[str, dict[int, int]] = {}
        # Tokens sampled by steps whose output is not processed yet (asynchronous scheduling).
        self._unprocessed: dict[str, list[list[int]]] = {}
        self.positions_read = 0
        self.host_positions_read = 0
        # With True, the copies of a plan are not played: the check must then find a
        # request reading a host page nothing wrote (its negative control).
        self.drop_copies = False
        update = self.scheduler.update_from_output

        def update_from_output(scheduler_output: Any, output: Any) -> Any:
            for req_id, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True):
                pending = self._unprocessed.get(req_id)
                if tokens and pending:
                    pending.pop(0)
            return update(scheduler_output, output)

        self.scheduler.update_from_output = update_from_output  # type: ignore[method-assign]

    # -- the tokens the model produces -----------------------------------------------

    def _propose_drafts(self, scheduler_output: Any) -> None:
        from vllm.v1.outputs import DraftTokenIds

        req_ids = [r for r in scheduler_output.num_scheduled_tokens if r in self.scheduler.requests]
        if req_ids:
            drafts = [
                [self._rng.randrange(*DRAFT_TOKENS) for _ in range(self.num_speculative_tokens)]
                for _ in req_ids
            ]
            self.scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def model_runner_output(self, scheduler_output: Any) -> Any:
        out = super().model_runner_output(scheduler_output)
        spec = scheduler_output.scheduled_spec_decode_tokens
        sampled = []
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if tokens:
                accepted = len(tokens) - 1
                tokens = [*list(spec.get(req_id, ()))[:accepted], self._rng.randrange(*CORRECTION_TOKENS)]
                if self.batch_queue_size > 1:
                    self._unprocessed.setdefault(req_id, []).append(tokens)
            sampled.append(tokens)
        out.sampled_token_ids = sampled
        return out

    # -- the worker's KV ----------------------------------------------------------------

    def schedule(self) -> Any:
        output = super().schedule()
        self._run_step(output)
        return output

    def _tokens(self, request: Any, spec: dict[str, list[int]]) -> list[int]:
        """The request's tokens as the worker sees them: processed, then those of steps
        still in flight, then this step's drafts."""
        tokens = list(request.all_token_ids)
        for pending in self._unprocessed.get(request.request_id, ()):
            tokens += pending
        return tokens + list(spec.get(request.request_id, ()))

    @staticmethod
    def _kv(tokens: list[int], position: int) -> int:
        return hash(tuple(tokens[: position + 1]))

    def _group_block_sizes(self) -> list[tuple[int, int]]:
        """(group, tokens per block) of every KV cache group: a page each for the sparse-MLA
        groups and the groups layout's others, several pages for the page layout's resident
        group (a position's row is its offset in the block)."""
        groups = self.kv_cache_config.kv_cache_groups
        return [(g, group.kv_cache_spec.block_size) for g, group in enumerate(groups)]

    def _run_step(self, output: Any) -> None:
        hisparse = self.hisparse
        mla = list(hisparse.mla_group_ids)
        null = hisparse.null_block_id
        plan = output.hisparse_plan
        for req_id in list(output.finished_req_ids) + list(output.preempted_req_ids or ()):
            self.worker_host_pages.pop(req_id, None)
        if plan is not None:
            for run in plan.host_pages:
                pages = self.worker_host_pages.setdefault(run.request_id, {})
                for index, host_page in run.pages():
                    if host_page == NOT_ON_HOST:
                        pages.pop(index, None)
                    else:
                        pages[index] = host_page
            for restore in plan.restores:
                source = self.host_content.get(restore.host_page)
                for column, block in enumerate(restore.block_ids):
                    self.block_content[block] = dict(source[column]) if source else {}
        for copy in output.kv_cache_block_copies or ():
            self.block_content[copy.dst_block_id] = dict(self.block_content.get(copy.src_block_id, {}))
        groups = self._group_block_sizes()
        spec = output.scheduled_spec_decode_tokens
        scheduled = {
            req_id: (self.scheduler.requests[req_id], n) for req_id, n in output.num_scheduled_tokens.items()
        }
        for req_id, (request, n) in scheduled.items():
            first = request.num_computed_tokens - n
            tokens = self._tokens(request, spec)
            assert len(tokens) >= first + n, f"{req_id} writes past its {len(tokens)} tokens"
            tables = self.block_ids(req_id)
            for position in range(first, first + n):
                value = self._kv(tokens, position)
                for g, block_size in groups:
                    index, row = divmod(position, block_size)
                    block = tables[g][index]
                    if block == null:
                        raise WrongKV(
                            f"step {len(self.observations)}: {req_id} writes position {position} "
                            f"into the null block (group {g})"
                        )
                    self.block_content.setdefault(block, {})[row] = value
        for req_id, (request, n) in scheduled.items():
            self._check_reads(
                req_id, request.num_computed_tokens - n, self._tokens(request, spec), groups, mla, null
            )
        if plan is not None and not self.drop_copies:
            for copy in plan.copies:
                self.host_content[copy.host_page] = [
                    dict(self.block_content.get(b, {})) for b in copy.block_ids
                ]

    def _check_reads(
        self,
        req_id: str,
        num_computed: int,
        tokens: list[int],
        groups: list[tuple[int, int]],
        mla: list[int],
        null: int,
    ) -> None:
        tables = self.block_ids(req_id)
        host_pages = self.worker_host_pages.get(req_id, {})
        step = len(self.observations)
        for position in range(num_computed):
            want = self._kv(tokens, position)
            for g, block_size in groups:
                index, row = divmod(position, block_size)
                block = tables[g][index]
                if block == null:
                    if g not in mla:
                        raise WrongKV(f"step {step}: {req_id} page {index}: the null block in group {g}")
                    host_page = host_pages.get(index)
                    if host_page is None:
                        raise WrongKV(
                            f"step {step}: {req_id} page {index} is on no device block and no host page"
                        )
                    got = self.host_content.get(host_page, [{}] * len(mla))[mla.index(g)].get(row)
                    where = f"host page {host_page}"
                    self.host_positions_read += 1
                else:
                    got = self.block_content.get(block, {}).get(row)
                    where = f"block {block}"
                self.positions_read += 1
                if got != want:
                    raise WrongKV(
                        f"step {step}: {req_id} position {position} (page {index}, group {g}): {where} "
                        "holds KV that is not its own" + (" (never written)" if got is None else "")
                    )
