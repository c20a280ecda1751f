# SPDX-License-Identifier: Apache-2.0
"""The capacity simulator's step-time model: its arithmetic and its constants file."""

from __future__ import annotations

import json
import random

import pytest

from vllm.v1.hisparse.capacity.step_model import (
    CONSTANTS,
    ModelShape,
    ScheduledWork,
    StepModel,
    load_constants,
    sum_min,
)


@pytest.mark.parametrize("cap", [1, 7, 64, 2048])
def test_rows_attended_equal_a_count_token_by_token(cap):
    rng = random.Random(cap)
    for _ in range(200):
        start = rng.randrange(0, 3 * cap + 5)
        end = start + rng.randrange(0, 2 * cap + 5)
        assert sum_min(start, end, cap) == sum(min(p, cap) for p in range(start + 1, end + 1))


def test_accepted_drafts_follow_the_chained_acceptance():
    model = StepModel(None, {**load_constants(None), "mtp_acceptance": 0.75})  # type: ignore[arg-type]
    rng = random.Random(0)
    draws = [model.accepted_tokens(3, rng.random()) for _ in range(40_000)]
    # P(at least n accepted) = 0.75^n, at most 3.
    for n in (1, 2, 3):
        assert sum(d >= n for d in draws) / len(draws) == pytest.approx(0.75**n, abs=0.01)
    assert max(draws) == 3 and model.accepted_tokens(0, 0.1) == 0


def test_constants_are_overridden_from_a_file_and_bad_files_are_refused(tmp_path):
    good = tmp_path / "measured.json"
    good.write_text(json.dumps({"h2d_bytes_per_s": 41.5e9, "row_h2d_bytes_per_s": 12e9}))
    values = load_constants(good)
    assert values["h2d_bytes_per_s"] == 41.5e9 and values["row_h2d_bytes_per_s"] == 12e9
    assert values["hbm_bytes_per_s"] == CONSTANTS["hbm_bytes_per_s"].value
    for text, message in (
        ('{"pcie": 1}', "unknown constants"),
        ('{"h2d_bytes_per_s": "fast"}', "must be a number"),
        ("[1, 2]", "JSON object"),
        ("{", "not a readable JSON object"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_constants(bad)
    assert all(c.source for c in CONSTANTS.values())


def shape(**changes) -> ModelShape:
    base = dict(
        num_layers=78, num_indexer_layers=21, drafter_layers=0, num_speculative_tokens=0, index_topk=2048,
        heads_per_gpu=8, kv_lora_rank=512, qk_rope_head_dim=64, index_heads=32, index_head_dim=128,
        hidden_size=6144, tensor_parallel_size=8, dense_weight_bytes=20e9, expert_weight_bytes=70e9,
        dense_active_params=15e9, expert_params=1e9, routed_experts=256, experts_per_token=8,
        sparse_row_bytes=656, indexer_row_bytes=132,
    )  # fmt: skip
    return ModelShape(**{**base, **changes})


def test_a_step_costs_more_with_more_context_tokens_and_host_rows():
    model = StepModel(shape(), load_constants(None))
    decode = [ScheduledWork(10_000, 10_001, True)] * 8
    longer = [ScheduledWork(100_000, 100_001, True)] * 8
    assert 0 < model.compute_seconds(decode) < model.compute_seconds(longer)
    assert model.compute_seconds(decode) < model.compute_seconds([*decode, ScheduledWork(0, 8192, False)])
    assert model.host_rows_seconds(0) == 0 < model.host_rows_seconds(200)
    # A decode step loads the hot buffer's misses; a prefill chunk its tokens' union.
    assert model.miss_rows(2048, 0.5, 4, True, 50_000) == round(2048 * 0.5 * 0.1)
    assert model.miss_rows(2048, 0.5, 753, False, 50_000) == 8 * 1024
    assert model.miss_rows(2048, 0.5, 753, False, 4_000) == 4_000
    assert model.miss_rows(2048, 0.0, 4, True, 50_000) == 0


def test_gpu_checks_bandwidths_become_the_simulators_constants(tmp_path):
    """scripts/gpu_check.py writes what it measured as a constants file `--constants` reads."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", script)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    figures = {
        "pages": {True: {"batched_gbps": 48.0}, False: {"batched_gbps": 52.5}},
        "resolver": {
            0.0: {"h2d_gbps": 0.0, "fused_plan_pipelined_us": 90.0, "apply_pipelined_us": 6.0},
            0.1: {"h2d_gbps": 17.25, "fused_plan_pipelined_us": 120.0, "apply_pipelined_us": 50.0},
            0.5: {"h2d_gbps": 40.0, "fused_plan_pipelined_us": 300.0, "apply_pipelined_us": 400.0},
        },
    }
    constants = gpu_check.simulator_constants(figures)
    assert constants == pytest.approx(
        {
            "h2d_bytes_per_s": 52.5e9,
            "d2h_bytes_per_s": 48e9,
            "row_h2d_bytes_per_s": 17.25e9,
            "resolver_plan_s": 120e-6,  # at the misses the hit rate leaves
            "resolver_replay_s": 6e-6,  # without misses: the rows are row_h2d's
        }
    )
    path = tmp_path / "simulator-constants.json"
    path.write_text(json.dumps(constants))
    assert load_constants(path)["row_h2d_bytes_per_s"] == 17.25e9
    assert gpu_check.simulator_constants({"pages": {}, "resolver": {}}) == {}


def test_gpu_check_reports_into_a_runners_output_folder_and_names_its_torch(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_out", script)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.default_out() == tmp_path / "kernels.md"
    monkeypatch.delenv("OUT")
    assert gpu_check.default_out() == script.parents[1] / "docs" / "gpu-check.md"
    assert "the version the wheel pins" in gpu_check.torch_note("2.13.0+cu130")
    assert "not the 2.13.0 the wheel pins" in gpu_check.torch_note("2.11.0+cu130")


def test_the_resolvers_own_work_is_a_plan_per_indexer_layer_and_a_replay_per_layer():
    constants = {**load_constants(None), "resolver_plan_s": 1e-3, "resolver_replay_s": 1e-5}
    model = StepModel(shape(num_layers=78, num_indexer_layers=21), constants)
    assert model.resolver_seconds() == pytest.approx(21 * 1e-3 + 78 * 1e-5)
    # Without shared indexers every layer plans its own selection.
    unshared = StepModel(shape(num_indexer_layers=78), constants)
    assert unshared.resolver_seconds() == pytest.approx(78 * 1.01e-3)


def test_gpu_checks_report_tabulates_the_resolver_by_misses_and_by_batch(tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_report", script)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def resolver(plan_us: float) -> dict:
        return {
            "fused_plan_us": plan_us, "fused_plan_host_us": 80.0, "fused_plan_pipelined_us": plan_us / 2,
            "torch_plan_us": 2800.0, "apply_us_per_layer": 29.0, "apply_host_us": 12.0,
            "apply_pipelined_us": 9.0, "rows_loaded": 13056, "h2d_gbps": 36.6,
        }  # fmt: skip

    figures = {
        "resolver": {0.0: resolver(390.0), 0.1: resolver(382.0)},
        "batches": {1: resolver(300.0), 8: resolver(310.0)},
        "pages": {},
        "failures": [],
    }
    machine = {"date": "today", "gpu": "G", "capability": "9.0", "cuda": "13.0", "torch": "2.13.0",
               "python": "3.12", "build_s": 30.0}  # fmt: skip
    command = "python3 scripts/gpu_check.py"
    text = gpu_check.write_report(tmp_path / "r.md", machine, "passed", [], figures, command)
    assert "| 10% | 382.0 | 80.0 / 191.0 | 2800.0 | 29.0 | 12.0 / 9.0 | 13056 | 36.6 |" in text
    by_batch = [line for line in text.splitlines() if line.startswith(("| 1 |", "| 8 |", "| 64 |"))]
    assert by_batch == [
        "| 1 | 300.0 | 80.0 / 150.0 | 29.0 |",
        "| 8 | 310.0 | 80.0 / 155.0 | 29.0 |",
        "| 64 | 382.0 | 80.0 / 191.0 | 29.0 |",
    ]
    assert (tmp_path / "r.md").read_text() == text
