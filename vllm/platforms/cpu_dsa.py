# SPDX-License-Identifier: Apache-2.0
"""CPU platform policy for DeepSeek Sparse Attention (DSA) models.

Owns the decisions vLLM's CPU platform makes differently for sparse-MLA
models: which attention backend serves them and which page geometry they use.
Upstream 0.29.0 refuses sparse attention on CPU and forces MLA models onto its
dense reference path (16-token blocks, no chunked prefill, no prefix caching);
DSA models instead get the plain-torch DSA backends with the 64-token pages of
the CUDA sparse-MLA backends, and keep chunked prefill and prefix caching.
Imports nothing heavy: the platform module imports it at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

logger = init_logger(__name__)

CPU_SPARSE_MLA_BACKEND = "vllm.v1.attention.backends.mla.cpu_dsa.CPUSparseMLABackend"
# Must equal cpu_dsa.DSA_BLOCK_SIZE; kept here so the platform imports no backend.
DSA_BLOCK_SIZE = 64


def is_dsa_model(model_config: ModelConfig | None) -> bool:
    """True for MLA models with a DSA indexer (DeepSeek-V3.2, GLM-5)."""
    if model_config is None or not getattr(model_config, "use_mla", False):
        return False
    return getattr(model_config.hf_text_config, "index_topk", None) is not None


def configure_dsa_cache(vllm_config: VllmConfig) -> None:
    """Give DSA models the sparse-MLA page size (64 tokens per block)."""
    if not is_dsa_model(vllm_config.model_config):
        return
    cache_config = vllm_config.cache_config
    if cache_config.user_specified_block_size and cache_config.block_size != DSA_BLOCK_SIZE:
        logger.warning(
            "DSA models on CPU use %d-token blocks (the sparse-MLA page size); overriding block_size=%d.",
            DSA_BLOCK_SIZE,
            cache_config.block_size,
        )
    cache_config.block_size = DSA_BLOCK_SIZE
