"""TLS checks for tests: a handshake in memory, and what a certificate's extensions say.

`handshake` runs a server and a client context against each other through memory BIOs (no
socket, no event loop), so a test sees exactly what a peer's verification decides.
`extensions` reduces a certificate's extensions to plain values a table can hold.
"""

from __future__ import annotations

import ssl

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

__all__ = ["extensions", "handshake", "peer_chain_leaf"]

_KEY_USAGES = (
    "digital_signature",
    "content_commitment",
    "key_encipherment",
    "data_encipherment",
    "key_agreement",
    "key_cert_sign",
    "crl_sign",
)
_EKU_NAMES = {
    ExtendedKeyUsageOID.SERVER_AUTH: "serverAuth",
    ExtendedKeyUsageOID.CLIENT_AUTH: "clientAuth",
}


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, host: str | None) -> ssl.SSLObject:
    """Complete a handshake between `server` and `client` (which checks `host`); the client
    side's SSLObject. Raises what the client's verification raises."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    cli = client.wrap_bio(c_in, c_out, server_hostname=host)
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        done = 0
        for side, out, peer_in in ((cli, c_out, s_in), (srv, s_out, c_in)):
            try:
                side.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
            peer_in.write(out.read())
        if done == 2:
            return cli
    raise AssertionError("handshake did not finish")


def peer_chain_leaf(server: ssl.SSLContext) -> x509.Certificate:
    """The certificate `server` presents, read by a client that verifies nothing."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    der = handshake(server, client, None).getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def extensions(cert: x509.Certificate, issuer: x509.Certificate) -> dict[str, tuple[bool, str]]:
    """Each extension of `cert` by name: (critical, its value in words). Key identifiers are
    checked here (`own` / `issuer's` when they match the keys, else the hex)."""
    out: dict[str, tuple[bool, str]] = {}
    for ext in cert.extensions:
        v = ext.value
        if isinstance(v, x509.BasicConstraints):
            words = f"ca={v.ca} pathlen={v.path_length}"
        elif isinstance(v, x509.KeyUsage):
            words = " ".join(u for u in _KEY_USAGES if getattr(v, u))
        elif isinstance(v, x509.ExtendedKeyUsage):
            words = " ".join(_EKU_NAMES.get(o, o.dotted_string) for o in v)
        elif isinstance(v, x509.SubjectAlternativeName):
            dns = v.get_values_for_type(x509.DNSName)
            words = " ".join([*dns, *(str(i) for i in v.get_values_for_type(x509.IPAddress))])
        elif isinstance(v, x509.SubjectKeyIdentifier):
            own = x509.SubjectKeyIdentifier.from_public_key(cert.public_key()).digest
            words = "own" if v.digest == own else v.digest.hex()
        elif isinstance(v, x509.AuthorityKeyIdentifier):
            ski = x509.SubjectKeyIdentifier.from_public_key(issuer.public_key())
            words = "issuer's" if v.key_identifier == ski.digest else repr(v)
        else:
            words = repr(v)
        out[type(v).__name__] = (ext.critical, words)
    return out
