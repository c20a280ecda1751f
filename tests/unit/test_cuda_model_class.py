# SPDX-License-Identifier: Apache-2.0
"""The CUDA DSA model class reaches the resolver: a static check of upstream's call sites.

On CUDA, `GlmMoeDsaForCausalLM` and `DeepseekV32ForCausalLM` are served by
`vllm.models.deepseek_v32.nvidia` (its decoder layer, and its MTP drafter, which stacks
the same decoder layer), whose attention is `vllm.models.deepseek_v32.attention.
DeepseekV32Attention`. It reaches HiSparse's resolver only through the backend impl's
`forward_mqa`, which patch 0011 decorates for every resolving backend; its other prefill
path, `_use_sparse_mha` -> `forward_impl`, reads whole contexts through the block table
and must never run with HiSparse on (`sparse_mla_force_mqa`). The CPU test bed serves the
same architectures with `deepseek_v2.py`, so these call sites never run here: the checks
read the installed sources (the GPU is the seam), and fail if upstream moves them.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest


def source(module: str) -> ast.Module:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is not in this vLLM"
    return ast.parse(Path(spec.origin).read_text())


def class_def(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} moved"
    return found[0]


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{cls.name}.{name} moved"
    return found[0]


def calls(node: ast.AST) -> list[str]:
    """Dotted names of every call in `node` (`self.impl.forward_mqa`, ...)."""
    out = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            out.append(ast.unparse(call.func))
    return out


def test_on_cuda_glm5_and_deepseek_v32_are_served_by_the_nvidia_module():
    package = (Path(importlib.util.find_spec("vllm.models.deepseek_v32").origin)).read_text()
    assert "from .nvidia.model import DeepseekV32ForCausalLM as GlmMoeDsaForCausalLM" in package
    assert "from .nvidia.mtp import DeepseekV32MTP" in package


def test_the_cuda_decoder_layer_and_its_mtp_drafter_attend_through_deepseek_v32_attention():
    model = source("vllm.models.deepseek_v32.nvidia.model")
    layer = class_def(model, "DeepseekV32DecoderLayer")
    assert "DeepseekV32Attention" in calls(method(layer, "__init__"))
    mtp = source("vllm.models.deepseek_v32.nvidia.mtp")
    drafter = class_def(mtp, "DeepseekV32MultiTokenPredictorLayer")
    stacked = calls(method(drafter, "__init__"))
    assert "DeepseekV32DecoderLayer" in stacked, "the drafter stacks the same decoder layer"


def test_deepseek_v32_attention_reaches_the_resolver_only_through_forward_mqa():
    attention = class_def(source("vllm.models.deepseek_v32.attention"), "DeepseekV32Attention")
    reads = [c for node in attention.body if isinstance(node, ast.FunctionDef) for c in calls(node)]
    assert "self.impl.forward_mqa" in reads, "the top-K path patch 0011 decorates"
    # Its one other way to attend is the MHA prefill, gated by _use_sparse_mha.
    mha = [
        node
        for node in ast.walk(attention)
        if isinstance(node, ast.If) and "self._use_sparse_mha" in calls(node.test)
    ]
    assert mha
    for node in mha:
        assert "self.forward_impl" in calls(ast.Module(body=node.body, type_ignores=[]))
    assert reads.count("self.forward_impl") == len(mha), "forward_impl runs only behind _use_sparse_mha"


@pytest.mark.parametrize("dense", [True, False])
def test_with_hisparse_on_the_mha_prefill_never_runs(tiny_glm_dsa_dir, dense):
    # The upstream method itself, on a CUDA configuration HiSparse has routed.
    from vllm.config.hisparse import route_sparse_mla_through_the_resolver
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    config = EngineArgs(
        model=str(tiny_glm_dsa_dir),
        skip_tokenizer_init=True,
        attention_config={"hisparse_config": {"host_pool_gib": 1}},
    ).create_engine_config()
    layer = SimpleNamespace(prefill_backend=None, _vllm_config=config)
    metadata = SimpleNamespace(prefill=SimpleNamespace(use_dense_mha=dense))
    config.attention_config.sparse_mla_force_mqa = False
    assert MLAAttention._use_sparse_mha(layer, metadata) is dense, "upstream takes it when dense"
    route_sparse_mla_through_the_resolver(config)
    assert MLAAttention._use_sparse_mha(layer, metadata) is False
