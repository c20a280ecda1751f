# SPDX-License-Identifier: Apache-2.0
"""A step-time model of one GPU of a tensor-parallel node, in place of the worker.

Owns the simulated clock's arithmetic: how long one engine step of a DSA model takes
on an H200 given what the real scheduler scheduled (tokens per request and their
positions) and what must cross PCIe (HiSparse's miss rows, restores and page copies;
the OffloadingConnector's loads and stores). Every constant is in `CONSTANTS`, with
its unit and source; `load_constants` overrides any of them from a JSON file (for
example with bandwidths `scripts/gpu_check.py` measured). Its PCIe and resolver
constants were measured on one H200; every figure it gives is simulated.

The model, per step and GPU (all TP ranks do the same work at the same time):

- linear layers: the larger of reading the weights the step touches (the dense part,
  plus the experts a batch of T tokens routes to: 1 - (1 - k/E)^T of them) at HBM
  bandwidth, and 2 x active parameters x T FLOPs at the FP8 GEMM rate;
- sparse MLA: per token, min(position, top-K) rows of 656 B (or the context, below
  top-K) read and multiplied (QK over latent+rope, PV over the latent) by the
  rank's heads; a request's tokens in one step share the rows they read;
- the indexer, on the layers that hold one: per token, the whole context's keys
  scored by every index head; a request's tokens share one read of the keys;
- two all-reduces per layer; the MTP drafter's layers once per draft token;
- a fixed per-step overhead (sampling, launches);
- HiSparse: a step with HOST pages in it pays the resolver's own work, a plan per
  indexer layer and a replay per sparse-MLA layer (`resolver_plan_s`,
  `resolver_replay_s`, measured on an H200 at batch 64, taken as the same at every
  batch); a MIXED/NONE request's step selects top-K rows per layer, the host part of
  them in proportion to its HOST pages, and loads the share its hot buffer misses;
  a prefill chunk over HOST pages stages the union of its tokens' host selections
  (as many rows as `chunk_union_tokens` tokens select, at most the host rows). Those
  loads and restores precede the layer's attention: they add to the step. Page
  copies to the host run after the forward on a copy stream: they only lengthen the
  step when the link is still busy with earlier ones;
- the OffloadingConnector: loads and stores queue on the link, asynchronously; a
  request waiting for its loads starts when they have crossed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str


# The H200 SXM (141 GiB) node: every constant the simulated clock uses.
CONSTANTS: dict[str, Constant] = {
    "hbm_bytes_per_s": Constant(4.8e12, "B/s", "NVIDIA H200 datasheet: 4.8 TB/s HBM3e"),
    "hbm_efficiency": Constant(
        0.75, "fraction", "assumption: share of peak HBM bandwidth that streaming weights and KV reach"
    ),
    "fp8_flops": Constant(
        1.979e15, "FLOP/s", "NVIDIA H200 datasheet: 3,958 TFLOPS FP8 Tensor Core with sparsity, half dense"
    ),
    "bf16_flops": Constant(
        0.989e15, "FLOP/s", "NVIDIA H200 datasheet: 1,979 TFLOPS BF16 with sparsity, half dense"
    ),
    "gemm_efficiency": Constant(0.5, "fraction", "assumption: share of FP8 peak that large GEMMs reach"),
    "attention_efficiency": Constant(
        0.35, "fraction", "assumption: share of BF16 peak that sparse MLA and indexer kernels reach"
    ),
    "h2d_bytes_per_s": Constant(
        43.7e9,
        "B/s",
        "measured: scripts/gpu_check.py on one H200, 2026-12-04 (docs/gpu-check.md): 128 pages x 61 "
        "layers host->device in one launch of the page copy kernel, from pinned memory",
    ),
    "d2h_bytes_per_s": Constant(
        49.4e9,
        "B/s",
        "measured: scripts/gpu_check.py on one H200, 2026-12-04 (docs/gpu-check.md): 128 pages x 61 "
        "layers device->host in one launch of the page copy kernel, into pinned memory",
    ),
    "row_h2d_bytes_per_s": Constant(
        36.6e9,
        "B/s",
        "measured: scripts/gpu_check.py on one H200, 2026-12-04 (docs/gpu-check.md): the resolver's "
        "replay at batch 64 with 10% misses, 13,056 scattered 656-byte rows per layer",
    ),
    "resolver_plan_s": Constant(
        0.39e-3,
        "s",
        "measured: scripts/gpu_check.py on one H200, 2026-12-04 (docs/gpu-check.md): the fused plan "
        "for a batch-64 decode step (top-K 2048, hot buffer 4096), once per top-K selection "
        "(indexer layer) of a step with host pages; one call timed alone from an idle GPU, the "
        "host's launch work included, so at most what it costs the GPU in a running step",
    ),
    "resolver_replay_s": Constant(
        29e-6,
        "s",
        "measured: scripts/gpu_check.py on one H200, 2026-12-04 (docs/gpu-check.md): the resolver's "
        "replay of one layer at batch 64 with no misses (the miss rows are row_h2d_bytes_per_s's); "
        "one call timed alone, as resolver_plan_s",
    ),
    "allreduce_s": Constant(
        15e-6, "s", "assumption: one TP all-reduce of a step's hidden states over NVLink (latency-bound)"
    ),
    "nvlink_bytes_per_s": Constant(450e9, "B/s", "NVIDIA H200 datasheet: 900 GB/s NVLink, per direction"),
    "step_overhead_s": Constant(
        1.5e-3, "s", "assumption: sampling, the drafter's hand-off and kernel launches per step (CUDA graphs)"
    ),
    "mtp_acceptance": Constant(
        0.75, "probability", "assumption: a draft token is accepted, given the one before it was"
    ),
    "chunk_union_tokens": Constant(
        8,
        "tokens",
        "assumption: a prefill chunk's host selections are the union of this many tokens' "
        "top-K (its tokens mostly select the same rows; the CPU benchmark used 63-76% of the staging "
        "it leased for a worst case)",
    ),
    "hot_hit_rate": Constant(
        0.9, "fraction", "assumption: share of a decode step's selected host rows already in the hot buffer"
    ),
}


def load_constants(path: Path | None) -> dict[str, float]:
    """The constants' values, with those a JSON object `{name: value}` at `path` overrides."""
    values = {name: c.value for name, c in CONSTANTS.items()}
    if path is None:
        return values
    try:
        given = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as bad:
        raise ValueError(f"--constants {path}: not a readable JSON object ({bad})") from None
    if not isinstance(given, dict):
        raise ValueError(f"--constants {path}: expected a JSON object {{name: value}}")
    unknown = sorted(set(given) - set(values))
    if unknown:
        raise ValueError(f"--constants {path}: unknown constants {unknown}; known: {sorted(values)}")
    for name, value in given.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"--constants {path}: {name} must be a number >= 0, got {value!r}")
        values[name] = float(value)
    return values


def constants_table() -> list[tuple[str, float, str, str]]:
    return [(name, c.value, c.unit, c.source) for name, c in CONSTANTS.items()]


def sum_min(start: int, end: int, cap: int) -> int:
    """sum(min(p, cap) for p in range(start + 1, end + 1)): rows the tokens at positions
    start..end-1 attend to (each sees itself and everything before it, at most cap)."""
    if end <= start:
        return 0
    low, high = start + 1, end
    below = max(0, min(high, cap) - low + 1)  # positions <= cap count themselves
    total = 0
    if below:
        total += (low + low + below - 1) * below // 2
    total += max(0, high - max(low, cap + 1) + 1) * cap
    return total


@dataclass(frozen=True)
class ModelShape:
    """What the step model needs of the model and the node, per GPU."""

    num_layers: int
    num_indexer_layers: int
    drafter_layers: int
    num_speculative_tokens: int
    index_topk: int
    heads_per_gpu: float
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_heads: int
    index_head_dim: int
    hidden_size: int
    tensor_parallel_size: int
    # Bytes per GPU: weights outside the routed experts, and the routed experts.
    dense_weight_bytes: float
    expert_weight_bytes: float
    # Parameters per GPU a token multiplies outside the routed experts, and per routed expert.
    dense_active_params: float
    expert_params: float
    routed_experts: int
    experts_per_token: int
    sparse_row_bytes: int  # one token of one sparse-MLA layer, as the KV cache stores it
    indexer_row_bytes: int  # one token of one indexer layer

    @classmethod
    def from_config(cls, vllm_config: Any, weight_bytes: int | None) -> ModelShape:
        from vllm.v1.hisparse.capacity.planner import drafter_layer_count, layer_has_indexer

        hf = vllm_config.model_config.hf_text_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        h, heads = hf.hidden_size, hf.num_attention_heads
        qk_head = hf.qk_nope_head_dim + hf.qk_rope_head_dim
        layers = hf.num_hidden_layers
        moe_layers = sum(1 for i in range(layers) if _is_moe(hf, i))
        attention = (
            (h * (hf.q_lora_rank + hf.kv_lora_rank + hf.qk_rope_head_dim) if hf.q_lora_rank else 0)
            + (hf.q_lora_rank or h) * heads * qk_head / tp
            + hf.kv_lora_rank * heads * (hf.qk_nope_head_dim + hf.v_head_dim) / tp
            + heads * hf.v_head_dim * h / tp
        )
        expert = 3 * h * (hf.moe_intermediate_size if moe_layers else 0) / tp
        shared = (getattr(hf, "n_shared_experts", 0) or 0) * expert
        dense_mlp = 3 * h * hf.intermediate_size / tp
        dense_params = layers * attention + moe_layers * shared + (layers - moe_layers) * dense_mlp
        routed = int(getattr(hf, "n_routed_experts", 0) or 0)
        expert_total = moe_layers * routed * expert
        lm_head = hf.vocab_size * h / tp
        dense_params += lm_head
        bytes_per_param = 1.0  # FP8 linear layers
        if weight_bytes is not None and dense_params + expert_total > 0:
            bytes_per_param = weight_bytes / (dense_params + expert_total)
        cache_dtype = vllm_config.cache_config.cache_dtype
        sparse_row = (
            656
            if cache_dtype == "fp8_ds_mla"
            else ((hf.kv_lora_rank + hf.qk_rope_head_dim) * (1 if cache_dtype.startswith("fp8") else 2))
        )
        speculative = vllm_config.speculative_config
        return cls(
            num_layers=layers,
            num_indexer_layers=sum(layer_has_indexer(hf, i) for i in range(layers)),
            drafter_layers=drafter_layer_count(vllm_config),
            num_speculative_tokens=(speculative.num_speculative_tokens or 0) if speculative else 0,
            index_topk=int(hf.index_topk),
            heads_per_gpu=heads / tp,
            kv_lora_rank=hf.kv_lora_rank,
            qk_rope_head_dim=hf.qk_rope_head_dim,
            index_heads=int(hf.index_n_heads),
            index_head_dim=int(hf.index_head_dim),
            hidden_size=h,
            tensor_parallel_size=tp,
            dense_weight_bytes=dense_params * bytes_per_param,
            expert_weight_bytes=expert_total * bytes_per_param,
            dense_active_params=dense_params - lm_head,
            expert_params=moe_layers * expert,
            routed_experts=routed,
            experts_per_token=int(getattr(hf, "num_experts_per_tok", 0) or 0),
            sparse_row_bytes=sparse_row,
            indexer_row_bytes=hf.index_head_dim + hf.index_head_dim // 128 * 4,
        )


def _is_moe(hf: Any, layer: int) -> bool:
    from vllm.v1.hisparse.capacity.planner import _mlp_is_moe

    return _mlp_is_moe(hf, layer)


@dataclass
class ScheduledWork:
    """One request's part of a step: tokens at positions [start, end), rows it loads."""

    start: int
    end: int
    decode: bool
    host_rows_loaded: int = 0  # per sparse-MLA layer


class StepModel:
    """Seconds per step, from the scheduled work and the bytes crossing PCIe."""

    def __init__(self, shape: ModelShape, constants: dict[str, float]) -> None:
        self.shape = shape
        self.c = constants

    def compute_seconds(self, work: list[ScheduledWork]) -> float:
        """The forward (and drafter) of one step, without host transfers."""
        s, c = self.shape, self.c
        if not work:
            return 0.0
        hbm = c["hbm_bytes_per_s"] * c["hbm_efficiency"]
        gemm = c["fp8_flops"] * c["gemm_efficiency"]
        attn_rate = c["bf16_flops"] * c["attention_efficiency"]
        tokens = sum(w.end - w.start for w in work)
        # Linear layers: weights read (the experts this many tokens route to) vs FLOPs.
        touched = 1.0
        if s.routed_experts:
            touched = 1.0 - (1.0 - s.experts_per_token / s.routed_experts) ** tokens
        weight_bytes = s.dense_weight_bytes + s.expert_weight_bytes * touched
        active = s.dense_active_params + s.expert_params * s.experts_per_token
        linear = max(weight_bytes / hbm, 2.0 * active * tokens / gemm)
        # Sparse MLA and the indexer.
        rows = sum(sum_min(w.start, w.end, s.index_topk) for w in work)
        mla_flops = 2.0 * s.heads_per_gpu * rows * (2 * s.kv_lora_rank + s.qk_rope_head_dim) * s.num_layers
        mla_bytes = sum(min(w.end, s.index_topk * (w.end - w.start)) for w in work)
        mla_bytes = mla_bytes * s.sparse_row_bytes * s.num_layers
        attention = max(mla_flops / attn_rate, mla_bytes / hbm)
        scored = sum(sum_min(w.start, w.end, w.end) for w in work)  # every earlier key
        index_flops = 2.0 * scored * s.index_heads * s.index_head_dim * s.num_indexer_layers
        index_bytes = sum(w.end for w in work) * s.indexer_row_bytes * s.num_indexer_layers
        indexer = max(index_flops / gemm, index_bytes / hbm)
        # Two all-reduces per layer: latency plus the hidden states' ring traffic.
        ring = 2.0 * (s.tensor_parallel_size - 1) / s.tensor_parallel_size
        allreduce = (
            2
            * s.num_layers
            * (c["allreduce_s"] + tokens * s.hidden_size * 2 * ring / c["nvlink_bytes_per_s"])
            if s.tensor_parallel_size > 1
            else 0.0
        )
        forward = linear + attention + indexer + allreduce
        # The MTP drafter: its layers once per draft token, for the requests that decode.
        drafting = 0.0
        decoding = sum(1 for w in work if w.decode)
        if s.drafter_layers and s.num_speculative_tokens and decoding:
            drafting = forward / s.num_layers * s.drafter_layers * s.num_speculative_tokens
        return forward + drafting + c["step_overhead_s"]

    def resolver_seconds(self) -> float:
        """The resolver's own work in a step with host pages: a plan per top-K selection
        (indexer layer) and a replay per sparse-MLA layer, besides the rows it loads."""
        s, c = self.shape, self.c
        return s.num_indexer_layers * c["resolver_plan_s"] + s.num_layers * c["resolver_replay_s"]

    def host_rows_seconds(self, rows_per_layer: int) -> float:
        """The resolver's loads of host rows (every sparse-MLA layer), before attention."""
        if rows_per_layer <= 0:
            return 0.0
        row_bytes = rows_per_layer * self.shape.sparse_row_bytes * self.shape.num_layers
        return row_bytes / self.c["row_h2d_bytes_per_s"]

    def device_copy_seconds(self, nbytes: int) -> float:
        """Blocks copied on the device (vLLM's copy-on-write of a block a hit ends inside),
        read and written at HBM bandwidth, before the forward."""
        return 2 * nbytes / (self.c["hbm_bytes_per_s"] * self.c["hbm_efficiency"])

    def host_rows_bytes(self, rows_per_layer: int) -> int:
        return rows_per_layer * self.shape.sparse_row_bytes * self.shape.num_layers

    def accepted_tokens(self, drafts: int, draw: float) -> int:
        """Accepted drafts of a step from one uniform draw: the chance that at least n
        are accepted is acceptance^n."""
        p = self.c["mtp_acceptance"]
        if drafts <= 0 or p <= 0:
            return 0
        if p >= 1:
            return drafts
        accepted = math.floor(math.log(max(draw, 1e-12)) / math.log(p))
        return max(0, min(drafts, accepted))

    def miss_rows(
        self, topk_rows: int, host_fraction: float, chunk_tokens: int, decode: bool, host_rows: int
    ) -> int:
        """Rows per sparse-MLA layer a request loads from the host pool in one step."""
        if host_fraction <= 0 or host_rows <= 0:
            return 0
        if decode:
            # The step's tokens (the verified one and the drafts) select nearly the same rows.
            return min(host_rows, round(topk_rows * host_fraction * (1.0 - self.c["hot_hit_rate"])))
        # A prefill chunk stages the union of its tokens' host selections.
        distinct = min(chunk_tokens, self.c["chunk_union_tokens"])
        return min(host_rows, round(distinct * topk_rows * host_fraction))
