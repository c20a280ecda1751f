# SPDX-License-Identifier: Apache-2.0
"""Only the trusted P/D proxy may make a KV consumer read KV cache from a peer.

`vllm.v1.hisparse.trust` checks a request's kv_transfer_params where vLLM validates its
sampling parameters: a remote prefill on a KV consumer needs the proxy's signature, made
with the secret both share, unexpired and used once. The proxy of scripts/pd_proxy.py
signs what it sends; here its signature is checked by the consumer's own function.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm.v1.hisparse import trust

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SECRET = b"0123456789abcdef0123456789abcdef"
PARAMS = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.2", "remote_port": 5600, "remote_block_ids": [[1, 2, 3]],
    "remote_request_id": "r-1",
}  # fmt: skip
CONSUMER = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=True))
PRODUCER = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=False))
NO_CONNECTOR = SimpleNamespace(kv_transfer_config=None)


def fresh() -> trust._UsedSignatures:
    return trust._UsedSignatures()


def test_signed_params_pass_once_and_reach_the_connector_unchanged():
    signed = trust.sign(PARAMS, SECRET, now=1000.0)
    used = fresh()
    checked = dict(signed)
    trust.verify(checked, SECRET, now=1001.0, used=used)
    assert checked == signed and {k: checked[k] for k in PARAMS} == PARAMS
    # The same signature a second time: refused (one read per signature).
    with pytest.raises(trust.UntrustedKVTransfer, match="already used"):
        trust.verify(dict(signed), SECRET, now=1002.0, used=used)


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.update(remote_host="10.6.6.6"),
        lambda p: p.update(remote_block_ids=[[-5, 123456]]),
        lambda p: p.update(hisparse_proxy_expires=p["hisparse_proxy_expires"] + 1),
        lambda p: p.pop("remote_request_id"),
    ],
    ids=["host", "block-ids", "expiry", "field-removed"],
)
def test_a_changed_field_breaks_the_signature(change):
    signed = trust.sign(PARAMS, SECRET, now=1000.0)
    change(signed)
    with pytest.raises(trust.UntrustedKVTransfer, match="signature this instance does not accept"):
        trust.verify(signed, SECRET, now=1001.0, used=fresh())


def test_another_secret_an_unsigned_body_and_no_secret_are_refused():
    with pytest.raises(trust.UntrustedKVTransfer, match="differs"):
        trust.verify(trust.sign(PARAMS, b"another secret of 32 bytes......", now=1000.0), SECRET,
                     now=1001.0, used=fresh())  # fmt: skip
    with pytest.raises(trust.UntrustedKVTransfer, match="no signature"):
        trust.verify(dict(PARAMS), SECRET, now=1001.0, used=fresh())
    with pytest.raises(trust.UntrustedKVTransfer, match=trust.SECRET_ENV):
        trust.verify(trust.sign(PARAMS, SECRET, now=1000.0), None, now=1001.0, used=fresh())


def test_an_expired_or_far_future_signature_is_refused():
    with pytest.raises(trust.UntrustedKVTransfer, match="expired"):
        trust.verify(trust.sign(PARAMS, SECRET, now=1000.0), SECRET, now=1000.0 + 301, used=fresh())
    with pytest.raises(trust.UntrustedKVTransfer, match="expired"):
        trust.verify(trust.sign(PARAMS, SECRET, valid_s=10 * trust.MAX_VALID_S, now=1000.0), SECRET,
                     now=1001.0, used=fresh())  # fmt: skip


def test_a_short_secret_is_refused_and_an_empty_one_is_none():
    with pytest.raises(trust.UntrustedKVTransfer, match="at least 16"):
        trust.secret_from_env({trust.SECRET_ENV: "short"})
    assert trust.secret_from_env({trust.SECRET_ENV: ""}) is None
    assert trust.secret_from_env({trust.SECRET_ENV: SECRET.decode()}) == SECRET


def test_only_a_consumer_checks_and_only_a_remote_prefill(monkeypatch):
    monkeypatch.delenv(trust.SECRET_ENV, raising=False)
    hostile = {"kv_transfer_params": dict(PARAMS)}
    with pytest.raises(trust.UntrustedKVTransfer, match=trust.SECRET_ENV):
        trust.check_params(CONSUMER, hostile)
    # A producer or an instance without a connector does not act on do_remote_prefill.
    trust.check_params(PRODUCER, {"kv_transfer_params": dict(PARAMS)})
    trust.check_params(NO_CONNECTOR, {"kv_transfer_params": dict(PARAMS)})
    # A remote decode (what the proxy asks of a prefill instance) steers no read.
    trust.check_params(CONSUMER, {"kv_transfer_params": {"do_remote_decode": True}})
    trust.check_params(CONSUMER, None)
    with pytest.raises(trust.UntrustedKVTransfer, match="JSON object"):
        trust.check_params(CONSUMER, {"kv_transfer_params": [1, 2]})
    monkeypatch.setenv(trust.SECRET_ENV, SECRET.decode())
    args = {"kv_transfer_params": trust.sign(PARAMS, SECRET)}
    trust.check_params(CONSUMER, args)


def test_a_rejected_request_makes_the_consumer_contact_its_peer_only_if_the_proxy_signed_it(monkeypatch):
    """vLLM tells the peer of a request refused before the engine to free its blocks: for a
    client's own parameters that would be a connection to any host it names."""
    monkeypatch.setenv(trust.SECRET_ENV, SECRET.decode())
    signed = trust.sign(PARAMS, SECRET)
    trust.check_params(CONSUMER, {"kv_transfer_params": dict(signed)})  # accepted once already
    assert trust.may_notify_rejection(CONSUMER, signed)
    assert not trust.may_notify_rejection(CONSUMER, dict(PARAMS))
    forged = trust.sign(PARAMS, b"another secret of 32 bytes......")
    assert not trust.may_notify_rejection(CONSUMER, forged)
    assert trust.may_notify_rejection(PRODUCER, dict(PARAMS)), "a producer reads from no peer"
    assert trust.may_notify_rejection(CONSUMER, {"do_remote_decode": True})
    monkeypatch.delenv(trust.SECRET_ENV)
    assert not trust.may_notify_rejection(CONSUMER, signed)


def test_vllm_answers_a_refusal_as_a_validation_error_naming_the_field(monkeypatch):
    from vllm.exceptions import VLLMClientError

    monkeypatch.setenv(trust.SECRET_ENV, SECRET.decode())
    with pytest.raises(VLLMClientError, match="kv_transfer_params") as refused:
        trust.check_kv_transfer_params(CONSUMER, {"kv_transfer_params": dict(PARAMS)})
    assert "no signature" in str(refused.value)


def test_a_remote_prefill_for_more_than_one_sequence_is_refused_before_its_signature_is_used(monkeypatch):
    """vLLM validates a request once and then makes n requests of it, each of which would
    read the peer's blocks; the peer frees them for other requests after the first read.
    The refusal comes before the signature is taken, and through vLLM's own validation
    of the sampling parameters (patch 0016)."""
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    monkeypatch.setenv(trust.SECRET_ENV, SECRET.decode())
    signed = trust.sign(PARAMS, SECRET)
    processor = SimpleNamespace(vllm_config=CONSUMER)
    for n in (2, 4):
        params = SamplingParams(n=n, extra_args={"kv_transfer_params": dict(signed)})
        with pytest.raises(VLLMClientError, match=f"n={n}"):
            InputProcessor._validate_params(processor, params, ("generate",))
    trust.check_params(CONSUMER, {"kv_transfer_params": dict(signed)}, n=1)
    with pytest.raises(trust.UntrustedKVTransfer, match="already used"):
        trust.check_params(CONSUMER, {"kv_transfer_params": dict(signed)}, n=1)
    trust.check_params(PRODUCER, {"kv_transfer_params": dict(signed)}, n=3)  # reads from no peer


def test_the_proxy_signs_what_the_decode_instance_gets_with_the_shared_secret():
    import pd_proxy
    from test_pd_proxy import Instance, post, serve

    prefill = Instance({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
    decode = Instance({"choices": [{"text": "ok"}]})
    proxy, url = serve(pd_proxy.build_app(prefill.url, decode.url, SECRET))
    try:
        status, _ = post(url, json.dumps({"prompt": "hi"}).encode())
    finally:
        for server in (prefill.server, decode.server, proxy):
            server.shutdown()
    assert status == 200
    (sent,) = decode.bodies
    params = sent["kv_transfer_params"]
    assert trust.MAC_FIELD in params
    trust.verify(params, SECRET, used=fresh())
    assert {k: params[k] for k in PARAMS} == PARAMS


def test_a_remote_prefill_of_a_prompt_of_another_length_is_refused_once_the_prompt_is_rendered(
    monkeypatch, tmp_path
):
    """The proxy calls the prefill instance with max_tokens=1 and the decode instance with
    the client's: `truncate_prompt_tokens: -1` cuts the two prompts differently, and the
    decode instance loaded the prefill's KV (of other tokens at other positions) and cached
    it under its own prompt's hashes for every user. The prefill's prompt length, signed
    with the rest, must be the rendered prompt's (patch 0016, through vLLM's own input
    processor)."""
    from scheduler_harness import SchedulerHarness, tiny_glm5_dir

    from vllm.config import KVTransferConfig
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    monkeypatch.setenv(trust.SECRET_ENV, SECRET.decode())
    h = SchedulerHarness.create(
        model=str(tiny_glm5_dir()), memory_bytes=8 << 20, max_model_len=640,
        kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer"),
    )  # fmt: skip
    processor = InputProcessor(h.vllm_config)
    prompt = {"type": "token", "prompt_token_ids": list(range(10, 16))}

    def process(num_tokens: int):
        params = dict(PARAMS, remote_num_tokens=num_tokens)
        sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": trust.sign(params, SECRET)})
        return processor.process_inputs("r", prompt, sampling, ("generate",))

    with pytest.raises(VLLMClientError, match="prompt of 5 tokens and this instance's prompt has 6"):
        process(5)
    assert len(process(6).prompt_token_ids) == 6


def test_a_malformed_or_deeply_nested_signature_is_refused_not_an_error():
    signed = trust.sign(PARAMS, SECRET)
    for mac in ("é" * 64, "0" * 63, "G" * 64):
        with pytest.raises(trust.UntrustedKVTransfer, match="malformed"):
            trust.verify(dict(signed, hisparse_proxy_mac=mac), SECRET, used=fresh())
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(trust.UntrustedKVTransfer, match="cannot be checked"):
        trust.verify(dict(signed, extra=deep), SECRET, used=fresh())


def test_used_signatures_are_forgotten_as_they_expire():
    used = fresh()
    for i in range(5000):
        assert used.take(f"{i:064x}", expires=1000.0 + i, now=999.0)
    assert not used.take(f"{4999:064x}", expires=5999.0, now=1500.0), "still unexpired: used once"
    assert len(used) == 5000 - 500
    assert used.take(f"{3:064x}", expires=7000.0, now=6500.0), "expired: forgotten"
    assert len(used) == 1


def test_parameters_naming_a_peer_need_the_signature_without_do_remote_prefill_too():
    """Upstream's do_remote_decode path on a KV consumer also names a peer (an exchange in
    both directions): unsigned, it made the instance wait for, or read from, a host the
    client chose."""
    unsigned = {k: v for k, v in PARAMS.items() if k != "do_remote_prefill"} | {"do_remote_decode": True}
    with pytest.raises(trust.UntrustedKVTransfer):
        trust.check_params(CONSUMER, {"kv_transfer_params": unsigned})
    assert not trust.may_notify_rejection(CONSUMER, unsigned)
    trust.check_params(CONSUMER, {"kv_transfer_params": {"do_remote_decode": True}})  # the proxy's
    trust.check_params(PRODUCER, {"kv_transfer_params": unsigned})  # reads from no peer


def test_with_recurrent_layers_the_prefill_computes_all_but_the_last_prompt_token():
    """Upstream's NIXL prefill of a model with Mamba layers computes N-1 of N prompt tokens
    (the decode instance computes the last): that length is the prompt's too."""
    params = {"kv_transfer_params": dict(PARAMS, remote_num_tokens=99)}
    hybrid = SimpleNamespace(
        kv_transfer_config=CONSUMER.kv_transfer_config, model_config=SimpleNamespace(is_hybrid=True)
    )
    trust.check_remote_prompt(hybrid, params, 100)
    with pytest.raises(trust.UntrustedKVTransfer, match="99 tokens"):
        trust.check_remote_prompt(hybrid, params, 101)
    with pytest.raises(trust.UntrustedKVTransfer, match="99 tokens"):
        trust.check_remote_prompt(CONSUMER, params, 100)
