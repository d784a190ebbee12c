"""Make a CA and a webhook serving certificate, for local and dev clusters.

    python -m certs.make --out DIR --dns instaslice-webhook.instaslice-system.svc --ip 127.0.0.1

writes `ca.crt`, `ca.key`, `tls.crt`, `tls.key` into DIR (keys 0600) and prints the base64
CA bundle for a webhook configuration's `clientConfig.caBundle`. An existing `ca.crt` +
`ca.key` in DIR (or `--ca-cert/--ca-key`) is reused, so renewing the serving certificate
keeps the bundle the apiserver already trusts. In a real cluster use cert-manager
(manifests/base/webhook/certificate.yaml); this tool is the same thing without a controller.

ECDSA P-256 keys, SHA-256 signatures, serverAuth only, SANs from --dns/--ip (the CN is not
used for host checks by Go's TLS client). Serving certificates live 90 days by default: the
server reloads renewed files on its own.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_BACKDATE = dt.timedelta(minutes=5)  # tolerate clock skew between this host and the cluster


@dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, PEM."""

    cert_pem: bytes
    key_pem: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def key_usage(*, ca: bool) -> x509.KeyUsage:
    """Digital signatures; for a CA, signing certificates and CRLs too (also the test
    control plane's, hack/cluster/pki.py)."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(
    common_name: str = "instaslice-webhook-ca",
    *,
    days: int = 3650,
    now: dt.datetime | None = None,
) -> KeyPair:
    """A self-signed CA certificate and key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    start = (now or dt.datetime.now(dt.UTC)) - _BACKDATE
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(key_usage(ca=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def make_serving_cert(
    ca: KeyPair,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
    *,
    days: int = 90,
    now: dt.datetime | None = None,
) -> KeyPair:
    """A TLS serving certificate for `dns` names and `ips`, signed by `ca`."""
    if not dns and not ips:
        raise ValueError("a serving certificate needs at least one DNS name or IP address")
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("the CA key must be an EC key (as make_ca makes)")
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    key = ec.generate_private_key(ec.SECP256R1())
    start = (now or dt.datetime.now(dt.UTC)) - _BACKDATE
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (dns or ips)[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


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
