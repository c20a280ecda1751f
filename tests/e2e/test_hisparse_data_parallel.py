# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse with data parallelism: `vllm serve --data-parallel-size 2` on CPU.

Each data-parallel engine is an engine of its own, with its own scheduler, KV
pool and host pool of the whole host_pool_gib. Eight concurrent requests, more
KV than either engine's small pool holds, spread over both: each engine must
report a pool of the configured size, pages must leave the device, every request
must come back whole, and no host pool name may be left in /dev/shm.

The model's layers are all dense here: vLLM 0.29.0's CPU communicator has no
all_gatherv, which data-parallel MoE layers need to dispatch their router
logits (the first MoE forward raises NotImplementedError), so the CPU test bed
cannot run data parallelism for the MoE layers of GLM-5 or DeepSeek-V3.2.
Residency and the host pool do not depend on what the MLP is.
"""

from __future__ import annotations

import dataclasses
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine import SPARSE_GLM5, model_dir
from serving import VllmServer, metric

pytestmark = [pytest.mark.slow_test, pytest.mark.distributed, pytest.mark.machine_wide]

DENSE_GLM5 = dataclasses.replace(SPARSE_GLM5, first_k_dense_replace=SPARSE_GLM5.num_hidden_layers)
BLOCK_SIZE = 64
KV_BLOCKS = 60  # per engine: 30 pages of sparse-MLA and indexer blocks, short of four requests
OUTPUT_TOKENS = 32
LENGTHS = tuple(500 + 60 * i for i in range(8))
HOST_POOL_PAGES = 400


def host_pool_gib(pages: int) -> float:
    """A pool of `pages` pages (plus half a page for rounding) of the tiny model's float32 rows."""
    row_bytes = (DENSE_GLM5.kv_lora_rank + DENSE_GLM5.qk_rope_head_dim) * 4
    return (pages + 0.5) * DENSE_GLM5.num_hidden_layers * BLOCK_SIZE * row_bytes / (1 << 30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = [
        "--data-parallel-size", "2",
        "--max-model-len", "1024",
        "--max-num-batched-tokens", "256",
        "--num-gpu-blocks-override", str(KV_BLOCKS),
        "--kv-cache-memory-bytes", str(256 << 20),
        "--enforce-eager", "--seed", "0", "--dtype", "float32",
        "--attention-config",
        json.dumps({"hisparse_config": {"host_pool_gib": host_pool_gib(HOST_POOL_PAGES)}}),
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("serve-dp") / "serve.log"
    server = VllmServer(model_dir(DENSE_GLM5), "tiny-glm5-dp", args, log)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core for each engine's worker
        server.start()
    try:
        yield server
    finally:
        server.stop()


def test_each_data_parallel_engine_demotes_into_a_pool_of_its_own_and_loses_no_request(server):
    rng = random.Random(21)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in LENGTHS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: server.complete(p, OUTPUT_TOKENS), prompts))
    for out in outs:
        choice = out["choices"][0]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == OUTPUT_TOKENS, out
    text = server.metrics()
    for engine in ("0", "1"):
        pools = [
            float(line.rpartition(" ")[2]) for line in text.splitlines()
            if line.startswith("vllm:hisparse_host_pool_pages{") and f'engine="{engine}"' in line
        ]  # fmt: skip
        assert max(pools) == HOST_POOL_PAGES, f"engine {engine}: pool of {pools} pages"
        served = metric(text, "vllm:request_success_total", engine=engine)
        assert served > 0, f"engine {engine} served nothing"
    assert metric(text, "vllm:hisparse_pages_demoted_total") > 0, "pages left the device under pressure"
    assert not list(Path("/dev/shm").glob("vllm_hisparse_*"))
