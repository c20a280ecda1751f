# SPDX-License-Identifier: Apache-2.0
"""The largest token id vLLM accepts is the tokenizer's last id (patch 0013).

The tiny models' tokenizer has exactly the model's vocabulary, the case where
upstream's off-by-one let id == vocab_size through validation and into the
embedding lookup.
"""

from __future__ import annotations

import pytest
import tiny_models

from vllm.tokenizers.hf import get_cached_tokenizer


@pytest.mark.parametrize("arch", ["glm5", "deepseek_v32"])
def test_max_token_id_is_the_last_id_of_the_vocabulary(arch):
    spec = tiny_models.TinyModelSpec(arch=arch)
    tokenizer = get_cached_tokenizer(tiny_models.build_tokenizer(spec))
    assert tokenizer.vocab_size == spec.vocab_size
    assert tokenizer.max_token_id == spec.vocab_size - 1
    assert tokenizer.convert_ids_to_tokens(tokenizer.max_token_id) is not None
