# SPDX-License-Identifier: Apache-2.0
"""Who may make a decode instance read KV cache from a peer.

A request's `kv_transfer_params` with `do_remote_prefill` tell a KV consumer
which peer to read its prompt's KV cache from (host, port, engine, block ids).
Whoever can set them can make the instance connect to a host of their choice,
hold blocks, a hot lease and host pages while it waits, and publish KV cache
they supplied to the prefix cache and the host pool, where other users'
requests with the same prefix would reuse it. Only the P/D proxy, which builds
them from the prefill instance's answer, may set them.

The proxy and every KV consumer share a secret (`SECRET_ENV`). The proxy signs
the parameters it sends (`sign`): an HMAC-SHA256 over their canonical JSON,
with an expiry. A KV consumer's front end checks them before a request exists
(`check_kv_transfer_params`, called where vLLM validates sampling parameters):
without a valid, unexpired, unused signature the request is refused with a
400 answer and nothing is held. A consumer without the secret refuses every
remote prefill, naming the setting. A refused request's parameters are not
passed on either: vLLM tells the peer of a request rejected before it reached
the engine to free its blocks, and does so only for signed parameters here
(`may_notify_rejection`), so a client cannot make the instance contact a host.

Parameters that name no peer (a prefill instance's `do_remote_decode` from the
proxy, or none at all) are not checked here: they steer no read from a peer.
Once the prompt is rendered, a remote prefill's signed prompt length must be
this instance's (`check_kv_transfer_prompt`): the KV it loads is of the prefill
instance's prompt.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

SECRET_ENV = "VLLM_HISPARSE_PD_SECRET"
MAC_FIELD = "hisparse_proxy_mac"
EXPIRES_FIELD = "hisparse_proxy_expires"
# How long a signature is valid: the decode call follows the prefill answer at once.
DEFAULT_VALID_S = 300.0
# The longest validity a consumer accepts (a signature cannot be made to last forever).
MAX_VALID_S = 3600.0
MIN_SECRET_BYTES = 16
_HEX_MAC = re.compile(r"[0-9a-f]{64}")
# Fields that name a peer to read KV from: on a KV consumer only signed ones are acted on.
PEER_FIELDS = ("remote_host", "remote_port", "remote_engine_id", "remote_request_id", "remote_block_ids")


class UntrustedKVTransfer(ValueError):
    """kv_transfer_params that did not come from a trusted proxy (a 400 answer)."""


def secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret, or None when it is not set. A secret shorter than
    MIN_SECRET_BYTES is refused: it could be guessed."""
    value = (os.environ if environ is None else environ).get(SECRET_ENV, "")
    if not value:
        return None
    secret = value.encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise UntrustedKVTransfer(
            f"{SECRET_ENV} is {len(secret)} bytes long; use at least {MIN_SECRET_BYTES} random bytes "
            "(for example `openssl rand -hex 32`)"
        )
    return secret


def _canonical(params: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in params.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _mac(params: Mapping[str, Any], secret: bytes) -> str:
    return hmac.new(secret, _canonical(params), hashlib.sha256).hexdigest()


def sign(
    params: Mapping[str, Any], secret: bytes, valid_s: float = DEFAULT_VALID_S, now: float | None = None
) -> dict[str, Any]:
    """`params` with an expiry and the proxy's signature over both."""
    signed = {k: v for k, v in params.items() if k not in (MAC_FIELD, EXPIRES_FIELD)}
    signed[EXPIRES_FIELD] = (time.time() if now is None else now) + valid_s
    signed[MAC_FIELD] = _mac(signed, secret)
    return signed


class _UsedSignatures:
    """Signatures already accepted, until they expire: each opens one read only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}
        # (expiry, signature), soonest first: the expired go at each take, a few at a time.
        self._expiring: list[tuple[float, str]] = []

    def take(self, mac: str, expires: float, now: float) -> bool:
        with self._lock:
            expiring, until = self._expiring, self._until
            while expiring and expiring[0][0] < now:
                _, old = heapq.heappop(expiring)
                if until.get(old, now) < now:
                    del until[old]
            if mac in until:
                return False
            until[mac] = expires
            heapq.heappush(expiring, (expires, mac))
            return True

    def __len__(self) -> int:
        return len(self._until)


_USED = _UsedSignatures()


def verify(
    params: dict[str, Any],
    secret: bytes | None,
    now: float | None = None,
    used: _UsedSignatures | None = _USED,
) -> None:
    """Raise UntrustedKVTransfer unless `params` carry a valid, unexpired signature (and,
    with `used`, one not accepted before: it is then recorded). The signature fields stay:
    connectors read only the fields they know."""
    if secret is None:
        raise UntrustedKVTransfer(
            "this instance reads KV cache from a peer (do_remote_prefill) only for a trusted P/D proxy, "
            f"and it has no shared secret: set {SECRET_ENV} to the same value on it and on "
            "scripts/pd_proxy.py (see docs/deploy.md, 'Trust model')"
        )
    mac, expires = params.get(MAC_FIELD), params.get(EXPIRES_FIELD)
    if not isinstance(mac, str) or not isinstance(expires, (int, float)) or isinstance(expires, bool):
        raise UntrustedKVTransfer(
            "kv_transfer_params with do_remote_prefill must come from the P/D proxy, signed with "
            f"{SECRET_ENV}; these carry no signature"
        )
    if not _HEX_MAC.fullmatch(mac):
        raise UntrustedKVTransfer(f"kv_transfer_params carry a malformed {MAC_FIELD}")
    try:
        expected = _mac(params, secret)
    except (TypeError, ValueError, RecursionError) as error:
        raise UntrustedKVTransfer(f"kv_transfer_params cannot be checked: {type(error).__name__}") from None
    if not hmac.compare_digest(mac, expected):
        raise UntrustedKVTransfer(
            "kv_transfer_params with do_remote_prefill carry a signature this instance does not "
            f"accept: the proxy's {SECRET_ENV} differs from this instance's, or the fields were changed"
        )
    now = time.time() if now is None else now
    if not now <= expires <= now + MAX_VALID_S:
        raise UntrustedKVTransfer(
            "kv_transfer_params with do_remote_prefill are expired (or claim "
            f"to be valid for more than {MAX_VALID_S:.0f} s)"
        )
    if used is not None and not used.take(mac, float(expires), now):
        raise UntrustedKVTransfer("kv_transfer_params with do_remote_prefill were already used once")


def names_peer(params: Mapping[str, Any]) -> bool:
    """Whether the parameters name a peer (upstream's `do_remote_decode` path reads from one
    too, where instances exchange KV both ways)."""
    return any(field in params for field in PEER_FIELDS)


def reads_from_peer(vllm_config: Any) -> bool:
    """Whether this instance acts on do_remote_prefill: it has a KV connector as a consumer."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return transfer is not None and bool(getattr(transfer, "is_kv_consumer", False))


def check_params(vllm_config: Any, extra_args: dict[str, Any] | None, n: int = 1) -> None:
    """A remote prefill on a KV consumer must come from the trusted proxy, for one sequence
    (`n`, the request's sequences; UntrustedKVTransfer otherwise)."""
    if not extra_args or "kv_transfer_params" not in extra_args:
        return
    params = extra_args["kv_transfer_params"]
    if params is None:
        return
    if not isinstance(params, dict):
        raise UntrustedKVTransfer("kv_transfer_params must be a JSON object")
    if not reads_from_peer(vllm_config) or not (params.get("do_remote_prefill") or names_peer(params)):
        return
    if n != 1:
        # vLLM would make n requests of one, each reading the peer's blocks, which the peer
        # frees (for other requests) once the first read is done.
        raise UntrustedKVTransfer(
            f"kv_transfer_params with do_remote_prefill serve one sequence, and this request asks "
            f"for n={n}: send n=1 (the P/D proxy's decode call asks for one)"
        )
    verify(params, secret_from_env())


def check_remote_prompt(vllm_config: Any, extra_args: dict[str, Any] | None, num_prompt_tokens: int) -> None:
    """A remote prefill's KV is the prefill instance's prompt's: the prompt here must be as
    long (UntrustedKVTransfer otherwise). The P/D proxy sends both instances the client's
    body, but the prefill with max_tokens=1: a truncation that depends on max_tokens
    (`truncate_prompt_tokens: -1`) cuts the two prompts differently, and this instance
    would load, and cache under its own prompt's hashes, KV of other tokens at other
    positions. `remote_num_tokens` (signed with the rest) is the prefill's prompt length."""
    params = (extra_args or {}).get("kv_transfer_params")
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return
    if not reads_from_peer(vllm_config):
        return
    remote = params.get("remote_num_tokens")
    # A model with recurrent (Mamba) layers: the prefill instance computes all but the last
    # prompt token, which the decode instance computes (upstream's NIXL connector).
    model = getattr(vllm_config, "model_config", None)
    recurrent = bool(getattr(model, "is_hybrid", False) or getattr(model, "is_attention_free", False))
    allowed = (num_prompt_tokens, num_prompt_tokens - 1) if recurrent else (num_prompt_tokens,)
    if isinstance(remote, int) and not isinstance(remote, bool) and remote not in allowed:
        raise UntrustedKVTransfer(
            f"the prefill instance computed a prompt of {remote} tokens and this instance's prompt "
            f"has {num_prompt_tokens}: the KV it would load is of other tokens (a truncation that "
            "depends on max_tokens, such as truncate_prompt_tokens=-1, or instances that tokenize "
            "differently); send the request without it"
        )


def check_kv_transfer_params(vllm_config: Any, extra_args: dict[str, Any] | None, n: int = 1) -> None:
    """Where vLLM validates a request's sampling parameters: `check_params`, its refusal
    raised as vLLM's validation error (a 400 answer naming kv_transfer_params)."""
    try:
        check_params(vllm_config, extra_args, n)
    except UntrustedKVTransfer as error:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(str(error), parameter="kv_transfer_params") from None


def check_kv_transfer_prompt(
    vllm_config: Any, extra_args: dict[str, Any] | None, num_prompt_tokens: int
) -> None:
    """Once the prompt is rendered: `check_remote_prompt`, its refusal raised as vLLM's
    validation error (a 400 answer; the peer is told to free its blocks)."""
    try:
        check_remote_prompt(vllm_config, extra_args, num_prompt_tokens)
    except UntrustedKVTransfer as error:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(str(error), parameter="kv_transfer_params") from None


def may_notify_rejection(vllm_config: Any, params: Any) -> bool:
    """Whether a KV consumer may tell the peer named in a rejected request's
    kv_transfer_params to free the blocks it holds for it (upstream does so for every
    request refused before it reached the engine, which makes the instance contact that
    peer): only when the trusted proxy signed them. The signature may already have been
    accepted once, by the request itself."""
    if not isinstance(params, dict) or not (params.get("do_remote_prefill") or names_peer(params)):
        return True
    if not reads_from_peer(vllm_config):
        return True
    try:
        verify(params, secret_from_env(), used=None)
    except UntrustedKVTransfer:
        return False
    return True
