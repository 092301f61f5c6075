"""Tenants: hashed API keys, the tenants file, pool entitlements, rate limits and usage.

No Ray and no web framework here: the frontend calls into this package.
"""

from deployments.gateway.errors import AuthError, BadRequestError, PermissionDeniedError, RateLimitedError, TenantError
from deployments.tenancy.keys import HASH_PREFIX, KEY_PREFIX, generate_api_key, hash_api_key, parse_authorization
from deployments.tenancy.limits import WINDOW_S, RateLimiter, SharedRateLimiter, make_rate_limiter
from deployments.tenancy.registry import (POOLS, Tenant, TenantRegistry, TenantsFile, TenantsFileError, TenantSpec,
                                          check_context, check_pool, default_dev_tenants)
from deployments.tenancy.usage import UsageCounter

__all__ = ["AuthError", "BadRequestError", "PermissionDeniedError", "RateLimitedError", "TenantError", "HASH_PREFIX",
           "KEY_PREFIX", "generate_api_key", "hash_api_key", "parse_authorization", "WINDOW_S", "RateLimiter", "SharedRateLimiter",
           "make_rate_limiter", "POOLS",
           "Tenant", "TenantRegistry", "TenantsFile", "TenantsFileError", "TenantSpec", "check_context", "check_pool",
           "default_dev_tenants", "UsageCounter"]
