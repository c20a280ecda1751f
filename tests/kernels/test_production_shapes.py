# SPDX-License-Identifier: Apache-2.0
"""The kernels at production shapes, byte for byte against their torch references (GPU),
and the shared check harness itself (CPU, reference against reference, small shapes).

Shapes: top-K 2048, hot buffer 4096, 656-byte fp8_ds_mla rows and 1152-byte bf16 rows,
128 decode requests, 8K-token prefill chunks (tests/support/kernel_checks.py).
"""

from __future__ import annotations

import pytest
from kernel_build import hisparse_ops
from kernel_checks import (
    ROW_BYTES,
    check_out_of_bounds_kernels,
    check_page_copy,
    check_resolution,
    resolution_case,
)


@pytest.fixture(scope="module")
def kernel_ops(tmp_path_factory):
    return hisparse_ops(tmp_path_factory.mktemp("jit"))


@pytest.mark.parametrize("miss_fraction", [0.0, 0.5])
def test_the_harness_builds_the_miss_fraction_it_is_asked_for(miss_fraction):
    case = resolution_case(
        requests=3,
        tokens_per_request=1,
        context=64 * 4,
        miss_fraction=miss_fraction,
        row_bytes=656,
        topk=16,
        hot_rows=32,
    )
    result = check_resolution(case, device="cpu")
    assert result["bit_exact"], result["mismatched"]
    assert result["rows_loaded"] == 3 * int(16 * miss_fraction)
    assert result["rows_hit"] == 3 * (16 - int(16 * miss_fraction) - 2)
    assert check_page_copy(layers=2, pages=3, row_bytes=656, to_host=True, device="cpu")["bit_exact"]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused-plan", "torch-plan"])
@pytest.mark.parametrize("row_kind", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("miss_fraction", [0.0, 0.1, 0.5])
def test_128_decode_requests_resolve_bit_for_bit(kernel_ops, row_kind, miss_fraction, fused):
    case = resolution_case(
        requests=128,
        tokens_per_request=1,
        context=16384,
        miss_fraction=miss_fraction,
        row_bytes=ROW_BYTES[row_kind],
        seed=1,
    )
    result = check_resolution(case, fused=fused)
    assert result["bit_exact"], result["mismatched"]


@pytest.mark.gpu
def test_draft_verification_steps_resolve_bit_for_bit_with_the_fused_plan(kernel_ops):
    case = resolution_case(
        requests=64,
        tokens_per_request=4,
        context=16384,
        miss_fraction=0.1,
        row_bytes=ROW_BYTES["fp8_ds_mla"],
        seed=4,
    )
    result = check_resolution(case, fused=True)
    assert result["bit_exact"], result["mismatched"]


@pytest.mark.gpu
@pytest.mark.parametrize("row_kind", ["fp8_ds_mla", "bf16"])
def test_an_8k_token_prefill_chunk_resolves_bit_for_bit(kernel_ops, row_kind):
    case = resolution_case(
        requests=1,
        tokens_per_request=8192,
        context=65536,
        miss_fraction=0.5,
        row_bytes=ROW_BYTES[row_kind],
        seed=2,
    )
    result = check_resolution(case)
    assert result["bit_exact"], result["mismatched"]


@pytest.mark.gpu
@pytest.mark.parametrize("row_kind", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("to_host", [True, False])
def test_an_8k_token_chunk_of_pages_copies_bit_for_bit(kernel_ops, row_kind, to_host):
    assert check_page_copy(layers=8, pages=128, row_bytes=ROW_BYTES[row_kind], to_host=to_host)["bit_exact"]


@pytest.mark.gpu
def test_out_of_bounds_indices_raise_the_error_word_and_write_nothing(kernel_ops):
    result = check_out_of_bounds_kernels()
    assert result == {
        "row_copy_flags_and_skips": True,
        "row_copy_stays_in_its_layer": True,
        "page_copy_flags_and_skips": True,
    }
