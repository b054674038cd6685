"""A job's own certificate authority and its rollout servers' certificate (TLS between the
trainer and the rollout servers, grpo_api.rpc).

Each job gets a fresh CA that signs one server certificate for the names the servers are
reached by; the trainer trusts only that CA. The CA's private key is dropped as soon as the
certificate is signed, so nothing else can ever be signed by it: the job's Secret (or a
`grpo run`'s memory) holds only the CA certificate, the server certificate and its key.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=3650)
"""As long as a job (and its Secret, created once) may live, suspended ones included."""
_CLOCK_SKEW = datetime.timedelta(hours=1)


@dataclass(frozen=True)
class JobTLS:
    ca_cert: str
    """The job's CA certificate (PEM): what the trainer trusts."""
    cert: str
    """The rollout servers' certificate (PEM), signed by the CA."""
    key: str
    """Its private key (PEM, PKCS#8)."""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def make_job_tls(job: str, dns_names: Sequence[str], ips: Sequence[str] = ()) -> JobTLS:
    """A new CA for `job` and a server certificate for `dns_names` and `ips` (ECDSA P-256)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"grpo job {job} CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - _CLOCK_SKEW).not_valid_after(now + VALIDITY)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    alt_names = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder().subject_name(_name(dns_names[0])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW).not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return JobTLS(
        ca_cert=ca.public_bytes(pem).decode(),
        cert=cert.public_bytes(pem).decode(),
        key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode())
