"""`deltaserve k8s render [--out k8s/] [--config FILE] [--check]`: the kustomize tree of the platform
(deployments/kube/), from the platform config `deltaserve up --config FILE` would use. Run it in the
repository's root: it reads ops/ and writes k8s/ there (--ops, --out for others).

``--check`` writes nothing and exits 1 when the tree on disk differs from a fresh render (CI).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def render(args: argparse.Namespace) -> int:
    from deployments.cli.output import check_writable
    from deployments.config import PlatformConfig, describe_error
    from deployments.kube.addons import Addons
    from deployments.kube.render import Sources, render_tree, write_tree

    try:
        if not args.check:
            check_writable(Path(args.out), directory=True)
        src = Sources(PlatformConfig.load(args.config), Path(args.ops), Addons(prometheus_url=args.prometheus_url))
        files = render_tree(src)
    except (ValueError, FileNotFoundError) as e:
        print(f"deltaserve k8s render: {describe_error(e)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.check:
        stale = [rel for rel, data in sorted(files.items())
                 if not (out / rel).is_file() or (out / rel).read_bytes() != data]
        extra = _extra_files(out, files)
        for rel in stale + extra:
            print(f"deltaserve k8s render --check: {out / rel} differs from a fresh render", file=sys.stderr)
        return 1 if stale or extra else 0
    changed, deleted = write_tree(out, files)
    print(f"deltaserve k8s render: {len(files)} files under {out} ({len(changed)} written, {len(deleted)} removed)")
    return 0


def _extra_files(out: Path, files: dict[str, bytes]) -> list[str]:
    """Files under the generated directories that a render would delete."""
    from deployments.kube.render import GENERATED_DIRS

    return [rel for top in GENERATED_DIRS if (out / top).is_dir() for p in sorted((out / top).rglob("*"))
            if p.is_file() and (rel := p.relative_to(out).as_posix()) not in files]


def add_k8s_parser(sub) -> None:
    p = sub.add_parser("k8s", help="Kubernetes manifests (kustomize base + overlays cpu, gpu)")
    ks = p.add_subparsers(dest="k8s_command", required=True)
    r = ks.add_parser("render", help="write the kustomize tree from the platform config")
    r.add_argument("--out", default="k8s", help="tree root (default: k8s/ here, the repository's root)")
    r.add_argument("--config", default=None, help="platform config YAML/JSON, as for `deltaserve up` (defaults embedded)")
    r.add_argument("--ops", default="ops", help="ops/ directory to take the collector config, dashboards and rules "
                   "from (default: ops/ here)")
    r.add_argument("--prometheus-url", default="http://prometheus-operated.monitoring.svc:9090",
                   help="Grafana's Prometheus datasource: the Prometheus operator's Prometheus")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 if the tree differs from a fresh render")
    r.set_defaults(func=render)
