"""Certificates made in the test: a CA, a server certificate for 127.0.0.1/localhost, client ones."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

VALIDITY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(dirpath: Path, stem: str, cert: x509.Certificate, key) -> Pem:
    cert_path, key_path = dirpath / f"{stem}.crt", dirpath / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Pem(cert_path, key_path)


def _builder(subject: str, issuer: str, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY))


class TestCA:
    __test__ = False  # not a pytest class

    def __init__(self, dirpath: Path, name: str = "specdec test CA"):
        self.dir = dirpath
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        cert = (_builder(name, name, self.key.public_key())
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        self.pem = _write(dirpath, name.replace(" ", "-"), cert, self.key)

    def issue(self, cn: str, *, server: bool) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = _builder(cn, self.name, key.public_key())
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return _write(self.dir, cn, cert, key)
