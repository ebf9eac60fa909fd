"""Certificates for the secured servers of the tests and the demo, made when they start.

``trustme`` makes a new CA and a server certificate for 127.0.0.1 and localhost each time
(never checked in); keys are written as unencrypted PKCS#8, the form both the Kafka
broker's and Elasticsearch's PEM key stores take.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import trustme
from cryptography.hazmat.primitives import serialization

#: The file stem of the expired certificate :func:`make_certificates` can add.
EXPIRED_CERTIFICATE = "server-expired"


def pkcs8(key_pem: bytes) -> str:
    """``key_pem`` as unencrypted PKCS#8 (trustme writes its key algorithm's own form)."""
    key = serialization.load_pem_private_key(key_pem, password=None)
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def make_certificates(
    folder: Path, stem: str, *, expired_too: bool = False
) -> tuple[Path, Path, Path]:
    """A new CA (``ca.pem``), a server's certificate chain and key, in ``folder``.

    ``<stem>.pem`` and ``<stem>-key.pem`` (readable by its owner only) name 127.0.0.1 and
    localhost. ``expired_too``: also :data:`EXPIRED_CERTIFICATE` ``.pem`` and its key, the
    same names signed by the same CA but valid only until yesterday.
    """
    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    ca_file = folder / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    certificate_file, key_file = _write_leaf(ca.issue_cert("127.0.0.1", "localhost"), folder, stem)
    if expired_too:
        now = dt.datetime.now(dt.UTC)
        expired = ca.issue_cert(
            "127.0.0.1",
            "localhost",
            not_before=now - dt.timedelta(days=30),
            not_after=now - dt.timedelta(days=1),
        )
        _write_leaf(expired, folder, EXPIRED_CERTIFICATE)
    return ca_file, certificate_file, key_file


def _write_leaf(leaf: trustme.LeafCert, folder: Path, stem: str) -> tuple[Path, Path]:
    """``<stem>.pem`` (the chain) and ``<stem>-key.pem`` (PKCS#8, mode 0600) in ``folder``."""
    certificate_file = folder / f"{stem}.pem"
    certificate_file.write_text("".join(p.bytes().decode() for p in leaf.cert_chain_pems))
    key_file = folder / f"{stem}-key.pem"
    key_file.touch(mode=0o600)
    key_file.write_text(pkcs8(leaf.private_key_pem.bytes()))
    return certificate_file, key_file
