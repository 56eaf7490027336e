"""Tenants of the prefix cache: one cache salt per API key.

With API keys configured, every engine request carries its tenant's salt as `cache_salt`.
The salt enters the first block's hash (`shared.kv_cache.prefix_hash.block_extra_keys`) and
the chain carries it to every later block, so the block hashes differ per tenant everywhere
they are used: the engines' prefix caches, the KV handles, the Redis prefix index
(`{p}:held:{instance_id}` holds hashes) and the gateway's routing lookups. One tenant can
therefore neither hit nor time (the prefix-cache timing side channel) another's blocks.

    API key ──sha256("pdserve-cache-salt\\0" + key)──▶ tenant salt (32 hex chars)
    body cache_salt "x" ──▶ "<tenant salt>:x"     (partitions further, inside the tenant)

The client's body `cache_salt` never replaces the tenant salt: it is appended to it, so a
client can still split its own cache (vLLM's meaning of the field) but no choice of body
salt reaches another tenant's hashes (every tenant salt has the same length and no ":").
Without API keys there are no tenants: the body `cache_salt` is used as is (as in vLLM).

NOTE: the salt is a one-way function of the key under a fixed domain prefix (no per-process
secret) so that every gateway replica and restart derives the same salt and the cache stays
warm across them. It is never the key itself, and the key is never logged or sent on.
"""

from __future__ import annotations

import hashlib

_SALT_DOMAIN = b"pdserve-cache-salt\0"
TENANT_SALT_HEX_CHARS = 32
"""Length of a tenant salt: 128 bits, hex."""


def tenant_cache_salt(api_key: str) -> str:
    """The cache salt of the tenant holding `api_key`.

    Returns:
        32 lowercase hex characters (the first 128 bits of sha256(domain + key)).
    """
    digest = hashlib.sha256(_SALT_DOMAIN + api_key.encode("utf-8")).hexdigest()
    return digest[:TENANT_SALT_HEX_CHARS]


def request_cache_salt(tenant_salt: str | None, body_salt: str | None) -> str | None:
    """The `cache_salt` of the engine requests of one HTTP request.

    Args:
        tenant_salt: the authenticated tenant's salt (None: no API keys configured).
        body_salt: the client's `cache_salt` field; "" counts as absent.

    Returns:
        `tenant_salt` or `tenant_salt + ":" + body_salt` with a tenant; else `body_salt`
        (None when absent).
    """
    body_salt = body_salt or None
    if tenant_salt is None:
        return body_salt
    return tenant_salt if body_salt is None else f"{tenant_salt}:{body_salt}"
