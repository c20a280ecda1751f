# SPDX-License-Identifier: Apache-2.0
"""ExampleConnector for models with several KV cache groups (DSA: sparse MLA + indexer).

Upstream's ExampleConnector stores a prompt's KV cache in shared storage, one
safetensors file per layer in a folder named by the hash of the prompt's
tokens, and a later instance with the same prompt loads it: the disaggregated
prefill example that runs without a network stack. In 0.29.0 it handles one
KV cache group only (it refuses the hybrid KV cache manager), stores only the
layers of the attention decorator (not a DSA model's indexer K cache), stores
the first chunk's blocks of a chunked prompt, and stores on every role. This
class keeps its storage and its hit rule and adds:
- one slot mapping per KV cache group: every layer's rows go to and from its
  own group's blocks (SupportsHMA);
- every layer with a KV cache is stored (indexer caches included), once the
  prompt's stored prefix is computed, whatever the chunking; only producer
  roles without Hybrid HiSparse store, and a folder is complete once its
  `complete` marker exists;
- a load skips the null placeholders of a local hit and, with Hybrid HiSparse,
  writes the pages it lands in the host pool there (`host_landing`, see
  vllm/v1/hisparse/kv_import.py) instead of into device blocks.

The stored prefix of a prompt of L tokens is its first (L - 1) // block_size
whole blocks: at least one token is left to compute, as the scheduler needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.logger import init_logger
from vllm.utils.gpu_sync_debug import gpu_sync_allowed
from vllm.v1.hisparse.kv_import import HostLanding, host_pool_layer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

COMPLETE_MARKER = "complete"


@dataclass
class GroupRows:
    """Rows of one KV cache group: token i of `tokens` lives at `slots[i]` of its destination.

    `on_host`: the slots index the HiSparse host pool (host page x block size + row)
    rather than the group's device blocks.
    """

    group_id: int
    tokens: torch.Tensor
    slots: torch.Tensor
    on_host: bool = False


@dataclass
class GroupedRequestTransfer:
    request_id: str
    token_ids: torch.Tensor  # the stored prefix: names the folder
    mm_hashes: list[str]
    is_store: bool
    rows: list[GroupRows]


@dataclass
class GroupedExampleConnectorMetadata(KVConnectorMetadata):
    requests: list[GroupedRequestTransfer] = field(default_factory=list)


@dataclass
class _PromptStore:
    """A prompt a producer stores once its stored prefix is computed."""

    token_ids: list[int]
    mm_hashes: list[str]
    block_ids: list[list[int]]


def prompt_keys(request: Request) -> list[str]:
    """What names a stored prompt's KV beside its tokens: its multimodal inputs, its cache
    salt (a tenant's: vLLM's prefix cache keeps salts apart) and its LoRA adapter (which
    changes every layer's KV). Upstream's ExampleConnector names the tokens and multimodal
    inputs only, so another tenant's or adapter's request of the same prompt loaded it,
    and with HiSparse its pages landed in the host pool under that request's hashes."""
    keys = [f.identifier for f in request.mm_features]
    # Each with its length: upstream joins the keys with "-", which a salt may contain.
    if request.cache_salt:
        keys.append(f"cache_salt:{len(request.cache_salt)}:{request.cache_salt}")
    if request.lora_request is not None:
        name = request.lora_request.lora_name
        keys.append(f"lora:{len(name)}:{name}")
    return keys


class GroupedExampleConnector(ExampleConnector, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        groups = kv_cache_config.kv_cache_groups
        self._group_of_layer = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        self._group_block_sizes = [group.kv_cache_spec.block_size for group in groups]
        self._stores = self._kv_transfer_config.is_kv_producer
        self._loads: dict[str, list[GroupRows]] = {}
        self._load_requests: dict[str, Request] = {}
        self._storing: dict[str, _PromptStore] = {}
        # Set by Hybrid HiSparse's scheduler side: where pages of an import land.
        self.host_landing: HostLanding | None = None
        # Each request's keys beside its tokens (`prompt_keys`), for its store.
        self._keys: dict[str, list[str]] = {}

    # -- scheduler side ------------------------------------------------------

    def stored_prefix(self, num_prompt_tokens: int) -> int:
        return max(num_prompt_tokens - 1, 0) // self._block_size * self._block_size

    def prompt_folder(self, prompt: list[int], mm_hashes: list[str]) -> str:
        """The folder holding the stored prefix of `prompt`, complete once it has the marker."""
        prefix = torch.tensor(prompt[: self.stored_prefix(len(prompt))], dtype=torch.int64)
        return self._generate_foldername_debug(prefix, mm_hashes)

    def on_new_request(self, request: Request) -> None:
        self._keys[request.request_id] = prompt_keys(request)

    def _is_stored(self, prompt: list[int], mm_hashes: list[str]) -> bool:
        if not self.stored_prefix(len(prompt)):
            return False
        return os.path.exists(os.path.join(self.prompt_folder(prompt, mm_hashes), COMPLETE_MARKER))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        prompt = list(request.prompt_token_ids or [])
        if not self._is_stored(prompt, prompt_keys(request)):
            return 0, False
        return max(self.stored_prefix(len(prompt)) - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        """Blocks are allocated for the hit: the rows to load, group by group."""
        if num_external_tokens <= 0:
            return
        num_tokens = self.stored_prefix(len(request.prompt_token_ids or []))
        landing = self.host_landing(request.request_id) if self.host_landing is not None else {}
        rows: list[GroupRows] = []
        for g, group_blocks in enumerate(blocks.blocks):
            block_size = self._group_block_sizes[g]
            device_tokens: list[int] = []
            device_slots: list[int] = []
            host_tokens: list[int] = []
            host_slots: list[int] = []
            for token in range(num_tokens):
                position, offset = divmod(token, block_size)
                block = group_blocks[position]
                if not block.is_null:
                    device_tokens.append(token)
                    device_slots.append(block.block_id * block_size + offset)
                elif position in landing:
                    host_tokens.append(token)
                    host_slots.append(landing[position] * block_size + offset)
                # else: a placeholder of a page the request already has in the host pool
            for tokens, slots, on_host in (
                (device_tokens, device_slots, False),
                (host_tokens, host_slots, True),
            ):
                if tokens:
                    rows.append(GroupRows(g, torch.tensor(tokens), torch.tensor(slots), on_host))
        self._loads[request.request_id] = rows
        self._load_requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = GroupedExampleConnectorMetadata()
        for request_id, rows in self._loads.items():
            request = self._load_requests[request_id]
            prompt = list(request.prompt_token_ids or [])
            meta.requests.append(
                GroupedRequestTransfer(
                    request_id,
                    torch.tensor(prompt[: self.stored_prefix(len(prompt))], dtype=torch.int64),
                    prompt_keys(request),
                    is_store=False,
                    rows=rows,
                )
            )
        if self._stores and self.host_landing is not None:
            # With Hybrid HiSparse here, a prompt's pages can leave the device between the
            # step that schedules a store and the one that runs it.
            logger.warning_once(
                "ExampleConnector stores nothing on an instance with hisparse_config: its "
                "sparse-MLA pages may be in the host pool. Store from a producer without it."
            )
        elif self._stores:
            self._plan_stores(scheduler_output, meta)
        self._loads.clear()
        self._load_requests.clear()
        return meta

    def _plan_stores(self, scheduler_output: SchedulerOutput, meta: GroupedExampleConnectorMetadata) -> None:
        """Store each new prompt in the step that computes the last token of its stored prefix."""
        progress: list[tuple[str, int]] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            prompt = list(new_req.prompt_token_ids or [])
            mm_hashes = self._keys.get(new_req.req_id) or [f.identifier for f in new_req.mm_features]
            if not self.stored_prefix(len(prompt)) or self._is_stored(prompt, mm_hashes):
                continue
            block_ids = [list(ids) for ids in new_req.block_ids]
            self._storing[new_req.req_id] = _PromptStore(prompt, mm_hashes, block_ids)
            progress.append((new_req.req_id, new_req.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            store = self._storing.get(request_id)
            if store is None:
                continue
            new_ids = cached.new_block_ids[i]
            if request_id in cached.resumed_req_ids:
                store.block_ids = [list(ids) for ids in new_ids or ()]
            elif new_ids is not None:
                for ids, more in zip(store.block_ids, new_ids, strict=True):
                    ids.extend(more)
            progress.append((request_id, cached.num_computed_tokens[i]))
        for request_id, num_computed in progress:
            store = self._storing[request_id]
            prefix = self.stored_prefix(len(store.token_ids))
            if num_computed + scheduler_output.num_scheduled_tokens.get(request_id, 0) < prefix:
                continue
            del self._storing[request_id]
            rows = []
            for g, ids in enumerate(store.block_ids):
                block_size = self._group_block_sizes[g]
                tokens = torch.arange(prefix)
                blocks = torch.tensor(ids, dtype=torch.int64)[tokens // block_size]
                rows.append(GroupRows(g, tokens, blocks * block_size + tokens % block_size))
            meta.requests.append(
                GroupedRequestTransfer(
                    request_id,
                    torch.tensor(store.token_ids[:prefix], dtype=torch.int64),
                    store.mm_hashes,
                    is_store=True,
                    rows=rows,
                )
            )

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._storing.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        return False, None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    # -- worker side ---------------------------------------------------------

    def _paged(self, layer_name: str, cache: torch.Tensor, on_host: bool) -> torch.Tensor:
        """[blocks, block size, *row] view of a layer's cache (or of its host pool)."""
        paged = host_pool_layer(layer_name) if on_host else cache
        if paged.dim() == 4 and paged.shape[1] == 1:
            paged = paged[:, 0]  # [blocks, 1 (latent head), block size, width]
        return paged

    def _layers(self, forward_context: ForwardContext) -> list[tuple[str, int, torch.Tensor]]:
        layers = []
        for name, layer in forward_context.no_compile_layers.items():
            cache = getattr(layer, "kv_cache", None)
            if isinstance(cache, torch.Tensor) and cache.numel() and name in self._group_of_layer:
                layers.append((name, self._group_of_layer[name], cache))
        return layers

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, GroupedExampleConnectorMetadata)
        loads = [r for r in metadata.requests if not r.is_store]
        if not loads:
            return
        layers = self._layers(forward_context)
        for transfer in loads:
            for name, group_id, cache in layers:
                group_rows = [rows for rows in transfer.rows if rows.group_id == group_id]
                if not group_rows:
                    continue
                path = self._generate_filename_debug(name, transfer.token_ids, transfer.mm_hashes)
                stored = safetensors.torch.load_file(path)["kv_cache"]
                for rows in group_rows:
                    paged = self._paged(name, cache, rows.on_host)
                    block_size = paged.shape[1]
                    source = stored[rows.tokens].to(paged.device, dtype=paged.dtype)
                    paged[rows.slots // block_size, rows.slots % block_size] = source
            logger.debug("Loaded %d tokens of request %s", len(transfer.token_ids), transfer.request_id)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        """Nothing per layer: `wait_for_save` stores every layer once the forward is done."""

    def wait_for_save(self) -> None:
        from vllm.forward_context import get_forward_context

        metadata = self._get_connector_metadata()
        assert isinstance(metadata, GroupedExampleConnectorMetadata)
        stores = [r for r in metadata.requests if r.is_store]
        if not stores:
            return
        layers = self._layers(get_forward_context())
        for transfer in stores:
            by_group = {rows.group_id: rows for rows in transfer.rows}
            for name, group_id, cache in layers:
                rows = by_group[group_id]
                paged = self._paged(name, cache, on_host=False)
                block_size = paged.shape[1]
                with gpu_sync_allowed():
                    stored = paged[rows.slots // block_size, rows.slots % block_size].detach().cpu()
                path = self._generate_filename_debug(name, transfer.token_ids, transfer.mm_hashes)
                # Each tensor-parallel rank of an MLA model stores the same rows: whole files only.
                partial = f"{path}.{os.getpid()}.partial"
                safetensors.torch.save_file({"kv_cache": stored.contiguous()}, partial)
                os.replace(partial, path)
            folder = self._generate_foldername_debug(transfer.token_ids, transfer.mm_hashes)
            with open(os.path.join(folder, COMPLETE_MARKER), "w"):
                pass
