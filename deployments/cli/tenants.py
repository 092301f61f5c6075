"""`deltaserve tenants add|list|revoke`: edit the tenants file (see :mod:`deployments.tenancy`).

    deltaserve tenants add acme --pools standard,highspeed --rpm 120 --tpm 200000
    deltaserve tenants list [--json]
    deltaserve tenants revoke acme

The file is ``--file``, else ``$DELTASERVE_TENANTS``, else ``./tenants.yaml``. A running
ingress picks up the change on its next request (it reloads the file when it changes).
Each command returns 0, or 2 with a message on stderr naming the bad value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_FILE = "tenants.yaml"
ENV_FILE = "DELTASERVE_TENANTS"


def tenants_path(args: argparse.Namespace) -> Path:
    return Path(args.file or os.environ.get(ENV_FILE) or DEFAULT_FILE)


def _fail(message: str) -> int:
    print(f"deltaserve tenants: {message}", file=sys.stderr)
    return 2


def _parse_pools(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _add(args: argparse.Namespace) -> int:
    from deployments.tenancy import TenantRegistry, TenantsFileError

    path = tenants_path(args)
    try:
        reg = TenantRegistry.load(path) if path.exists() else TenantRegistry(path=path)
        spec, key = reg.add(args.name, pools=_parse_pools(args.pools), rpm=args.rpm, tpm=args.tpm,
                            max_context=args.max_context)
        reg.save(path)
    except (TenantsFileError, ValueError) as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"cannot write {str(path)!r}: {e.strerror or e}")
    print(key)
    print(f"added tenant {spec.name!r} (pools {','.join(spec.allowed_pools)}, {spec.requests_per_minute} rpm, "
          f"{spec.tokens_per_minute} tpm, max context {spec.max_context}) to {path}.\n"
          "The API key above is shown only this once and cannot be shown again: store it now.",
          file=sys.stderr)
    return 0


def _row(spec) -> dict:
    return {"name": spec.name, "pools": list(spec.allowed_pools), "requests_per_minute": spec.requests_per_minute,
            "tokens_per_minute": spec.tokens_per_minute, "max_context": spec.max_context,
            "keys": len(spec.key_hashes), "disabled": spec.disabled}


def _list(args: argparse.Namespace) -> int:
    from deployments.tenancy import TenantRegistry, TenantsFileError

    try:
        reg = TenantRegistry.load(tenants_path(args))
    except TenantsFileError as e:
        return _fail(str(e))
    rows = [_row(s) for s in reg.specs]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ["NAME", "POOLS", "RPM", "TPM", "MAX_CONTEXT", "KEYS", "DISABLED"]
    table = [header] + [[r["name"], ",".join(r["pools"]), str(r["requests_per_minute"]), str(r["tokens_per_minute"]),
                         str(r["max_context"]), str(r["keys"]), "yes" if r["disabled"] else "no"] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _revoke(args: argparse.Namespace) -> int:
    from deployments.tenancy import TenantRegistry, TenantsFileError

    path = tenants_path(args)
    try:
        reg = TenantRegistry.load(path)
        reg.revoke(args.name)
        reg.save(path)
    except TenantsFileError as e:
        return _fail(str(e))
    except KeyError as e:
        return _fail(f"{e.args[0]} in {path}")
    except OSError as e:
        return _fail(f"cannot write {str(path)!r}: {e.strerror or e}")
    print(f"revoked tenant {args.name!r} (all its API keys) in {path}", file=sys.stderr)
    return 0


def add_tenants_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``tenants`` (with ``add``, ``list``, ``revoke``) on the CLI's subparsers."""
    tenants = subparsers.add_parser("tenants", help="manage tenants, their API keys and limits",
                                    description="Add, list and revoke tenants in the tenants file. A running "
                                    "ingress reloads the file when it changes.")
    sub = tenants.add_subparsers(dest="tenants_command", required=True)
    file_help = f"tenants file (default: ${ENV_FILE} or ./{DEFAULT_FILE})"

    add = sub.add_parser("add", help="add a tenant and print its new API key (once)")
    add.add_argument("name", help="tenant name: lowercase slug [a-z0-9][a-z0-9_-]{0,62}")
    add.add_argument("--pools", default="standard", help="comma-separated pools: standard,highspeed (default: standard)")
    add.add_argument("--rpm", type=int, default=60, help="requests per minute (default: 60)")
    add.add_argument("--tpm", type=int, default=100_000,
                     help="tokens per minute, prompt + max output tokens (default: 100000)")
    add.add_argument("--max-context", type=int, default=8192, help="longest prompt + output of one request (default: 8192)")
    add.add_argument("--file", default=None, help=file_help)
    add.set_defaults(func=_add)

    ls = sub.add_parser("list", help="list tenants, pools and limits (never keys)")
    ls.add_argument("--file", default=None, help=file_help)
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=_list)

    rv = sub.add_parser("revoke", help="remove a tenant and all its API keys")
    rv.add_argument("name", help="tenant name")
    rv.add_argument("--file", default=None, help=file_help)
    rv.set_defaults(func=_revoke)
    return tenants
