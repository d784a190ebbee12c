"""Make a CA and a webhook serving certificate, for local and dev clusters.

    python -m certs.make --out DIR --dns instaslice-webhook.instaslice-system.svc --ip 127.0.0.1

writes `ca.crt`, `ca.key`, `tls.crt`, `tls.key` into DIR (keys 0600) and prints the base64
CA bundle for a webhook configuration's `clientConfig.caBundle`. An existing `ca.crt` +
`ca.key` in DIR (or `--ca-cert/--ca-key`) is reused, so renewing the serving certificate
keeps the bundle the apiserver already trusts. In a real cluster use cert-manager
(manifests/base/webhook/certificate.yaml); this tool is the same thing without a controller.

ECDSA P-256 keys, SHA-256 signatures, serverAuth only, SANs from --dns/--ip (the CN is not
used for host checks by Go's TLS client); common/x509.py builds them. Serving certificates
live 90 days by default (from a minute before now): the server reloads renewed files on its
own.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from common.x509 import Kind, issue
from common.x509 import Pair as KeyPair

__all__ = ["KeyPair", "ca_bundle", "main", "make_ca", "make_serving_cert", "write_pair"]


def make_ca(
    common_name: str = "instaslice-webhook-ca",
    *,
    days: int = 3650,
    now: dt.datetime | None = None,
) -> KeyPair:
    """A self-signed CA certificate and key."""
    now = now or dt.datetime.now(dt.UTC)
    return issue(Kind.CA, common_name, now=now, valid_for=dt.timedelta(days=days))


def make_serving_cert(
    ca: KeyPair,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
    *,
    days: int = 90,
    now: dt.datetime | None = None,
) -> KeyPair:
    """A TLS serving certificate for `dns` names and `ips`, signed by `ca`."""
    names = [*dns, *ips]  # none: issue() refuses
    return issue(
        Kind.SERVER,
        names[0] if names else "",
        issuer=ca,
        dns=dns,
        ips=ips,
        now=now or dt.datetime.now(dt.UTC),
        valid_for=dt.timedelta(days=days),
    )


def ca_bundle(ca: KeyPair) -> str:
    """The base64 form a webhook configuration's `clientConfig.caBundle` takes."""
    return base64.b64encode(ca.cert_pem).decode("ascii")


def write_pair(pair: KeyPair, cert_path: Path, key_path: Path) -> None:
    """Write atomically (rename), the key 0600: a watching server never sees half a file."""
    for path, data, mode in ((key_path, pair.key_pem, 0o600), (cert_path, pair.cert_pem, 0o644)):
        tmp = path.with_name(f".{path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m certs.make", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory to write into")
    p.add_argument("--dns", action="append", default=[], help="DNS SAN (repeatable)")
    p.add_argument("--ip", action="append", default=[], help="IP SAN (repeatable)")
    p.add_argument("--ca-cert", type=Path, help="existing CA certificate (default: OUT/ca.crt)")
    p.add_argument("--ca-key", type=Path, help="existing CA key (default: OUT/ca.key)")
    p.add_argument("--days", type=int, default=90, help="serving certificate lifetime")
    args = p.parse_args(argv)
    if not args.dns and not args.ip:
        p.error("give at least one --dns or --ip")
    try:
        for ip in args.ip:
            ipaddress.ip_address(ip)
    except ValueError as exc:
        p.error(str(exc))
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    ca_cert: Path = args.ca_cert or out / "ca.crt"
    ca_key: Path = args.ca_key or out / "ca.key"
    if ca_cert.exists() and ca_key.exists():
        ca = KeyPair(ca_cert.read_bytes(), ca_key.read_bytes())
    elif args.ca_cert or args.ca_key:
        p.error(f"CA files not found: {ca_cert}, {ca_key}")
    else:
        ca = make_ca()
        write_pair(ca, ca_cert, ca_key)
    write_pair(
        make_serving_cert(ca, args.dns, args.ip, days=args.days), out / "tls.crt", out / "tls.key"
    )
    print(ca_bundle(ca))
    return 0


if __name__ == "__main__":
    sys.exit(main())
