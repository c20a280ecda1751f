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
copy-on-write of resident blocks copies blocks, and page copies read blocks after it.
A copy is in flight until its report (on CUDA it runs beside the next steps): its host
page holds nothing before, then what it read, and the blocks it read must not have
changed meanwhile. Every position a request attends over (those computed before the
step) is read as the resolver reads it: a sparse-MLA page from the host page the
worker's map holds for it, if any, else through its block table; it must name that
request's own tokens: KV of another request, another prefix, a rejected draft, or a
page never written, is found.

The resolver's own rows are played too, after the forward's writes and before any read:
each step a request with HOST pages selects some of their positions, and those its hot
buffer holds (as the workers keep it from the plans' leases, empty at each new lease and
gone with the request) are read from their slot of the lease's blocks, which must still
hold them; the others are copied from their host page into its least recently used slots
and, past those, into the step's staging blocks. A block the resolver writes that another
request reads (a waiting request's prefix hit taken for a lease or staging, a lease left
in the prefix cache) is then found by that request's reads, and the rows each resolver
used are read again once every request's copies of the step are done. Selections stay
within the hot and staging rows: the passes of a layer whose selections outgrow them are
not played.

Forwards write and read through the block tables the workers hold (upstream's tables,
built from each step's new and appended blocks, with the plans' block-table updates
applied), and the tables of the requests a step schedules must equal the scheduler's.

A forward's writes come before its reads here (each layer writes its KV before its
attention reads it): upstream caches a request's blocks as it allocates them, and a
later admission of the same schedule may hit a page the forward is about to write.

Drafts are random tokens and a rejected draft's correction always differs from it, so a
rejected draft's KV is told from the accepted token's. A KV cache group that holds an MTP
drafter's layer holds, beside the target's value, the drafter's: its input at a position
is the next token, so its KV there names the tokens up to the next one, written once the
step's tokens are sampled (past the last accepted draft, KV of nothing); a request that
reads another's drafter KV written in the same step reads it after that, as the drafter's
own forward does. A prefix hit names its pages' tokens, not the token after its last page:
a request must compute that page's drafter KV again (vLLM's and HiSparse's hits drop their
last page with a drafter). Upstream's prefix cache names a page by its own tokens only, so
a block a hit shares may hold, at its last position, the drafter KV of another sequence
whose next token differed; that is allowed where the page after was matched as well
(inside a hit, the page a drafter's hit drops, past a connector's hit), and nowhere else.

With the OffloadingConnector its workers' transfers move values too, in the worker's
order: a step's stores are deferred to the start of the next step (those its fence
flushes run at once), and read their GPU blocks then, before that step's forward (or
when reported done, if the harness reports one earlier); a store's CPU blocks hold what
it read once it is reported done. A load reads its CPU blocks when submitted, before the
step's forward; its GPU blocks hold nothing until the load is reported done, then what it
read. A GPU block of a job's group maps to its CPU block as the CPU worker maps it
(`blocks_per_chunk` GPU blocks to a CPU block, the first group's skipped by its block
index).

The ExampleConnector's loads write a stored prompt's KV (a producer computed the same
tokens) into their rows just before the forward (after the plan's restores), in device
blocks or the host pages HiSparse lands them in. NIXL's reads (played by the harness,
`nixl_read_fails`) leave their blocks and landing host pages empty until reported done,
then the prefill peer's KV of the prompt, or, failed, garbage the request must recompute
over before anyone reads it; the blocks a finished request offers a decode peer must
hold its KV until the peer is done. Inside a MultiConnector each of these is played;
other connectors are not.

Every page the host pool publishes by a block hash must hold the KV of the tokens that
hash names, in every sparse-MLA group, when it is published. A finding inside the
scheduler's own calls is raised once they return, so that HiSparse's handling of a
request that cannot be served does not take it for one.

Asynchronously with drafts the scheduler schedules placeholders and counts them computed
until it processes the step's output; the worker proposes the drafts and writes a step's
KV at the true positions (the scheduler's count less the drafts rejected by steps still
in flight), as vLLM's model runner corrects them.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any

from scheduler_harness import SchedulerHarness

from vllm.v1.hisparse.plan import NOT_ON_HOST

DRAFT_TOKENS = (700, 800)  # drafts are drawn from here
CORRECTION_TOKENS = (100, 200)  # the token sampled after the last accepted draft


def _layer_index(layer_name: str) -> int | None:
    match = re.search(r"layers\.(\d+)\.", layer_name)
    return int(match.group(1)) if match else None


@dataclasses.dataclass
class _Unprocessed:
    tokens: list[int]
    rejected: int
    stale: bool = False


class WrongKV(AssertionError):
    """A request read KV that is not its own."""


class KVContentHarness(SchedulerHarness):
    """The scheduler harness with a worker that keeps what each block and host page holds
    and checks every position each scheduled request attends over."""

    def __init__(self, *args: Any, content_seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from vllm.distributed.kv_transfer.kv_connector.v1.grouped_example_connector import (
            GroupedExampleConnector,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

        # The connector, or those inside a MultiConnector.
        connector = self.scheduler.connector
        leaves = list(getattr(connector, "_connectors", None) or ([connector] if connector else []))
        self._nixl = any(isinstance(c, NixlConnector) for c in leaves)
        self._example = any(isinstance(c, GroupedExampleConnector) for c in leaves)
        offloading = [c for c in leaves if isinstance(c, OffloadingConnector)]
        for leaf in leaves:
            assert isinstance(leaf, (GroupedExampleConnector, OffloadingConnector)) or (
                isinstance(leaf, NixlConnector) and self.nixl_read_fails is not None
            ), "only the OffloadingConnector's, the ExampleConnector's and NIXL's (played) loads are played"
        self._offloading = offloading[0].connector_scheduler if offloading else None
        self._rng = random.Random(content_seed)
        # The resolver's selections draw from their own stream: playing them changes no draft.
        self._selection_rng = random.Random(f"selections-{content_seed}")
        # KV cache groups holding a drafter's layers (an MTP layer past the target's): the
        # drafter's KV at a position is of the tokens up to the next one (its input is the
        # target's hidden state there and the next token), kept as (target's, drafter's).
        num_layers = self.vllm_config.model_config.hf_config.num_hidden_layers
        self._drafter_groups = frozenset(
            g
            for g, group in enumerate(self.kv_cache_config.kv_cache_groups)
            if self.num_speculative_tokens
            and any((_layer_index(name) or 0) >= num_layers for name in group.layer_names)
        )
        # Each step's drafter writes, done once its tokens are sampled: (request, first
        # position, tokens computed, the step's drafts' count, the workers' tables it used).
        self._drafter_steps: dict[int, list[tuple[str, int, int, list[int], int, list[list[int]]]]] = {}
        self.block_content: dict[int, dict[int, int]] = {}
        # Host page -> the values of each sparse-MLA group's block, in the plan's group order.
        self.host_content: dict[int, list[dict[int, int]]] = {}
        # Request -> page index -> host page, as the worker holds it from the plans.
        self.worker_host_pages: dict[str, dict[int, int]] = {}
        # Steps whose output is not processed yet (asynchronous scheduling), per request:
        # the tokens each sampled, the drafts it rejected, and whether a preemption since
        # made its output stale (its rejections then no longer roll the scheduler back).
        self._unprocessed: dict[str, list[_Unprocessed]] = {}
        # Asynchronously the scheduler schedules placeholders for drafts; the worker's own
        # drafts for each scheduled step (by the output's id), as its drafter proposed them.
        self._worker_drafts: dict[int, dict[str, list[int]]] = {}
        self.positions_read = 0
        self.host_positions_read = 0
        # The resolver's hot buffers, as the workers hold them from the plans: request ->
        # its lease's blocks (one tuple per sparse-MLA group, in the plan's group order),
        # and slot -> (position, the step that last used it).
        self._leases: dict[str, tuple[tuple[int, ...], ...]] = {}
        self._hot: dict[str, dict[int, tuple[int, int]]] = {}
        # Request -> the tokens its prefix hit covered when it was last admitted (new or
        # resumed), and whether the page after it was matched: a drafter's KV at the last
        # position of a block the hit shares may name another sequence's next token where
        # the position after is matched too (`_holds`).
        self._hits: dict[str, tuple[int, bool]] = {}
        # Reads of a drafter's KV that another request's forward of the same step writes
        # once its tokens are sampled, checked after that (by the step's output id).
        self._drafter_reads: dict[int, list[tuple[str, int, int, int, list[int], int]]] = {}
        self._step_id = 0
        # Request -> (its local prefix hit in tokens, whether the page after it was matched
        # when it was looked up: the page a hit drops with a drafter, whose first token the
        # hit's last page's drafter KV may name for another sequence).
        self._local_hits: dict[str, tuple[int, bool]] = {}
        local_hit = self.scheduler._get_local_prefix_cache_hit
        device_hit = self.kv_cache_manager.get_computed_blocks
        upstream: list[int] = [0]

        def get_computed_blocks(request: Any) -> Any:
            hit = device_hit(request)
            upstream[0] = hit[1]
            return hit

        self.kv_cache_manager.get_computed_blocks = get_computed_blocks  # type: ignore[method-assign]

        def get_local_prefix_cache_hit(request: Any) -> Any:
            # The page after the hit was matched when a drafter's hit dropped it: upstream's
            # device hit (any hit HiSparse's walk does not extend) and the walk's extension
            # both drop their last page; a walk that stops at a host page for want of a hot
            # lease stops before a page it matched.
            counters = self.hisparse.admissions.counters
            upstream[0] = -1
            dropped = counters.pages_dropped_for_drafter
            hit = local_hit(request)
            num_local = hit[1]
            record = self.hisparse.admissions._records.get(request.request_id)
            page = self.hisparse.block_size
            stopped = record.walk_copies[0] if record is not None and record.no_lease else 0
            matched = (
                counters.pages_dropped_for_drafter > dropped
                # Upstream's device hit, dropped one page (or cut shorter when alone).
                or 0 < num_local <= upstream[0]
                or stopped * page >= num_local > 0
            )
            self._local_hits[request.request_id] = (num_local, matched)
            return hit

        self.scheduler._get_local_prefix_cache_hit = get_local_prefix_cache_hit  # type: ignore[method-assign]
        # Request -> its block tables as the workers hold them: upstream's (a new request's
        # blocks, the blocks appended each step, a resumed request's whole table) with the
        # plans' block-table updates applied. Forwards write and read through these.
        self.worker_tables: dict[str, list[list[int]]] = {}
        # With True, the plans' block-table updates are not applied (their negative control).
        self.drop_table_updates = False
        # With False, the resolver's rows are not played (to show what playing them finds).
        self.resolve_hot_rows = True
        # With True, the resolver's copies of missed rows write nothing: a later hit must
        # then find its slot holding KV that is not its own (their negative control).
        self.drop_row_copies = False
        self.hot_rows_hit = 0
        self.hot_rows_filled = 0
        self.rows_staged = 0
        # With True, the copies of a plan are not played: the check must then find a
        # request reading a host page nothing wrote (its negative control).
        self.drop_copies = False
        # With True, the OffloadingConnector's loads and NIXL's reads write nothing (their
        # negative control).
        self.drop_loads = False
        # With True, a plan's copy of a page reads its first group's block of the page
        # before it (where it has one): the check of what the host pool publishes must
        # then find a page holding other positions' KV (its negative control).
        self.copy_previous_page = False
        # HiSparse's page copies launched and not yet reported: (the copy, the blocks it
        # reads, what it read).
        self._copies_in_flight: dict[int, tuple[Any, list[int], list[dict[int, int]]]] = {}
        # The OffloadingConnector's CPU blocks: (the job's group, CPU block, sub-block) ->
        # the values of the GPU block stored there.
        self.cpu_content: dict[tuple[int, int, int], dict[int, int]] = {}
        # Store jobs not yet submitted (deferred to the next step); jobs submitted and not
        # yet reported done, with what they read (GPU block or CPU block -> values).
        self._deferred_stores: dict[int, Any] = {}
        self._early_stores: dict[int, Any] = {}
        self._stores: dict[int, tuple[Any, list[dict[int, int]]]] = {}
        self._loads: dict[int, tuple[Any, list[dict[int, int]]]] = {}
        self.offloaded_positions_loaded = 0
        # NIXL: reads in flight (request -> the device blocks of its import, with their
        # group and page, the host pages its landed pages take, and its prompt), and the
        # blocks a finished request offers a decode peer until it has read them.
        self._nixl_reads: dict[str, tuple[list[tuple[int, int, int]], dict[int, int], list[int]]] = {}
        self._nixl_sends: dict[str, tuple[list[tuple[int, int, int]], list[int], int]] = {}
        self.positions_imported = 0
        self.positions_sent = 0
        self.pages_published = 0
        # What a check inside the scheduler's own calls found, raised once the call returns.
        self._found: list[WrongKV] = []
        if self.hisparse is not None:
            self._check_publications(self.hisparse.residency.host_pool)
        update = self.scheduler.update_from_output

        def update_from_output(scheduler_output: Any, output: Any) -> Any:
            for req_id, tokens in zip(output.req_ids, output.sampled_token_ids, strict=True):
                pending = self._unprocessed.get(req_id)
                if tokens and pending:
                    pending.pop(0)
            outputs = update(scheduler_output, output)
            if self._nixl:
                self._note_sends(outputs)
            return outputs

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
        self._land_copies(out.hisparse_copied or [])
        spec = self._worker_drafts.pop(id(scheduler_output), scheduler_output.scheduled_spec_decode_tokens)
        sampled = []
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if tokens:
                accepted = len(tokens) - 1
                drafts = list(spec.get(req_id, ()))
                tokens = [*drafts[:accepted], self._rng.randrange(*CORRECTION_TOKENS)]
                if self.batch_queue_size > 1:
                    self._unprocessed.setdefault(req_id, []).append(
                        _Unprocessed(tokens, len(drafts) - accepted)
                    )
            sampled.append(tokens)
        out.sampled_token_ids = sampled
        self._drafter_writes(scheduler_output, dict(zip(out.req_ids, sampled, strict=True)))
        self._check_drafter_reads(scheduler_output)
        self._land_early_stores()
        return out

    # -- what the host pool publishes --------------------------------------------------

    def _check_publications(self, pool: Any) -> None:
        """Every page the host pool indexes by a block hash must hold, in every sparse-MLA
        group, the KV of the tokens that hash names: the publisher's, up to the page's end
        (a later request's prefix hit takes it by that hash alone)."""
        publish = pool.publish

        def checked(page: int, block_hash: Any, publisher: str = "") -> None:
            if not self.drop_copies:
                try:
                    self._check_published(page, block_hash, publisher)
                except WrongKV as error:  # raised from the step: the scheduler must not catch it
                    self._found.append(error)
            publish(page, block_hash, publisher)

        pool.publish = checked

    def _check_published(self, page: int, block_hash: Any, publisher: str) -> None:
        request = self.requests[publisher]
        hashes = list(request.block_hashes)
        step = len(self.observations)
        if block_hash not in hashes:
            raise WrongKV(f"step {step}: host page {page} published by {publisher} under a hash not its own")
        index = hashes.index(block_hash)
        block_size = self.hisparse.block_size
        tokens = list(request.all_token_ids)
        columns = self.host_content.get(page)
        if columns is None:
            where = f"host page {page} published by {publisher} (page {index})"
            raise WrongKV(f"step {step}: {where} never written")
        for column, values in enumerate(columns):
            for row in range(block_size):
                position = index * block_size + row
                if (got := values.get(row)) != self._kv(tokens, position):
                    raise WrongKV(
                        f"step {step}: host page {page} published by {publisher} for page {index} holds "
                        f"KV that is not its tokens' at position {position} (sparse-MLA group {column})"
                        + (" (never written)" if got is None else "")
                    )
        self.pages_published += 1

    # -- the ExampleConnector's loads ---------------------------------------------------

    def _example_loads(self, meta: Any) -> None:
        """The ExampleConnector loads a stored prompt's prefix as the step starts, before
        its forward: every row of the load, in its group's device block or, landed, in the
        host page HiSparse gave it (a producer stored the same prompt's KV)."""
        mla = list(self.hisparse.mla_group_ids)
        sizes = [size for _, size in self._group_block_sizes()]
        for transfer in meta.requests:
            if transfer.is_store or self.drop_loads:
                continue
            # The producer computed the whole prompt (its drafter saw each token's next).
            prompt = list(self.requests[transfer.request_id].prompt_token_ids)
            for rows in transfer.rows:
                size = sizes[rows.group_id]
                for token, slot in zip(rows.tokens.tolist(), rows.slots.tolist(), strict=True):
                    where, row = divmod(slot, size)
                    value = self._value(rows.group_id, prompt, token)
                    if rows.on_host:
                        columns = self.host_content.setdefault(where, [{} for _ in mla])
                        columns[mla.index(rows.group_id)][row] = value
                    else:
                        self.block_content.setdefault(where, {})[row] = value
                    self.positions_imported += 1

    # -- NIXL's workers ------------------------------------------------------------------

    def _blocks_and_pages(self, req_id: str, block_ids: Any) -> list[tuple[int, int, int]]:
        """(block, group, page index) of each of `block_ids` (one list per group) in the
        request's block table."""
        found = []
        for g, (ids, table) in enumerate(zip(block_ids, self.block_ids(req_id), strict=True)):
            wanted = set(ids)
            found += [(b, g, index) for index, b in enumerate(table) if b in wanted]
        return found

    def _nixl_reads_start(self, meta: Any) -> None:
        """A read from a prefill peer starts with the step (as the harness plays it, for a
        request waiting for it): its device blocks and landing host pages hold nothing
        until it is reported done."""
        from vllm.v1.request import RequestStatus

        landing = getattr(meta, "host_landing", {})
        for req_id, req_meta in meta.reqs_to_recv.items():
            request = self.scheduler.requests.get(req_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            blocks = self._blocks_and_pages(req_id, req_meta.local_block_ids)
            landed = dict(landing.get(req_id, {}))
            for block, _, _ in blocks:
                self.block_content[block] = {}
            for host_page in landed.values():
                self.host_content[host_page] = [{} for _ in self.hisparse.mla_group_ids]
            self._nixl_reads[req_id] = (blocks, landed, list(request.prompt_token_ids))

    def _nixl_output(self, meta: Any, read_fails: Any) -> Any:
        """Reads reported done write the peer's KV of the prompt into their blocks and
        landing host pages, or, failed, what a partial transfer leaves: KV of nothing here.
        Sends reported done: the blocks offered held the request's own KV while the peer
        read them."""
        output = super()._nixl_output(meta, read_fails)
        failed = {req_id for req_id, _, _ in self._failed_reads.get(id(output), ())}
        sizes = [size for _, size in self._group_block_sizes()]
        mla = list(self.hisparse.mla_group_ids)
        for req_id in output.finished_recving:
            if req_id not in self._nixl_reads:
                continue
            blocks, landed, tokens = self._nixl_reads.pop(req_id)
            if self.drop_loads and req_id not in failed:
                continue
            garbage = req_id in failed
            for block, g, index in blocks:
                self.block_content[block] = self._read_values(g, tokens, index, sizes[g], garbage)
                self.positions_imported += len(self.block_content[block])
            for index, host_page in landed.items():
                columns = [self._read_values(g, tokens, index, sizes[g], garbage) for g in mla]
                self.host_content[host_page] = columns
        for req_id in output.finished_sending:
            if req_id in self._nixl_sends:
                self._check_sent(req_id, *self._nixl_sends.pop(req_id), sizes)
        return output

    def _read_values(self, g: int, tokens: list[int], index: int, size: int, garbage: bool) -> dict[int, Any]:
        """What a read leaves in page `index` of group `g` (`size`-token blocks): the
        peer's KV of the prompt's positions there, or garbage in every row if it failed."""
        if garbage:
            return dict.fromkeys(range(size), -1)
        first = index * size
        return {row: self._value(g, tokens, first + row) for row in range(min(size, len(tokens) - first))}

    def _note_sends(self, outputs: Any) -> None:
        """The blocks a finished request offers a decode peer (its `kv_transfer_params`)."""
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                params = out.kv_transfer_params
                if not params or not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
                    continue
                request = self.requests[out.request_id]
                blocks = self._blocks_and_pages(out.request_id, params["remote_block_ids"])
                # A turn that decoded with drafts and stopped at max_tokens may count computed
                # an accepted draft its stop cut off (upstream's `remote_num_tokens` is its
                # computed count): a peer checks the count against its prompt, so the KV
                # offered is that of the request's own tokens only.
                tokens = list(request.all_token_ids)
                sent = (blocks, tokens, min(params["remote_num_tokens"], len(tokens)))
                self._nixl_sends[out.request_id] = sent

    def _check_sent(
        self,
        req_id: str,
        blocks: list[tuple[int, int, int]],
        tokens: list[int],
        num_tokens: int,
        sizes: list[int],
    ) -> None:
        for block, g, index in blocks:
            held = self.block_content.get(block, {})
            for row in range(sizes[g]):
                position = index * sizes[g] + row
                if position >= num_tokens:
                    break
                if not self._matches(held.get(row), self._value(g, tokens, position)):
                    raise WrongKV(
                        f"step {len(self.observations)}: block {block} that {req_id} offered a decode peer "
                        f"(page {index}, group {g}) does not hold its KV at position {position}"
                    )
                self.positions_sent += 1

    # -- the OffloadingConnector's workers ------------------------------------------------

    def _chunk_map(self, gpu_spec: Any, cpu_spec: Any) -> list[tuple[int, tuple[int, int, int]]]:
        """(GPU block, its CPU place) for every GPU block of a job, as the CPU worker pairs them."""
        per_chunk = self._offloading.config.blocks_per_chunk
        gpu_blocks = [int(b) for b in gpu_spec.block_ids]
        cpu_blocks = [int(b) for b in cpu_spec.block_ids]
        pairs = []
        gpu_at = cpu_at = 0
        for g, (size, index) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)):
            if size == 0:
                continue
            skip = index % per_chunk
            for k in range(size):
                chunk, sub = divmod(skip + k, per_chunk)
                pairs.append((gpu_blocks[gpu_at + k], (g, cpu_blocks[cpu_at + chunk], sub)))
            gpu_at += size
            cpu_at += -(-(skip + size) // per_chunk)
        assert gpu_at == len(gpu_blocks) and cpu_at == len(cpu_blocks), "a job's blocks do not pair up"
        return pairs

    def _land_early_stores(self) -> None:
        for job_id, job in self._early_stores.items():
            self._submit_store(job_id, job)
            pairs, values = self._stores.pop(job_id)
            for (_, place), value in zip(pairs, values, strict=True):
                self.cpu_content[place] = value
        self._early_stores = {}

    def _submit_store(self, job_id: int, job: Any) -> None:
        pairs = self._chunk_map(job.src_spec, job.dst_spec)
        self._stores[job_id] = (pairs, [dict(self.block_content.get(b, {})) for b, _ in pairs])

    def _offloading_transfers_before_forward(self, meta: Any) -> None:
        """The worker's `handle_preemptions` and `start_kv_transfers`: the stores deferred
        from the last step and those the fence flushes read their blocks; loads read theirs,
        and their GPU blocks hold nothing until they are done."""
        flushed = set(meta.jobs_to_flush or ())
        for job_id, job in meta.store_jobs.items():
            if job_id in flushed:
                self._submit_store(job_id, job)
        for job_id, job in list(self._deferred_stores.items()):
            self._submit_store(job_id, job)
        self._deferred_stores = {}
        for job_id, job in meta.load_jobs.items():
            pairs = self._chunk_map(job.dst_spec, job.src_spec)
            self._loads[job_id] = (pairs, [dict(self.cpu_content.get(place, {})) for _, place in pairs])
            for block, _ in pairs:
                self.block_content[block] = {}
        for job_id, job in meta.store_jobs.items():
            if job_id not in flushed:
                self._deferred_stores[job_id] = job

    def _offloading_output(self, meta: Any) -> Any:
        output = super()._offloading_output(meta)
        for job_id in output.kv_connector_worker_meta.completed_jobs:
            if job_id in self._deferred_stores:
                # Reported before the next step submits it: it reads its blocks once this
                # step is done, its drafter included (`_land_early_stores`).
                self._early_stores[job_id] = self._deferred_stores.pop(job_id)
            elif job_id in self._stores:
                pairs, values = self._stores.pop(job_id)
                for (_, place), value in zip(pairs, values, strict=True):
                    self.cpu_content[place] = value
            elif job_id in self._loads:
                pairs, values = self._loads.pop(job_id)
                if self.drop_loads:
                    continue
                for (block, _), value in zip(pairs, values, strict=True):
                    self.block_content[block] = value
                    self.offloaded_positions_loaded += len(value)
        return output

    # -- the worker's KV ----------------------------------------------------------------

    def unchecked_drafter_reads(self) -> int:
        """Deferred reads of a drafter's KV whose step's output never came back."""
        return sum(len(reads) for reads in self._drafter_reads.values())

    def _check_drafter_reads(self, scheduler_output: Any) -> None:
        """The step's reads of a drafter's KV that another request of the step wrote after
        sampling: it must be there now."""
        mla = list(self.hisparse.mla_group_ids)
        for req_id, g, where, row, tokens, position in self._drafter_reads.pop(id(scheduler_output), ()):
            if where >= 0:
                got = self.block_content.get(where, {}).get(row)
            else:
                got = self.host_content.get(-1 - where, [{}] * len(mla))[mla.index(g)].get(row)
            if not self._holds(req_id, g, tokens, position, got, self._value(g, tokens, position)):
                raise WrongKV(
                    f"step {len(self.observations)}: {req_id} position {position} (group {g}): the "
                    f"drafter's KV there, written in the same step, is not its own"
                )

    def _drafter_writes(self, scheduler_output: Any, sampled: dict[str, list[int]]) -> None:
        """The drafter runs over the step's positions once its tokens are sampled, each with
        the token after it: the next prompt token, an accepted draft, or the sampled one.
        Past the last accepted draft it writes KV of nothing (its rows are computed again)."""
        steps = self._drafter_steps.pop(id(scheduler_output), ())
        for req_id, first, n, tokens, num_drafts, tables in steps:
            if req_id not in self.scheduler.requests:
                continue
            verified = tokens[: len(tokens) - num_drafts]
            final = verified + sampled.get(req_id, []) if sampled.get(req_id) else tokens
            for g in self._drafter_groups:
                block_size = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size
                for position in range(first, first + n):
                    index, row = divmod(position, block_size)
                    if index >= len(tables[g]):
                        continue
                    held = self.block_content.setdefault(tables[g][index], {})
                    target = held.get(row, (None,))[0] if isinstance(held.get(row), tuple) else None
                    nxt = self._kv(final, position + 1) if position + 1 < len(final) else -1
                    held[row] = (target, nxt)

    def schedule(self) -> Any:
        output = super().schedule()
        self._raise_found()
        self._run_step(output)
        return output

    def step(self) -> Any:
        observation = super().step()
        self._raise_found()
        return observation

    def _raise_found(self) -> None:
        if self._found:
            raise self._found[0]

    def _tokens(self, request: Any, spec: dict[str, list[int]]) -> list[int]:
        """The request's tokens as the worker sees them: processed, then those of steps
        still in flight, then this step's drafts."""
        tokens = list(request.all_token_ids)
        for pending in self._unprocessed.get(request.request_id, ()):
            tokens += pending.tokens
        return tokens + list(spec.get(request.request_id, ()))

    def _first_position(self, request: Any, num_scheduled: int) -> int:
        """The first position the step computes for the request. The scheduler counts a
        step's drafts computed when it schedules them and rolls the rejected ones back when
        it processes the step's output; the worker already knows them (asynchronously, the
        steps in flight), and writes at the true positions."""
        rejected = sum(p.rejected for p in self._unprocessed.get(request.request_id, ()) if not p.stale)
        return request.num_computed_tokens - num_scheduled - rejected

    @staticmethod
    def _kv(tokens: list[int], position: int) -> int:
        return hash(tuple(tokens[: position + 1]))

    def _value(self, g: int, tokens: list[int], position: int) -> Any:
        """What group `g` holds at `position` for `tokens`: a drafter group's also names the
        next token (None where `tokens` end there: not known yet)."""
        value = self._kv(tokens, position)
        if g not in self._drafter_groups:
            return value
        return (value, self._kv(tokens, position + 1) if position + 1 < len(tokens) else None)

    @staticmethod
    def _matches(got: Any, want: Any) -> bool:
        if isinstance(want, tuple) and want[1] is None:  # the drafter's next token unknown
            return isinstance(got, tuple) and got[0] == want[0]
        return got == want

    def _holds(
        self, req_id: str, g: int, tokens: list[int], position: int, got: Any, want: Any
    ) -> bool | None:
        """Whether `got` is what the request may read at `position` of group `g` (`want`, its
        own KV); None where only a drafter's part is missing, which another request's forward
        of the same step writes once its tokens are sampled (checked again after that).

        One allowance, upstream's: the prefix cache names a page by the tokens up to its end,
        so a block a hit shares holds the drafter's KV of whichever sequence computed it,
        whose next token may differ at the page's last position. There that part may name
        another next token where the page after was matched too: inside the hit, the page a
        drafter's hit drops, and past a connector's hit (its tier holds what the request
        that stored it computed). At the end of a local hit that dropped no page it may not."""
        if self._matches(got, want):
            return True
        if g not in self._drafter_groups or not isinstance(got, tuple) or got[0] != want[0]:
            return False
        if got[1] is None:
            return None
        hit, matched = self._hits.get(req_id, (0, False))
        if position + 1 == hit:
            return matched and hit % self.hisparse.block_size == 0
        block_size = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec.block_size
        return position + 1 < hit and (position + 1) % block_size == 0

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
        meta = output.kv_connector_metadata
        for leaf_meta in getattr(meta, "metadata", None) or ([meta] if meta is not None else []):
            if self._offloading is not None and hasattr(leaf_meta, "store_jobs"):
                self._offloading_transfers_before_forward(leaf_meta)
            elif self._nixl and hasattr(leaf_meta, "reqs_to_recv"):
                self._nixl_reads_start(leaf_meta)
        self._update_worker_tables(output)
        for req_id in list(output.finished_req_ids) + list(output.preempted_req_ids or ()):
            self.worker_host_pages.pop(req_id, None)
            self._leases.pop(req_id, None)
            self._hot.pop(req_id, None)
            self._hits.pop(req_id, None)
        for req_id in output.preempted_req_ids or ():
            for pending in self._unprocessed.get(req_id, ()):
                pending.stale = True
        if plan is not None:
            for run in plan.host_pages:
                pages = self.worker_host_pages.setdefault(run.request_id, {})
                for index, host_page in run.pages():
                    if host_page == NOT_ON_HOST:
                        pages.pop(index, None)
                    else:
                        pages[index] = host_page
            for lease in plan.leases:  # a new lease starts empty
                self._leases[lease.request_id] = lease.block_ids
                self._hot[lease.request_id] = {}
            for restore in plan.restores:
                source = self.host_content.get(restore.host_page)
                for column, block in enumerate(restore.block_ids):
                    self.block_content[block] = dict(source[column]) if source else {}
        for copy in output.kv_cache_block_copies or ():
            self.block_content[copy.dst_block_id] = dict(self.block_content.get(copy.src_block_id, {}))
        # A synchronous load (the ExampleConnector's) runs once the step's plan is applied,
        # just before the forward.
        for leaf_meta in getattr(meta, "metadata", None) or ([meta] if meta is not None else []):
            if self._example and hasattr(leaf_meta, "requests"):
                self._example_loads(leaf_meta)
        groups = self._group_block_sizes()
        spec = output.scheduled_spec_decode_tokens
        if self.batch_queue_size > 1 and spec:
            # The scheduler's placeholders; the worker's drafter proposed these.
            spec = {
                req_id: [self._rng.randrange(*DRAFT_TOKENS) for _ in placeholders]
                for req_id, placeholders in spec.items()
            }
            self._worker_drafts[id(output)] = spec
        scheduled = {
            req_id: (self.scheduler.requests[req_id], n) for req_id, n in output.num_scheduled_tokens.items()
        }
        self._step_id = id(output)
        admitted = {new.req_id for new in output.scheduled_new_reqs}
        admitted.update(output.scheduled_cached_reqs.resumed_req_ids)
        for req_id in admitted & scheduled.keys():
            request, n = scheduled[req_id]
            hit = self._first_position(request, n)
            local, next_matched = self._local_hits.pop(req_id, (-1, False))
            # A hit cut after its lookup ends before pages it matched; a connector's hit (past
            # the local one) drops a chunk for a drafter (the OffloadingConnector's), and the
            # others load the request's own prompt.
            matched = next_matched if local == hit else (hit < local or local >= 0)
            self._hits[req_id] = (hit, matched)
        for req_id, (request, n) in scheduled.items():
            first = self._first_position(request, n)
            tokens = self._tokens(request, spec)
            assert len(tokens) >= first + n, f"{req_id} writes past its {len(tokens)} tokens"
            assert req_id not in spec or len(tokens) == first + n, f"{req_id} decodes from {first}"
            tables = self._worker_table(req_id)
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
                    # A drafter group's drafter part is written once the step's tokens are
                    # sampled (`_drafter_writes`).
                    written = (value, None) if g in self._drafter_groups else value
                    self.block_content.setdefault(block, {})[row] = written
            if self._drafter_groups:
                self._drafter_steps.setdefault(id(output), []).append(
                    (req_id, first, n, tokens, len(spec.get(req_id, ())), [list(t) for t in tables])
                )
        staging = {entry.request_id: entry for entry in plan.staging} if plan is not None else {}
        used: dict[str, list[tuple[int, int, Any]]] = {}
        for req_id, (request, n) in scheduled.items():
            if self.resolve_hot_rows and self.worker_host_pages.get(req_id):
                used[req_id] = self._resolve_host_rows(
                    req_id, self._first_position(request, n), n, self._tokens(request, spec),
                    staging.get(req_id), mla, null,
                )  # fmt: skip
        for req_id, rows in used.items():
            for block, row, value in rows:
                if self.block_content.get(block, {}).get(row) != value:
                    raise WrongKV(
                        f"step {len(self.observations)}: row {row} of block {block}, which {req_id}'s "
                        "resolver used, was overwritten by another request's copy in the same step"
                    )
        for req_id, (request, n) in scheduled.items():
            self._check_reads(
                req_id, self._first_position(request, n), self._tokens(request, spec), groups, mla, null
            )
        if plan is not None and not self.drop_copies:
            for copy in plan.copies:
                block_ids = list(copy.block_ids)
                if self.copy_previous_page and copy.page_index > 0:
                    previous = self.block_ids(copy.request_id)[mla[0]][copy.page_index - 1]
                    block_ids[0] = previous if previous != null else block_ids[0]
                # In flight (on CUDA beside the next steps) until reported: the host page
                # holds nothing before, and the source blocks must not change meanwhile.
                read = [dict(self.block_content.get(b, {})) for b in block_ids]
                self._copies_in_flight[copy.copy_id] = (copy, block_ids, read)
                self.host_content[copy.host_page] = [{} for _ in block_ids]

    def _resolve_host_rows(
        self, req_id: str, first: int, n: int, tokens: list[int], staging: Any, mla: list[int], null: int
    ) -> list[tuple[int, int, Any]]:
        """The resolver's rows for one step of a request with HOST pages, after the forward's
        writes and before any read: it selects positions of its HOST pages (up to what its
        tokens may select and its hot and staging rows hold; half the time many of them
        held in its hot buffer already). A selected position its hot buffer holds is a hit,
        read from its slot of the lease's blocks, which must still hold that position's KV;
        the others are misses, copied from their host page into the eligible slots (those
        holding no selected position, the least recently used first, empty ones before
        them), and past those into the step's staging rows. The copies write the lease's
        and staging's blocks: a block that is also another request's (or in the prefix
        cache) then holds KV that is not its owner's, and its reads find it. Returns the rows
        it used, (block, row, what it holds), which no other request's copies of the same
        step may overwrite (each layer's copies all run before its attention reads)."""
        used: list[tuple[int, int, Any]] = []
        step = len(self.observations)
        bs = self.hisparse.block_size
        host_pages = self.worker_host_pages[req_id]
        pages = sorted(i for i in host_pages if (i + 1) * bs <= first)
        if not pages:
            return used
        lease = self._leases.get(req_id)
        if lease is None:
            raise WrongKV(f"step {step}: {req_id} has HOST pages and no hot lease on the worker")
        # The hot buffer's slots; a smaller lease (a context that fits in fewer rows) ends in
        # null blocks, which its selections never reach.
        slots = range(min(len(lease[0]) * bs, self.hisparse.hot_rows))
        num_staged = staging.num_slots if staging is not None else 0
        limit = min(len(pages) * bs, n * self.hisparse.index_topk, len(slots) + num_staged)
        if limit <= 0:
            return used
        count = self._selection_rng.randint(1, limit)
        hot = self._hot[req_id]
        held = sorted(p for p, _ in hot.values() if p < first and p // bs in host_pages)
        selected: set[int] = set()
        if held and self._selection_rng.random() < 0.5:
            selected.update(self._selection_rng.sample(held, min(len(held), count)))
        for index in self._selection_rng.sample(range(len(pages) * bs), count):
            if len(selected) >= count:
                break
            selected.add(pages[index // bs] * bs + index % bs)
        slot_of = {p: s for s, (p, _) in hot.items()}
        for position in sorted(p for p in selected if p in slot_of):
            slot = slot_of[position]
            target = self._kv(tokens, position)
            for column, g in enumerate(mla):
                block = lease[column][slot // bs]
                want = self._value(g, tokens, position) if g in self._drafter_groups else target
                got = self.block_content.get(block, {}).get(slot % bs)
                if not self._matches(got, want):
                    raise WrongKV(
                        f"step {step}: {req_id} position {position} (group {g}): its hot buffer's slot "
                        f"{slot} (block {block}) holds KV that is not its own"
                        + (" (nothing)" if got is None else "")
                    )
                used.append((block, slot % bs, got))
            hot[slot] = (position, step)
            self.hot_rows_hit += 1
        taken = {slot_of[p] for p in selected if p in slot_of}
        # Empty slots first, then the least recently used.
        eligible = sorted((s for s in slots if s not in taken), key=lambda s: (hot.get(s, (0, -1))[1], s))
        misses = sorted(p for p in selected if p not in slot_of)
        for i, position in enumerate(misses):
            if i < len(eligible):
                slot, blocks = eligible[i], lease
                hot[slot] = (position, step)
                self.hot_rows_filled += 1
            else:
                slot, blocks = i - len(eligible), staging.block_ids
                self.rows_staged += 1
            source = self.host_content.get(host_pages[position // bs])
            if self.drop_row_copies:
                continue
            for column in range(len(mla)):
                block = blocks[column][slot // bs]
                if block == null:
                    raise WrongKV(
                        f"step {step}: {req_id} copies position {position} into the null block "
                        + ("(a hot buffer slot)" if blocks is lease else "(staging)")
                    )
                value = source[column].get(position % bs) if source else None
                rows = self.block_content.setdefault(block, {})
                if value is None:
                    rows.pop(slot % bs, None)
                else:
                    rows[slot % bs] = value
                used.append((block, slot % bs, value))
        return used

    def _land_copies(self, copy_ids: list[int]) -> None:
        """The copies a step's output reports: their host pages hold what they read, which
        their source blocks still hold (a block a copy reads is not rewritten before the
        copy is reported)."""
        for copy_id in copy_ids:
            if copy_id not in self._copies_in_flight:
                continue
            copy, block_ids, read = self._copies_in_flight.pop(copy_id)
            for block, values in zip(block_ids, read, strict=True):
                if self.block_content.get(block, {}) != values:
                    raise WrongKV(
                        f"step {len(self.observations)}: block {block} that copy {copy_id} of "
                        f"{copy.request_id} page {copy.page_index} reads was rewritten before it landed"
                    )
            self.host_content[copy.host_page] = read

    def _update_worker_tables(self, output: Any) -> None:
        """The step's changes to the workers' block tables, in the workers' order: upstream's
        (finished requests go, new and resumed ones bring their tables, the others append
        their new blocks), then the plan's block-table updates. The tables of the requests
        the step schedules must then equal the scheduler's."""
        step = len(self.observations)
        tables = self.worker_tables
        for req_id in output.finished_req_ids:
            tables.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            tables[new.req_id] = [list(group) for group in new.block_ids]
        cached = output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in cached.resumed_req_ids:
                if new_block_ids is None:
                    raise WrongKV(f"step {step}: {req_id} resumes with no block table")
                tables[req_id] = [list(group) for group in new_block_ids]
            elif new_block_ids is not None:
                for table, more in zip(tables[req_id], new_block_ids, strict=True):
                    table.extend(more)
        plan = output.hisparse_plan
        if plan is not None and not self.drop_table_updates:
            for update in plan.block_table_updates:
                table = tables.get(update.request_id)
                if table is None:
                    continue  # a request the workers do not hold (finished meanwhile)
                for g, block in zip(plan.mla_group_ids, update.block_ids, strict=True):
                    if update.position >= len(table[g]):
                        raise WrongKV(
                            f"step {step}: {update.request_id}'s block-table update of page "
                            f"{update.position} is past its table ({len(table[g])} pages)"
                        )
                    table[g][update.position] = block
        for req_id in output.num_scheduled_tokens:
            held = tables.get(req_id)
            want = [list(group) for group in self.block_ids(req_id)]
            if held != want:
                raise WrongKV(f"step {step}: the workers' block table of {req_id} is not the scheduler's")

    def _worker_table(self, req_id: str) -> list[list[int]]:
        table = self.worker_tables.get(req_id)
        if table is None:
            raise WrongKV(f"step {len(self.observations)}: the workers hold no block table of {req_id}")
        return table

    def _check_reads(
        self,
        req_id: str,
        num_computed: int,
        tokens: list[int],
        groups: list[tuple[int, int]],
        mla: list[int],
        null: int,
    ) -> None:
        tables = self._worker_table(req_id)
        host_pages = self.worker_host_pages.get(req_id, {})
        step = len(self.observations)
        for position in range(num_computed):
            target = self._kv(tokens, position)
            for g, block_size in groups:
                want = self._value(g, tokens, position) if g in self._drafter_groups else target
                index, row = divmod(position, block_size)
                block = tables[g][index]
                # The resolver reads a sparse-MLA page from the host page the worker holds
                # for it, if any (its host page table), else from its device block.
                host_page = host_pages.get(index) if g in mla else None
                if block == null and host_page is None:
                    if g not in mla:
                        raise WrongKV(f"step {step}: {req_id} page {index}: the null block in group {g}")
                    raise WrongKV(f"step {step}: {req_id} page {index} is on no device block nor host page")
                if host_page is not None:
                    got = self.host_content.get(host_page, [{}] * len(mla))[mla.index(g)].get(row)
                    where = f"host page {host_page}"
                    self.host_positions_read += 1
                else:
                    got = self.block_content.get(block, {}).get(row)
                    where = f"block {block}"
                self.positions_read += 1
                holds = self._holds(req_id, g, tokens, position, got, want)
                if holds is None:
                    where_key = block if host_page is None else -1 - host_page
                    self._drafter_reads.setdefault(self._step_id, []).append(
                        (req_id, g, where_key, row, tokens, position)
                    )
                elif not holds:
                    raise WrongKV(
                        f"step {step}: {req_id} position {position} (page {index}, group {g}): {where} "
                        "holds KV that is not its own" + (" (never written)" if got is None else "")
                    )
