"""`kubectl instaslice`: the command line around the plugin's views (common/plugin_view.py).

Commands: `nodes`, `pods`, `gather` (common/gather.py), `kueue-config` (common/quota.py),
`version`, `completion` (common/plugin_complete.py). Every cluster read goes through the
user's kubectl with kubectl's own connection flags passed on (common/kubectl.py), so the
kubeconfig rules, the context's namespace and impersonation are kubectl's. This module parses
the command line, runs the lists, and prints; rendering is pure and tested without a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from common.catalog import load_catalog
from common.gather import NAMESPACE, gather
from common.kubectl import Connection, KubectlError, kubectl_runner, list_items
from common.plugin_complete import candidates, completion_script, kubectl_names
from common.plugin_view import dump, gpu_rows, pod_rows, render_nodes, render_pods
from common.quota import kueue_resources, resource_flavors
from common.version import VERSION

__all__ = ["build_parser", "dump", "gpu_rows", "main", "pod_rows", "render_nodes", "render_pods"]

SLICE_ALLOCATIONS = "sliceallocations.instaslice.io"
MIG_NODES = "mignodes.instaslice.io"
DESCRIPTION = """\
Show which pod holds which NVIDIA MIG slice, per node and GPU, on a cluster running
InstaSlice; pack a bug report; print Kueue's configuration for MIG quotas.

Reads through kubectl (the one on PATH, or --kubectl) with the connection flags given here,
so KUBECONFIG, contexts, namespaces and impersonation work as they do for kubectl."""
EXAMPLES = """\
examples:
  kubectl instaslice nodes                 # each GPU's memory slots and who holds them
  kubectl instaslice pods                  # slices in the context's namespace
  kubectl instaslice pods -A -o wide       # every namespace, with each allocation's name
  kubectl instaslice gather                # instaslice-gather-<time>.tar.gz for a bug report
  kubectl instaslice completion bash       # shell completion (see its --help)"""


def _connection_flags(suppress: bool) -> argparse.ArgumentParser:
    """kubectl's global flags, accepted before or after the command. On the commands'
    parsers their default is SUPPRESS, so a flag given before the command is not reset."""
    p = argparse.ArgumentParser(add_help=False)
    group = p.add_argument_group("connection (kubectl's own flags, passed on to it)")
    default: Any = argparse.SUPPRESS if suppress else None
    specs: tuple[tuple[list[str], dict[str, Any]], ...] = (
        (["--kubeconfig"], {"help": "kubeconfig file (default: KUBECONFIG, ~/.kube/config)"}),
        (["--context"], {"help": "kubeconfig context (default: the current one)"}),
        (["--cluster"], {"help": "kubeconfig cluster"}),
        (["--user"], {"help": "kubeconfig user"}),
        (["--as"], {"dest": "as_user", "metavar": "USER", "help": "impersonate USER"}),
        (["--as-group"], {"dest": "as_groups", "metavar": "GROUP", "action": "append",
                          "help": "impersonate GROUP (repeatable)"}),
        (["--request-timeout"], {"metavar": "DURATION",
                                 "help": "per request, kubectl's format (5s, 1m; 0: none)"}),
        (["--kubectl"], {"help": "the kubectl (or oc) to run (default: $KUBECTL, PATH)"}),
    )  # fmt: skip
    for flags, extra in specs:
        group.add_argument(*flags, default=default, **extra)
    return p


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="kubectl instaslice", description=DESCRIPTION, epilog=EXAMPLES,
        formatter_class=fmt, parents=[_connection_flags(suppress=False)],
    )  # fmt: skip
    sub = parser.add_subparsers(dest="what", metavar="COMMAND", required=True)
    conn = _connection_flags(suppress=True)

    def command(name: str, summary: str, epilog: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=summary, description=summary, epilog=epilog, parents=[conn]
        )

    def printing(p: argparse.ArgumentParser) -> None:
        p.add_argument("-o", "--output", choices=["wide", "json", "yaml"], default=None,
                       help="wide: more columns; json|yaml: the rows as data")  # fmt: skip
        p.add_argument("--no-headers", action="store_true", help="no header line")

    nodes = command("nodes", "per node and GPU: memory slots and who holds them",
                    "Letters: slots a pod's slice holds (legend below the map); '#': an instance "
                    "no live allocation holds; '.': free.")  # fmt: skip
    printing(nodes)
    pods = command("pods", "one line per slice: pod, node, GPU, profile, MIG UUID",
                   "Without -n or -A: the kubeconfig context's namespace (kubectl's rule). "
                   "A tenant may read only namespaces where they hold view or edit.")  # fmt: skip
    scope = pods.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", default=None,
                       help="this namespace (default: the context's)")  # fmt: skip
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    printing(pods)
    g = command("gather", "write an archive with what a bug report needs",
                "Collects InstaSlice's objects, events and logs, the GPU Operator's "
                "ClusterPolicy, and through each node agent's pod its --discover-only report and "
                "the CDI directories. Never Secrets; look before sharing.")  # fmt: skip
    g.add_argument("-n", "--namespace", default=NAMESPACE,
                   help=f"the namespace InstaSlice runs in (default {NAMESPACE})")  # fmt: skip
    g.add_argument("--dest", type=Path, default=None,
                   help="the archive (default: instaslice-gather-<time>.tar.gz)")  # fmt: skip
    g.add_argument("--tail", type=int, default=2000, help="log lines per pod (default 2000)")
    k = command("kueue-config", "print Kueue's resource transformations and flavors")
    k.add_argument("--slot-accounting", action="store_true",
                   help="the webhook runs with --slot-accounting (docs/kueue.md)")  # fmt: skip
    v = command("version", "print the plugin's version and the node agents' (from MigNodes)")
    v.add_argument("--client", action="store_true", help="the plugin's version only")
    v.add_argument("-o", "--output", choices=["json", "yaml"], default=None)
    c = command("completion", "print a shell completion script",
                "bash|zsh: source it, e.g. `source <(kubectl-instaslice completion bash)` for "
                "the kubectl-instaslice command. kubectl: save it as an executable named "
                "kubectl_complete-instaslice on PATH, and `kubectl instaslice <TAB>` completes "
                "(kubectl 1.26 or newer).")  # fmt: skip
    c.add_argument("shell", choices=["bash", "zsh", "kubectl"])
    return parser


def kueue_config(slot_accounting: bool) -> str:
    """Kueue's `resources` configuration and one ResourceFlavor per catalog model (YAML)."""
    catalog = load_catalog()
    docs = [
        {"resources": kueue_resources(catalog, slot_accounting=slot_accounting)},
        *resource_flavors(m.name for m in catalog.models),
    ]
    head = (
        "# The first document goes into Kueue's Configuration (config.kueue.x-k8s.io/v1beta2);\n"
        "# the others are ResourceFlavors, one per GPU model (docs/kueue.md).\n"
    )
    return head + yaml.safe_dump_all(docs, sort_keys=False)


def connection(args: argparse.Namespace) -> Connection:
    return Connection(
        kubeconfig=getattr(args, "kubeconfig", None),
        context=getattr(args, "context", None),
        cluster=getattr(args, "cluster", None),
        user=getattr(args, "user", None),
        as_user=getattr(args, "as_user", None),
        as_groups=tuple(getattr(args, "as_groups", None) or ()),
        request_timeout=getattr(args, "request_timeout", None),
    )


def _kubectl(args: argparse.Namespace) -> str | None:
    return (
        getattr(args, "kubectl", None)
        or os.environ.get("KUBECTL")
        or shutil.which("kubectl")
        or shutil.which("oc")
    )


def _show(args: argparse.Namespace, kubectl: str) -> int:
    run = kubectl_runner(kubectl, connection(args))
    every = args.what == "nodes" or args.all_namespaces
    scope = ["-A"] if every else (["-n", args.namespace] if args.namespace else [])
    try:
        allocs = list_items(run, SLICE_ALLOCATIONS, *scope)
        mignodes = list_items(run, MIG_NODES) if args.what == "nodes" else []
    except KubectlError as exc:
        forbidden = "forbidden" in str(exc).lower() and every and args.what == "pods"
        hint = " (a tenant: name your namespace with -n <namespace>)" if forbidden else ""
        print(f"error: {exc}{hint}", file=sys.stderr)
        return 1
    if args.output in ("json", "yaml"):
        rows = gpu_rows(mignodes, allocs) if args.what == "nodes" else pod_rows(allocs)
        print(dump(rows, args.output))
        return 0
    wide, headers = args.output == "wide", not args.no_headers
    if args.what == "nodes":
        text = render_nodes(mignodes, allocs, wide=wide, headers=headers)
    else:
        text = render_pods(allocs, namespace_column=every, wide=wide, headers=headers)
        if not text:
            where = "any namespace" if every else f"namespace {args.namespace or '(current)'}"
            print(f"No slice allocations found in {where}.", file=sys.stderr)
            return 0
    print(text)
    return 0


def _version(args: argparse.Namespace, kubectl: str | None) -> int:
    """The plugin's version and, unless --client, the versions the node agents publish in
    their MigNodes (`status.agent.version`) with how many nodes run each; as kubectl version
    does, an unreachable cluster is an error after the client's line."""
    info: dict[str, Any] = {"pluginVersion": f"v{VERSION}", "python": sys.version.split()[0]}
    error = None
    if kubectl is not None:
        try:
            mignodes = list_items(kubectl_runner(kubectl, connection(args)), MIG_NODES)
            agents = Counter(
                str((m.get("status", {}).get("agent") or {}).get("version", "unknown"))
                for m in mignodes
            )
            info["nodeAgentVersions"] = dict(sorted(agents.items()))
        except KubectlError as exc:
            error = str(exc)
    if args.output == "json":
        print(json.dumps(info, indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump(info, sort_keys=False), end="")
    else:
        print(f"Plugin Version: v{VERSION} (Python {info['python']})")
        if "nodeAgentVersions" in info:
            found = ", ".join(
                f"{v} ({n} node{'s' if n != 1 else ''})"
                for v, n in info["nodeAgentVersions"].items()
            )
            print(f"Node Agent Versions: {found or 'none (no MigNode)'}")
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["__complete"]:  # kubectl_complete-instaslice (`completion kubectl`)
        names = kubectl_names(shutil.which("kubectl"))
        print("\n".join(candidates(parser, argv[1:], names)))
        return 0
    args = parser.parse_args(argv)
    if args.what == "kueue-config":
        print(kueue_config(args.slot_accounting), end="")
        return 0
    if args.what == "version" and args.client:
        return _version(args, None)
    if args.what == "completion":
        print(completion_script(args.shell), end="")
        return 0
    kubectl = _kubectl(args)
    if kubectl is None:
        print("error: kubectl (or oc) is not on PATH: install it, or pass --kubectl",
              file=sys.stderr)  # fmt: skip
        return 1
    if args.what == "version":
        return _version(args, kubectl)
    if args.what == "gather":
        run = kubectl_runner(kubectl, connection(args))
        print(gather(run, args.dest, tail=args.tail, namespace=args.namespace))
        return 0
    return _show(args, kubectl)


if __name__ == "__main__":
    sys.exit(main())
