# SPDX-License-Identifier: Apache-2.0
"""scripts/tiny_models.py: tiny GLM-5 / DeepSeek-V3.2 checkpoints built locally, deterministically."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models as tm
from hypothesis import assume, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
ARCHS = sorted(tm.ARCHS)
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Hi, who are you?"},
    {"role": "assistant", "content": "A tiny model."},
    {"role": "user", "content": "Tell me about the weather, please."},
]


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-model-cache")


@pytest.fixture(scope="session", params=ARCHS)
def built(request, tiny_cache) -> tuple[tm.TinyModelSpec, Path]:
    spec = tm.TinyModelSpec(arch=request.param)
    return spec, tm.tiny_model_dir(spec, tiny_cache)


@pytest.fixture(scope="session")
def tokenizers_by_arch() -> dict[str, object]:
    return {arch: tm.build_tokenizer(tm.TinyModelSpec(arch=arch)) for arch in ARCHS}


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# ----------------------------------------------------------------------------- the spec


@pytest.mark.parametrize("arch", ARCHS)
def test_default_spec_is_small_and_fits_vllm_kernels(arch):
    spec = tm.TinyModelSpec(arch=arch)
    assert spec.dtype == "bfloat16" and spec.seed == 0
    assert spec.num_hidden_layers == 2 and spec.first_k_dense_replace == 1  # one dense, one MoE layer
    assert spec.kv_lora_rank + spec.qk_rope_head_dim == 576
    assert spec.index_head_dim % 128 == 0 and spec.index_head_dim >= spec.qk_rope_head_dim
    assert tm.vllm_kernel_issues(spec) == []


def test_spec_is_frozen_and_hashes_by_value():
    spec = tm.TinyModelSpec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.seed = 3  # type: ignore[misc]
    assert spec == tm.TinyModelSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert spec.cache_key() == tm.TinyModelSpec().cache_key()
    assert spec.cache_key() != dataclasses.replace(spec, seed=1).cache_key()
    assert spec.cache_key() != dataclasses.replace(spec, arch="deepseek_v32").cache_key()


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"arch": "llama"}, "arch must be one of"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be positive"),
        ({"hidden_size": 12.5}, "hidden_size must be an int"),
        ({"qk_rope_head_dim": 33, "index_head_dim": 128}, "qk_rope_head_dim must be even"),
        ({"index_head_dim": 32}, "index_head_dim must be >= qk_rope_head_dim"),
        ({"num_experts_per_tok": 5}, "exceeds n_routed_experts"),
        ({"first_k_dense_replace": 3}, "first_k_dense_replace (3) exceeds num_hidden_layers"),
        ({"vocab_size": 300}, "vocab_size must be >= 320"),
        ({"index_topk": 8192}, "index_topk (8192) exceeds max_position_embeddings"),
    ],
)
def test_spec_rejects_bad_sizes_naming_the_field(changes, named):
    with pytest.raises(ValueError, match="invalid TinyModelSpec") as exc:
        tm.TinyModelSpec(**changes)
    assert named in str(exc.value)


def test_kernel_issues_name_the_constraint():
    spec = tm.TinyModelSpec(kv_lora_rank=64, qk_rope_head_dim=32, index_head_dim=64)
    issues = tm.vllm_kernel_issues(spec)
    assert len(issues) == 2
    assert "576" in issues[0] and "got 96" in issues[0]
    assert "multiple of 128" in issues[1]


# ----------------------------------------------------------------------------- the checkpoint


def test_checkpoint_files_and_config(built):
    spec, path = built
    assert sorted(p.name for p in path.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tiny_model_spec.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((path / "config.json").read_text())
    info = tm.ARCHS[spec.arch]
    assert config["model_type"] == info.model_type
    assert config["architectures"] == [info.architecture]
    assert config["dtype"] == "bfloat16"
    assert config["mlp_layer_types"] == ["dense", "sparse"]
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    for field in ("index_topk", "index_n_heads", "index_head_dim", "kv_lora_rank", "vocab_size"):
        assert config[field] == getattr(spec, field)
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert config["indexer_rope_interleave"] is (spec.arch == "glm5")
    generation = json.loads((path / "generation_config.json").read_text())
    assert {k: generation[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")} == {
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    assert not any(k in generation for k in ("do_sample", "temperature", "top_p", "top_k"))
    assert tm.TinyModelSpec.from_dict(json.loads((path / tm.SPEC_FILE).read_text())) == spec


def test_mtp_layers_follow_the_decoder_layers_and_leave_them_unchanged(tiny_cache):
    from safetensors.torch import load_file

    plain = tm.TinyModelSpec()
    mtp = dataclasses.replace(plain, num_nextn_predict_layers=1)
    without = load_file(tm.tiny_model_dir(plain, tiny_cache) / "model.safetensors")
    path = tm.tiny_model_dir(mtp, tiny_cache)
    with_mtp = load_file(path / "model.safetensors")
    assert json.loads((path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    n = plain.num_hidden_layers
    added = sorted(set(with_mtp) - set(without))
    assert all(name.startswith(f"model.layers.{n}.") for name in added)
    for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head"):
        assert f"model.layers.{n}.{part}.weight" in added
    # A decoder layer shaped like the last one: attention, indexer and MoE MLP.
    prefix = f"model.layers.{n - 1}."
    last = {name[len(prefix) :]: t.shape for name, t in without.items() if name.startswith(prefix)}
    assert {name: with_mtp[f"model.layers.{n}.{name}"].shape for name in last} == last
    assert with_mtp[f"model.layers.{n}.eh_proj.weight"].shape == (plain.hidden_size, 2 * plain.hidden_size)
    assert with_mtp[f"model.layers.{n}.mlp.gate.e_score_correction_bias"].dtype.is_floating_point
    assert all(without[name].equal(with_mtp[name]) for name in without), "target weights unchanged"
    # Seeded by name: the MTP layer's attention is not a copy of the last layer's.
    name = "self_attn.kv_a_proj_with_mqa.weight"
    assert not with_mtp[f"model.layers.{n}.{name}"].equal(without[f"model.layers.{n - 1}.{name}"])


def test_tokenizer_and_config_agree_on_special_ids(built):
    from transformers import AutoConfig, AutoTokenizer

    spec, path = built
    config = AutoConfig.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config.vocab_size == spec.vocab_size
    assert tokenizer.eos_token_id == config.eos_token_id == 1
    assert tokenizer.bos_token_id == config.bos_token_id == 0
    assert tokenizer.pad_token_id == config.pad_token_id == 2
    assert max(tokenizer.all_special_ids) < config.vocab_size


def test_weights_are_seeded_not_degenerate(built):
    import torch
    from safetensors.torch import load_file

    spec, path = built
    tensors = load_file(path / "model.safetensors")
    experts = {k for k in tensors if ".mlp.experts." in k}
    # vLLM's loader wants one tensor per expert and projection, only on the MoE layer.
    assert len(experts) == 3 * spec.n_routed_experts
    assert all(k.startswith("model.layers.1.") for k in experts)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in tensors
    for name, tensor in tensors.items():
        assert torch.isfinite(tensor.float()).all(), name
        if name.endswith("e_score_correction_bias"):
            assert tensor.dtype == torch.float32 and tensor.std() > 0
            continue
        assert tensor.dtype == torch.bfloat16, name
        if name.endswith(".bias"):
            assert (tensor == 0).all(), name
        elif "norm" in name:
            assert (tensor == 1).all(), name
        else:
            std = tensor.float().std().item()
            assert 0.015 < std < 0.025, (name, std)


@pytest.mark.parametrize("arch", ARCHS)
def test_same_spec_same_bytes_other_seed_other_weights(arch, tmp_path):
    spec = tm.TinyModelSpec(arch=arch, num_hidden_layers=2, vocab_size=384)
    first = _files(tm.build_tiny_model(spec, tmp_path / "a"))
    second = _files(tm.build_tiny_model(spec, tmp_path / "b"))
    assert first == second
    reseeded = _files(tm.build_tiny_model(dataclasses.replace(spec, seed=1), tmp_path / "c"))
    assert reseeded["model.safetensors"] != first["model.safetensors"]
    # The tokenizer depends on (arch, vocab_size) only, so reseeded models share it.
    assert reseeded["tokenizer.json"] == first["tokenizer.json"]


def test_build_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "stale.safetensors").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        tm.build_tiny_model(tm.TinyModelSpec(), tmp_path)


def test_cache_builds_once_atomically(tmp_path, monkeypatch):
    spec = tm.TinyModelSpec(arch="deepseek_v32", vocab_size=384, seed=7)
    path = tm.tiny_model_dir(spec, tmp_path)
    assert path.parent == tmp_path and path.name == f"deepseek_v32-{spec.cache_key()[:16]}"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary folder left behind
    assert oct(path.stat().st_mode & 0o777) == oct(0o755)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a cached spec was rebuilt")

    monkeypatch.setattr(tm, "build_tiny_model", no_rebuild)
    assert tm.tiny_model_dir(spec, tmp_path) == path
    with pytest.raises(AssertionError, match="rebuilt"):
        tm.tiny_model_dir(dataclasses.replace(spec, seed=8), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the failed build left nothing


# ----------------------------------------------------------------------------- transformers


def test_transformers_loads_and_runs_a_chat_prompt(built):
    import torch
    from transformers import AutoTokenizer

    spec, path = built
    model = tm.load_transformers_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == tm.ARCHS[spec.arch].architecture
    assert model.dtype == torch.bfloat16
    inputs = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    input_ids = inputs["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], spec.vocab_size)
    assert torch.isfinite(logits.float()).all()
    assert logits.float().std() > 0.01  # random weights, not a constant output


def test_other_sizes_build_for_transformers(tmp_path):
    """The brief's smaller head sizes work in transformers; vllm_kernel_issues flags them for vLLM."""
    import torch

    spec = tm.TinyModelSpec(
        arch="glm5",
        num_hidden_layers=3,
        kv_lora_rank=64,
        qk_rope_head_dim=32,
        index_head_dim=64,
        index_n_heads=4,
        index_topk=8,
        vocab_size=400,
    )
    model = tm.load_transformers_model(tm.build_tiny_model(spec, tmp_path / "m"))
    assert model.config.mlp_layer_types == ["dense", "sparse", "sparse"]
    with torch.no_grad():
        logits = model(input_ids=torch.arange(3, 40)[None]).logits  # longer than index_topk
    assert logits.shape == (1, 37, 400) and torch.isfinite(logits.float()).all()
    assert tm.vllm_kernel_issues(spec)


# ----------------------------------------------------------------------------- the tokenizer


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_shape_and_specials(arch, tokenizers_by_arch):
    tokenizer = tokenizers_by_arch[arch]
    info = tm.ARCHS[arch]
    assert len(tokenizer) == tm.TinyModelSpec(arch=arch).vocab_size
    for token_id, token in enumerate(info.special_tokens):
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [token_id]
    prefix = [tokenizer.convert_tokens_to_ids(t) for t in info.prefix_tokens]
    assert tokenizer("hello")["input_ids"][: len(prefix)] == prefix
    # Byte-level BPE learned real merges: common words are a few tokens, not one per byte.
    assert len(tokenizer("the user and the assistant", add_special_tokens=False)["input_ids"]) < 12


@pytest.mark.parametrize(
    "text",
    ["Hello world.", "  leading spaces\n\ttabs and\r\nnewlines  ", "Ünïcødé ✓ 数字 123,456.78 🙂", ""],
)
@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips(arch, text, tokenizers_by_arch):
    tokenizer = tokenizers_by_arch[arch]
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=80))
def test_tokenizer_round_trips_any_text(text, tokenizers_by_arch):
    for arch, tokenizer in tokenizers_by_arch.items():
        assume(not any(token in text for token in tm.ARCHS[arch].special_tokens))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert all(0 <= i < len(tokenizer) for i in ids)
        assert tokenizer.decode(ids) == text


def test_synthetic_corpus_is_deterministic_and_chatty():
    corpus = tm.synthetic_corpus(300)
    assert corpus == tm.synthetic_corpus(300) and len(corpus) == 300
    assert corpus != tm.synthetic_corpus(300, seed=1)
    assert any(line.startswith("user: ") and "\nassistant: " in line for line in corpus)


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template(arch, tokenizers_by_arch):
    tokenizer = tokenizers_by_arch[arch]
    info = tm.ARCHS[arch]
    with_prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
    assert with_prompt.startswith("".join(info.prefix_tokens))
    assert with_prompt.startswith(without) and len(with_prompt) > len(without)
    for message in CHAT:
        assert message["content"] in without
    assert f"A tiny model.{info.eos_token}" in without  # assistant turns end with eos
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids["input_ids"] == tokenizer(with_prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids["input_ids"]) == with_prompt
    with pytest.raises(Exception, match="unsupported role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "{}"}], tokenize=False)


def test_deepseek_template_matches_vllm_encoder(tokenizers_by_arch):
    """vLLM serves DeepseekV32ForCausalLM with its own Python chat encoder, not the Jinja template."""
    from vllm.tokenizers.deepseek_v32_encoding import encode_messages

    tokenizer = tokenizers_by_arch["deepseek_v32"]
    for messages in (CHAT, CHAT[1:2], CHAT[:2]):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert rendered == encode_messages(messages, thinking_mode="chat")


# ----------------------------------------------------------------------------- vLLM


def test_vllm_model_config(built):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.tokenizers import cached_tokenizer_from_config

    spec, path = built
    config = EngineArgs(model=str(path)).create_engine_config()
    model_config = config.model_config
    assert model_config.architecture == tm.ARCHS[spec.arch].architecture
    assert model_config.use_mla is True
    assert model_config.hf_text_config.index_topk == spec.index_topk
    assert model_config.get_head_size() == spec.kv_lora_rank + spec.qk_rope_head_dim == 576
    assert model_config.max_model_len == spec.max_position_embeddings
    # vLLM's tokenizer (deepseek_v32 mode for DeepSeek) renders the same prompt as transformers.
    tokenizer = cached_tokenizer_from_config(model_config)
    assert len(tokenizer) == spec.vocab_size and tokenizer.eos_token_id == 1
    ours = tm.build_tokenizer(spec).apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == ours


# ----------------------------------------------------------------------------- command line


def test_cli_builds_and_prints_the_path(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert tm.main(["deepseek_v32", str(out), "--layers", "3", "--index-topk", "256", "--seed", "5"]) == 0
    assert capsys.readouterr().out.strip() == str(out.resolve())
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["index_topk"]) == (3, 256)
    assert json.loads((out / tm.SPEC_FILE).read_text())["seed"] == 5


def test_production_topk_gives_the_released_models_top_k_and_room_past_it(tmp_path, capsys):
    spec = tm.production_topk(tm.TinyModelSpec(arch="deepseek_v32", index_topk=32))
    assert (spec.index_topk, spec.max_position_embeddings) == (2048, 8192)
    assert spec.index_topk < spec.max_position_embeddings, "contexts can be longer than the top-K"
    out = tmp_path / "production"
    assert tm.main(["glm5", str(out), "--production-topk", "--index-topk", "64"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["index_topk"], config["max_position_embeddings"]) == (2048, 8192)


def test_cli_errors_and_warnings(tmp_path, capsys):
    assert tm.main(["glm5", str(tmp_path / "x"), "--layers", "0"]) == 2
    assert "num_hidden_layers must be positive" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("")
    assert tm.main(["glm5", str(tmp_path / "full")]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert tm.main(["glm5", str(tmp_path / "small"), "--kv-lora-rank", "64", "--vocab-size", "384"]) == 0
    assert "warning: vLLM could configure but not run" in capsys.readouterr().err


def test_cli_script_runs_standalone():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "tiny_models.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "{deepseek_v32,glm5}" in result.stdout and "--index-topk" in result.stdout
