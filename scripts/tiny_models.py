# SPDX-License-Identifier: Apache-2.0
"""Tiny DSA (sparse-MLA) checkpoints for tests, the demo and the benchmark.

This module owns the *test model factory*: everything needed to put a small, complete,
Hugging Face-format checkpoint of a DeepSeek-Sparse-Attention model on disk.

- ``TinyModelSpec``: the sizes (and seed) of one tiny model, for two architectures:
  ``"glm5"`` (transformers ``glm_moe_dsa`` / ``GlmMoeDsaForCausalLM``) and ``"deepseek_v32"``
  (``deepseek_v32`` / ``DeepseekV32ForCausalLM``).
- The mapping from a spec to the transformers config, including the attributes vLLM reads
  (``index_topk``, ``topk_method``, ``scoring_func``, ``indexer_rope_interleave``, ...).
- Deterministic weight initialisation (every tensor is drawn from a generator seeded with
  ``(spec.seed, tensor name)``), so the same spec always gives byte-identical safetensors.
- A byte-level BPE tokenizer trained locally on a synthetic, seeded, English-like corpus, with
  the architecture's special tokens and a simplified chat template in that family's style.
- ``build_tiny_model`` (build into a folder), ``tiny_model_dir`` (build once into a cache
  folder named after the spec's hash, atomically) and a command line.

It never touches the network: no hub downloads, no ``from_pretrained`` of remote names, no
package or data fetches. Every byte it writes comes from the spec, this file and the
installed torch / transformers / tokenizers.

vLLM constraints the sizes must respect to *run* (not just configure) on vLLM's sparse-MLA
kernels are listed by ``vllm_kernel_issues``; the defaults satisfy them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

__all__ = [
    "ARCHS",
    "FORMAT_VERSION",
    "SPEC_FILE",
    "Arch",
    "ArchInfo",
    "TinyModelSpec",
    "build_config",
    "build_tiny_model",
    "build_tokenizer",
    "load_transformers_model",
    "main",
    "special_token_ids",
    "synthetic_corpus",
    "tiny_model_dir",
    "transformers_model_class",
    "vllm_kernel_issues",
]

# Bump whenever a change here alters the bytes written for an unchanged spec: the cache key
# includes it, so stale cache folders are never reused.
FORMAT_VERSION = 1

# Default std of normal(0, std) for every matrix, embedding and router weight.
DEFAULT_INIT_STD = 0.02
CORPUS_SEED = 20260101  # the tokenizer depends on (arch, vocab_size) only, not on spec.seed
SPEC_FILE = "tiny_model_spec.json"

Arch = Literal["glm5", "deepseek_v32"]
Dtype = Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class ArchInfo:
    """What differs between the two architectures: names, special tokens, chat template."""

    model_type: str
    architecture: str
    config_class: str
    # Special tokens in id order: ids 0, 1, 2 are always bos, eos, pad.
    bos_token: str
    eos_token: str
    pad_token: str
    extra_special_tokens: tuple[str, ...]
    # Tokens a plain ``tokenizer(text)`` prepends (the chat template writes them itself).
    prefix_tokens: tuple[str, ...]
    chat_template: str
    # Config attributes beyond the sizes; vLLM reads these.
    extra_config: tuple[tuple[str, Any], ...]

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return (self.bos_token, self.eos_token, self.pad_token, *self.extra_special_tokens)


_ROLE_CHECK = (
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif -%}"
)

# DeepSeek-V3.2 "chat" (non-thinking) layout. For system/user/assistant conversations that end
# with a user turn, this renders exactly what vLLM's deepseek_v32 tokenizer mode (which ignores
# Jinja and calls its own encoder) produces: bos, system text, <｜User｜>..., <｜Assistant｜></think>.
_DEEPSEEK_V32_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}" + _ROLE_CHECK + "{%- if message['role'] == 'system' -%}"
    "{{- message['content'] -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<｜User｜>' + message['content'] -}}"
    "{%- else -%}"
    "{{- '<｜Assistant｜></think>' + message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜></think>' -}}{%- endif -%}"
)

# GLM family layout (simplified: no tools, no thinking block): [gMASK]<sop><|role|>\ncontent...
_GLM5_TEMPLATE = (
    "{{- '[gMASK]<sop>' -}}"
    "{%- for message in messages -%}"
    + _ROLE_CHECK
    + "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

_MOE_ROUTING = (
    # Both transformers implementations route with sigmoid scores plus a per-expert correction
    # bias (DeepSeek's "noaux_tc"); vLLM defaults to softmax / no bias unless told.
    ("topk_method", "noaux_tc"),
    ("scoring_func", "sigmoid"),
    ("n_group", 1),
    ("topk_group", 1),
    ("norm_topk_prob", True),
    ("routed_scaling_factor", 2.5),
    ("tie_word_embeddings", False),
)

ARCHS: dict[str, ArchInfo] = {
    "glm5": ArchInfo(
        model_type="glm_moe_dsa",
        architecture="GlmMoeDsaForCausalLM",
        config_class="GlmMoeDsaConfig",
        bos_token="[gMASK]",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        extra_special_tokens=("<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"),
        prefix_tokens=("[gMASK]", "<sop>"),
        chat_template=_GLM5_TEMPLATE,
        # transformers' GlmMoeDsa indexer applies interleaved RoPE; vLLM only does when told.
        extra_config=(*_MOE_ROUTING, ("indexer_rope_interleave", True)),
    ),
    "deepseek_v32": ArchInfo(
        model_type="deepseek_v32",
        architecture="DeepseekV32ForCausalLM",
        config_class="DeepseekV32Config",
        bos_token="<｜begin▁of▁sentence｜>",
        eos_token="<｜end▁of▁sentence｜>",
        pad_token="<｜▁pad▁｜>",
        extra_special_tokens=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        prefix_tokens=("<｜begin▁of▁sentence｜>",),
        chat_template=_DEEPSEEK_V32_TEMPLATE,
        # DeepSeek-V3.2's indexer uses half-split (NeoX) RoPE: vLLM's default.
        extra_config=(*_MOE_ROUTING, ("indexer_rope_interleave", False)),
    ),
}

# Byte-level BPE starts from 256 byte tokens; leave room for the specials and some merges.
MIN_VOCAB_SIZE = 320
# The released models' index top-K (GLM-5.x, DeepSeek-V3.2), and positions enough for
# contexts well past it.
PRODUCTION_INDEX_TOPK = 2048
PRODUCTION_MAX_POSITIONS = 8192


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes and seed of one tiny DSA checkpoint.

    The defaults build a ~1.7M-parameter model in about a second. The attention sizes are the
    released models' where vLLM's kernels need them, so vLLM can also *run* the checkpoint:
    kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 (the only latent width vLLM's sparse-MLA
    backends accept) and index_head_dim = 128 (the indexer's fp8 key cache quantises in
    128-wide blocks; vLLM's fused indexer-q kernel is used only for exactly 128 with a 64-wide
    rope part). index_n_heads = 32 is GLM-5's value. index_topk = 128 (the released models use
    2048) means any prompt over 128 tokens already exercises sparse selection. Everything
    else is as small as it can be while staying non-trivial: layer 0 is dense and layer 1 MoE
    (``first_k_dense_replace=1``), 4 routed experts with 2 per token plus 1 shared expert.
    ``num_nextn_predict_layers`` adds the released models' multi-token-prediction (MTP) layers
    after the decoder layers, for vLLM's ``mtp`` speculative decoding (transformers ignores
    them). ``index_topk_freq`` > 1 shares indexers as GLM-5.x checkpoints do (IndexCache):
    only every ``index_topk_freq``-th layer from layer 1 on runs its own indexer, the others
    reuse the previous one's top-K (vLLM's ``index_topk_freq`` with its default offset 2,
    transformers' ``indexer_types``).
    """

    arch: Arch = "glm5"
    num_hidden_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    kv_lora_rank: int = 512
    q_lora_rank: int = 64
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 64
    v_head_dim: int = 64
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 128
    index_topk_freq: int = 1
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    intermediate_size: int = 256
    first_k_dense_replace: int = 1
    num_nextn_predict_layers: int = 0
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: Dtype = "bfloat16"
    # Larger values make activations and next-token distributions sharper, so a
    # wrong attention row changes the logits visibly (reference-agreement tests).
    init_std: float = DEFAULT_INIT_STD

    def __post_init__(self) -> None:
        problems = _spec_problems(self)
        if problems:
            raise ValueError("invalid TinyModelSpec: " + "; ".join(problems))

    @property
    def info(self) -> ArchInfo:
        return ARCHS[self.arch]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TinyModelSpec:
        return cls(**data)

    def cache_key(self) -> str:
        """Hex digest of the spec and FORMAT_VERSION: the name of this spec's cache folder."""
        payload = json.dumps({"format": FORMAT_VERSION, "spec": self.to_dict()}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


_INT_FIELDS = tuple(f.name for f in dataclasses.fields(TinyModelSpec) if f.type in ("int", int))


def _spec_problems(spec: TinyModelSpec) -> list[str]:
    """Constraints without which transformers or vLLM cannot even build the config/model."""
    if spec.arch not in ARCHS:
        return [f"arch must be one of {sorted(ARCHS)} (got {spec.arch!r})"]
    if spec.dtype not in get_args(Dtype):
        return [f"dtype must be one of {get_args(Dtype)} (got {spec.dtype!r})"]
    out: list[str] = []
    for name in _INT_FIELDS:
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool):
            out.append(f"{name} must be an int (got {value!r})")
        elif value < (0 if name in ("seed", "first_k_dense_replace", "num_nextn_predict_layers") else 1):
            out.append(f"{name} must be positive (got {value})")
    if out:
        return out
    if not spec.init_std > 0:
        out.append(f"init_std must be > 0 (got {spec.init_std})")
    if spec.qk_rope_head_dim % 2:
        out.append(f"qk_rope_head_dim must be even: RoPE rotates pairs (got {spec.qk_rope_head_dim})")
    if spec.index_head_dim < spec.qk_rope_head_dim:
        out.append(
            "index_head_dim must be >= qk_rope_head_dim: the indexer applies RoPE to the first "
            f"qk_rope_head_dim dims of each head (got {spec.index_head_dim} < {spec.qk_rope_head_dim})"
        )
    if spec.num_experts_per_tok > spec.n_routed_experts:
        out.append(
            f"num_experts_per_tok ({spec.num_experts_per_tok}) exceeds "
            f"n_routed_experts ({spec.n_routed_experts})"
        )
    if spec.n_routed_experts < 2:
        out.append("n_routed_experts must be >= 2: the grouped router takes the top 2 scores of each group")
    if spec.first_k_dense_replace > spec.num_hidden_layers:
        out.append(
            f"first_k_dense_replace ({spec.first_k_dense_replace}) exceeds num_hidden_layers "
            f"({spec.num_hidden_layers})"
        )
    n_special = len(ARCHS[spec.arch].special_tokens)
    if spec.vocab_size < MIN_VOCAB_SIZE:
        out.append(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 byte tokens + {n_special} specials + merges; "
            f"got {spec.vocab_size})"
        )
    if spec.index_topk > spec.max_position_embeddings:
        out.append(
            f"index_topk ({spec.index_topk}) exceeds max_position_embeddings ({spec.max_position_embeddings})"
        )
    if not spec.rope_theta > 0:
        out.append(f"rope_theta must be > 0 (got {spec.rope_theta})")
    return out


def vllm_kernel_issues(spec: TinyModelSpec) -> list[str]:
    """Reasons vLLM's GPU sparse-MLA path would refuse or mis-handle this spec (empty: none known).

    These are not needed to build the checkpoint, load it in transformers or create a vLLM
    ModelConfig; they matter when vLLM instantiates the attention backend and the indexer.
    """
    out: list[str] = []
    latent = spec.kv_lora_rank + spec.qk_rope_head_dim
    if (spec.kv_lora_rank, spec.qk_rope_head_dim) != (512, 64):
        out.append(
            "vLLM's MLA backends for DSA models (FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE, XPU_MLA_SPARSE; "
            "CPU_MLA and AMX_MLA too) only support a 576-wide latent: kv_lora_rank=512 + "
            f"qk_rope_head_dim=64 (got {latent})"
        )
    if spec.index_head_dim % 128:
        out.append(
            "the indexer's fp8 key cache quantises in 128-wide blocks (one scale per block): "
            f"index_head_dim must be a multiple of 128 (got {spec.index_head_dim})"
        )
    return out


# ----------------------------------------------------------------------------- config


def special_token_ids(spec: TinyModelSpec) -> dict[str, int]:
    """Ids of the special tokens: they come first in the vocabulary, in ArchInfo order."""
    return {token: i for i, token in enumerate(spec.info.special_tokens)}


def build_config(spec: TinyModelSpec) -> PretrainedConfig:
    """The transformers config for ``spec`` (with the extra attributes vLLM reads)."""
    import transformers

    info = spec.info
    config_cls = getattr(transformers, info.config_class)
    ids = special_token_ids(spec)
    config = config_cls(
        architectures=[info.architecture],
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_attention_heads,
        n_shared_experts=spec.n_shared_experts,
        n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        kv_lora_rank=spec.kv_lora_rank,
        q_lora_rank=spec.q_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        v_head_dim=spec.v_head_dim,
        index_topk=spec.index_topk,
        # Only when shared, so the checkpoints without sharing keep their config.json.
        **({"index_topk_freq": spec.index_topk_freq} if spec.index_topk_freq > 1 else {}),
        index_head_dim=spec.index_head_dim,
        index_n_heads=spec.index_n_heads,
        first_k_dense_replace=spec.first_k_dense_replace,
        num_nextn_predict_layers=spec.num_nextn_predict_layers,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(spec.rope_theta)},
        hidden_act="silu",
        initializer_range=spec.init_std,
        bos_token_id=ids[info.bos_token],
        eos_token_id=ids[info.eos_token],
        pad_token_id=ids[info.pad_token],
        dtype=spec.dtype,
        **dict(info.extra_config),
    )
    if config.model_type != info.model_type:  # pragma: no cover - a transformers rename
        raise RuntimeError(
            f"{info.config_class} has model_type {config.model_type!r}, not {info.model_type!r}"
        )
    return config


# ----------------------------------------------------------------------------- weights


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _seeded(shape: Sequence[int], seed: int, name: str, std: float):
    import torch

    gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
    return torch.empty(tuple(shape), dtype=torch.float32).normal_(0.0, std, generator=gen)


def _init_weights(model: PreTrainedModel, seed: int, std: float) -> None:
    """Deterministic, name-keyed init: ones for norm scales, zeros for biases, N(0, std) else.

    "Else" includes the router weights and the routing correction bias (``e_score_correction_bias``,
    a saved buffer), so expert choice depends on the seed too. Each tensor has its own generator,
    seeded from (seed, name): resizing one tensor leaves every other one unchanged.
    """
    import torch

    tensors = [*model.named_parameters(), *model.named_buffers()]
    persistent = set(model.state_dict())
    with torch.no_grad():
        for name, tensor in tensors:
            if name not in persistent:
                continue  # e.g. rotary inv_freq: computed from the config, never saved
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "weight" and ("norm" in name.rsplit(".", 2)[-2]):
                tensor.fill_(1.0)
            elif leaf == "bias":
                tensor.zero_()
            else:
                tensor.copy_(_seeded(tensor.shape, seed, name, std))


def transformers_model_class(architecture: str) -> type[PreTrainedModel]:
    """The transformers class named by a checkpoint's `architectures` entry.

    Not AutoModelForCausalLM: once vLLM has read a DeepSeek-V3.2 config in a
    process it registers its own DeepseekV3Config for model_type "deepseek_v32"
    with transformers' AutoConfig, after which the auto classes build a
    DeepseekV3ForCausalLM (no indexer) for these checkpoints.
    """
    import transformers

    return getattr(transformers, architecture)


def load_transformers_model(path: str | os.PathLike[str], **kwargs: Any) -> PreTrainedModel:
    """Load a checkpoint with the transformers class its config.json names."""
    config = json.loads((Path(path) / "config.json").read_text())
    return transformers_model_class(config["architectures"][0]).from_pretrained(path, **kwargs)


def _mtp_tensors(spec: TinyModelSpec, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The MTP layers' tensors, named as the released checkpoints name them.

    MTP layer i is ``model.layers.{num_hidden_layers + i}``: a decoder layer shaped like
    the last one (attention, indexer, MLP), plus ``enorm``/``hnorm`` (norms of the token
    embedding and of the previous hidden state), ``eh_proj`` (their concatenation back to
    the hidden size) and ``shared_head`` (final norm and vocabulary projection). Same
    name-keyed initialisation as every other tensor.
    """
    import torch

    dtype = getattr(torch, spec.dtype)
    last = f"model.layers.{spec.num_hidden_layers - 1}."
    h = spec.hidden_size
    out: dict[str, Any] = {}
    for i in range(spec.num_nextn_predict_layers):
        prefix = f"model.layers.{spec.num_hidden_layers + i}."
        shapes = {prefix + name[len(last) :]: t for name, t in state_dict.items() if name.startswith(last)}
        shapes.update(
            {
                prefix + "enorm.weight": torch.empty(h),
                prefix + "hnorm.weight": torch.empty(h),
                prefix + "eh_proj.weight": torch.empty(h, 2 * h),
                prefix + "shared_head.norm.weight": torch.empty(h),
                prefix + "shared_head.head.weight": torch.empty(spec.vocab_size, h),
            }
        )
        for name, like in shapes.items():
            leaf_module = name.rsplit(".", 2)[-2]
            if name.endswith(".weight") and "norm" in leaf_module:
                value = torch.ones(like.shape)
            elif name.endswith(".bias"):
                value = torch.zeros(like.shape)
            else:
                value = _seeded(like.shape, spec.seed, name, spec.init_std)
            keep_fp32 = name.endswith("e_score_correction_bias")
            out[name] = value.to(torch.float32 if keep_fp32 else dtype).contiguous()
    return out


def _build_model(spec: TinyModelSpec, config: PretrainedConfig) -> PreTrainedModel:
    import torch

    torch.manual_seed(spec.seed)
    model = transformers_model_class(spec.info.architecture)._from_config(config, dtype=torch.float32)
    _init_weights(model, spec.seed, spec.init_std)
    model.to(getattr(torch, spec.dtype))
    # Like the released checkpoints, keep the routing correction bias in fp32: in bf16 the
    # small per-expert offsets would be rounded away.
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.data = buffer.data.float()
    model.eval()
    return model


# ----------------------------------------------------------------------------- tokenizer

_ONSETS = (
    "b c d f g h j k l m n p r s t v w y z bl br ch cl cr dr fl fr gl gr pl pr sc sh sk sl sp st th tr"
).split()
_VOWELS = "a e i o u a e i o ai ea ee ie oa ou".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt"]
_FUNCTION_WORDS = (
    "the a an and or but of to in on at for with from by is are was were be been it this that these "
    "you I we they he she what how why when where which who can could would should will do does not "
    "yes no please thanks hello some any all more most very just about into over than then so if"
).split()
_CHAT_OPENERS = ("Can you", "Could you", "Please", "How do I", "What is", "Why does", "Tell me about")
_ROLES = ("system", "user", "assistant")


def _make_word(rng: random.Random) -> str:
    n_syllables = rng.choice((1, 1, 2, 2, 3))
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n_syllables))


def _sentence(rng: random.Random, lexicon: Sequence[str], cum_weights: Sequence[float]) -> str:
    words = []
    for _ in range(rng.randint(3, 14)):
        if rng.random() < 0.35:
            words.append(rng.choice(_FUNCTION_WORDS))
        elif rng.random() < 0.04:
            words.append(str(rng.randint(0, 2048)))
        else:
            words.append(rng.choices(lexicon, cum_weights=cum_weights)[0])
    if len(words) > 3 and rng.random() < 0.2:
        i = rng.randrange(1, len(words) - 1)
        words[i] += rng.choice((",", ",", ";", ":"))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "!", "?"))


def synthetic_corpus(n_lines: int, seed: int = CORPUS_SEED) -> list[str]:
    """Deterministic English-like text: invented words (Zipf-weighted), function words, digits,
    punctuation, and chat-ish exchanges (role prefixes, questions, multi-line answers)."""
    rng = random.Random(seed)
    lexicon = sorted({_make_word(rng) for _ in range(max(1500, n_lines // 2))})
    rng.shuffle(lexicon)
    weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))
    lines: list[str] = []
    while len(lines) < n_lines:
        kind = rng.random()
        if kind < 0.6:
            lines.append(" ".join(_sentence(rng, lexicon, weights) for _ in range(rng.randint(1, 3))))
        elif kind < 0.85:
            question = f"{rng.choice(_CHAT_OPENERS)} {_sentence(rng, lexicon, weights)[:-1].lower()}?"
            answer = "\n".join(_sentence(rng, lexicon, weights) for _ in range(rng.randint(1, 3)))
            lines.append(f"user: {question}\nassistant: {answer}")
        else:
            first, second = _sentence(rng, lexicon, weights), _sentence(rng, lexicon, weights)
            lines.append(f"{rng.choice(_ROLES)}: {first}\n\n  - {second}")
    return lines


def build_tokenizer(spec: TinyModelSpec) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with exactly ``spec.vocab_size`` tokens, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    info = spec.info
    specials = list(info.special_tokens)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(max(2000, 8 * spec.vocab_size)), trainer=trainer)
    # A vocabulary larger than the corpus supports is topped up with reserved tokens.
    missing = spec.vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size(with_added_tokens=True) != spec.vocab_size:  # pragma: no cover
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {spec.vocab_size}")
    ids = special_token_ids(spec)
    for token, expected in ids.items():
        if tok.token_to_id(token) != expected:  # pragma: no cover - a tokenizers behaviour change
            raise RuntimeError(f"special token {token!r} has id {tok.token_to_id(token)}, not {expected}")
    prefix = " ".join(info.prefix_tokens)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{prefix} $A",
        pair=f"{prefix} $A $B",
        special_tokens=[(t, ids[t]) for t in info.prefix_tokens],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=info.bos_token,
        eos_token=info.eos_token,
        pad_token=info.pad_token,
        extra_special_tokens=list(info.extra_special_tokens),
        clean_up_tokenization_spaces=False,
        model_max_length=spec.max_position_embeddings,
    )
    tokenizer.chat_template = info.chat_template
    return tokenizer


# ----------------------------------------------------------------------------- build / cache


def build_tiny_model(spec: TinyModelSpec, out_dir: str | os.PathLike[str]) -> Path:
    """Write a complete checkpoint for ``spec`` into ``out_dir`` (absent or empty) and return it.

    Contents: config.json, generation_config.json, model.safetensors, the tokenizer files
    (tokenizer.json, tokenizer_config.json, chat_template.jinja) and tiny_model_spec.json.
    The same spec always yields identical files.
    """
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder")
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(spec)
    config = build_config(spec)
    model = _build_model(spec, config)
    if (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) != (
        config.bos_token_id,
        config.eos_token_id,
        config.pad_token_id,
    ):  # pragma: no cover - guarded by special_token_ids
        raise RuntimeError("tokenizer and config disagree on bos/eos/pad ids")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    progress_bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" bars on every build: noise in tests
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if progress_bars:
            hf_logging.enable_progress_bar()
    if spec.num_nextn_predict_layers:
        _add_mtp_layers(spec, out / "model.safetensors")
    tokenizer.save_pretrained(out)
    (out / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=2, sort_keys=True) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)  # transformers writes the weights 0600 (via a temporary file)
    return out


def _add_mtp_layers(spec: TinyModelSpec, weights: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(weights), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(weights))
    tensors.update(_mtp_tensors(spec, tensors))
    save_file(tensors, str(weights), metadata=metadata)


# GLM-5.3 in miniature: its indexer sharing (one indexer per four layers from layer 1,
# vLLM's default offset 2: layers 0, 1 and 5 of six run one), an MTP layer and 1,048,576
# positions; everything else scaled down (six layers, top-K 32).
TINY_GLM53 = TinyModelSpec(
    arch="glm5",
    num_hidden_layers=6,
    index_topk=32,
    index_topk_freq=4,
    num_nextn_predict_layers=1,
    max_position_embeddings=1 << 20,
    init_std=0.2,
)


def production_topk(spec: TinyModelSpec) -> TinyModelSpec:
    """`spec` with the released models' index top-K (2048) and room for contexts past it."""
    return dataclasses.replace(
        spec,
        index_topk=PRODUCTION_INDEX_TOPK,
        max_position_embeddings=max(spec.max_position_embeddings, PRODUCTION_MAX_POSITIONS),
    )


def tiny_model_dir(spec: TinyModelSpec, cache_root: str | os.PathLike[str]) -> Path:
    """The cached checkpoint for ``spec`` under ``cache_root``, building it on first use.

    The folder is ``<arch>-<first 16 hex digits of spec.cache_key()>``; it is built in a
    temporary sibling and renamed into place, so a folder that exists is always complete, and
    concurrent builders of the same spec agree on the result.
    """
    root = Path(cache_root)
    final = root / f"{spec.arch}-{spec.cache_key()[:16]}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        build_tiny_model(spec, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # a concurrent builder did not win the race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- command line

_CLI_FLAGS: dict[str, str] = {
    "layers": "num_hidden_layers",
    "hidden-size": "hidden_size",
    "heads": "num_attention_heads",
    "kv-lora-rank": "kv_lora_rank",
    "q-lora-rank": "q_lora_rank",
    "qk-rope-head-dim": "qk_rope_head_dim",
    "qk-nope-head-dim": "qk_nope_head_dim",
    "v-head-dim": "v_head_dim",
    "index-n-heads": "index_n_heads",
    "index-head-dim": "index_head_dim",
    "index-topk": "index_topk",
    "index-topk-freq": "index_topk_freq",
    "experts": "n_routed_experts",
    "experts-per-tok": "num_experts_per_tok",
    "shared-experts": "n_shared_experts",
    "moe-intermediate-size": "moe_intermediate_size",
    "intermediate-size": "intermediate_size",
    "first-k-dense": "first_k_dense_replace",
    "mtp-layers": "num_nextn_predict_layers",
    "vocab-size": "vocab_size",
    "max-position-embeddings": "max_position_embeddings",
    "rope-theta": "rope_theta",
    "seed": "seed",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiny_models.py",
        description="Build a tiny random-weight DSA checkpoint (no network) and print its path.",
    )
    parser.add_argument("arch", choices=sorted(ARCHS))
    parser.add_argument("out_dir", type=Path, help="folder to create (must be absent or empty)")
    defaults = TinyModelSpec()
    for flag, field in _CLI_FLAGS.items():
        default = getattr(defaults, field)
        parser.add_argument(
            f"--{flag}", dest=field, type=type(default), default=default, help=f"default: {default}"
        )
    parser.add_argument("--dtype", choices=get_args(Dtype), default=defaults.dtype)
    parser.add_argument(
        "--production-topk",
        action="store_true",
        help=f"the released models' index top-K ({PRODUCTION_INDEX_TOPK}) and at least "
        f"{PRODUCTION_MAX_POSITIONS} positions (overrides --index-topk)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    fields = [f.name for f in dataclasses.fields(TinyModelSpec)]
    values = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    try:
        spec = TinyModelSpec(**values)
        if args.production_topk:
            spec = production_topk(spec)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for issue in vllm_kernel_issues(spec):
        print(f"warning: vLLM could configure but not run this model on GPU: {issue}", file=sys.stderr)
    try:
        path = build_tiny_model(spec, args.out_dir)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
