"""Throwaway certificate authorities and certificates for tests, made with the ``openssl`` CLI.

Nothing here is fit for production: keys are unencrypted (unless asked), the CA's key lies
beside its certificate, and everything lives in a folder the caller deletes. Keys are ECDSA
P-256 (PKCS#8 PEM), which OpenSSL makes in milliseconds (an RSA key takes ~0.1-1 s), and
which Python's ``ssl``, libpq and Kafka's ``ssl.keystore.type=PEM`` all read.

Certificates are signed with ``openssl ca`` rather than ``openssl x509 -req``: only ``ca``
takes an explicit validity window (``-startdate``/``-enddate``) in OpenSSL 3.0, which is how
an already expired certificate is made.

::

    ca = CertificateAuthority.create(tmp / "ca", "test-ca")
    server = ca.issue("server", sans=("IP:127.0.0.1", "DNS:localhost"))
    expired = ca.issue("old-client", expired=True)
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CertificateAuthority", "DevCertError", "KeyPair", "encrypt_key", "openssl_executable"]

_CURVE = "prime256v1"
_VALID_DAYS = 3650
# An expired certificate's window: a month, long past.
_EXPIRED_START = "20200101000000Z"
_EXPIRED_END = "20200201000000Z"
_TIMEOUT = 60.0

# One configuration for every command, so that nothing depends on the system's openssl.cnf.
# `req` needs a distinguished_name section even when -subj gives the name; `ca` needs a
# database, a folder for its copies, a policy and a serial (random here, so no serial file).
_CONFIG = """\
[req]
distinguished_name = req_dn
[req_dn]
[ca]
default_ca = dev_ca
[dev_ca]
database = {index}
new_certs_dir = {issued}
rand_serial = yes
default_md = sha256
policy = any_name
unique_subject = no
email_in_dn = no
[any_name]
commonName = supplied
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
"""
# A leaf's extensions, in a file of its own (with its subjectAltName) for `ca -extfile`.
_LEAF_EXTENSIONS = """\
[leaf_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth,clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


class DevCertError(RuntimeError):
    """``openssl`` is missing or one of its commands failed."""


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM (PKCS#8) private key."""

    cert: Path
    key: Path

    def write_bundle(self, path: Path, *extra_certs: Path) -> Path:
        """Key, certificate and ``extra_certs`` in one PEM file (Kafka's PEM keystore file)."""
        parts = [self.key.read_text(), self.cert.read_text(), *(p.read_text() for p in extra_certs)]
        path.write_text("".join(parts))
        path.chmod(0o600)
        return path


def openssl_executable() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise DevCertError("the 'openssl' command is not on PATH; it is needed to make test certificates")
    return found


def _run(args: Sequence[str], cwd: Path) -> None:
    cmd = [openssl_executable(), *args]
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as exc:
        raise DevCertError(f"openssl did not finish in {_TIMEOUT:.0f} s: {' '.join(args)}") from exc
    if done.returncode != 0:
        raise DevCertError(f"openssl {args[0]} failed (exit {done.returncode}): {done.stderr.strip()}")


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA whose files live in ``directory``; :meth:`issue` writes leaf certificates there."""

    directory: Path
    name: str
    pair: KeyPair

    @property
    def cert(self) -> Path:
        return self.pair.cert

    @property
    def _config(self) -> Path:
        return self.directory / "openssl.cnf"

    @classmethod
    def create(cls, directory: Path, name: str) -> CertificateAuthority:
        """A new self-signed CA (``CN=name``) in ``directory`` (created if needed)."""
        directory.mkdir(parents=True, exist_ok=True)
        issued = directory / "issued"
        issued.mkdir(exist_ok=True)
        index = directory / "index.txt"
        index.write_text("")
        config = directory / "openssl.cnf"
        config.write_text(_CONFIG.format(index=index, issued=issued))
        pair = KeyPair(directory / f"{name}.pem", directory / f"{name}.key")
        _run(
            [
                "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", f"ec_paramgen_curve:{_CURVE}", "-nodes",
                "-keyout", str(pair.key), "-out", str(pair.cert), "-days", str(_VALID_DAYS),
                "-subj", f"/CN={name}", "-config", str(config), "-extensions", "ca_ext",
            ],
            directory,
        )  # fmt: skip
        pair.key.chmod(0o600)
        return cls(directory, name, pair)

    def issue(self, name: str, *, sans: Sequence[str] = (), expired: bool = False) -> KeyPair:
        """A certificate (``CN=name``, usable for server and client auth) signed by this CA.

        ``sans`` are subjectAltName entries such as ``"IP:127.0.0.1"`` or ``"DNS:localhost"``.
        ``expired=True`` makes one valid only for a month in 2020, so every peer refuses it.
        """
        pair = KeyPair(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        csr = self.directory / f"{name}.csr"
        _run(
            [
                "req", "-new", "-newkey", "ec", "-pkeyopt", f"ec_paramgen_curve:{_CURVE}", "-nodes",
                "-keyout", str(pair.key), "-out", str(csr), "-subj", f"/CN={name}", "-config", str(self._config),
            ],
            self.directory,
        )  # fmt: skip
        pair.key.chmod(0o600)
        extensions = self.directory / f"{name}.ext"
        san = f"subjectAltName = {','.join(sans)}\n" if sans else ""
        extensions.write_text(_LEAF_EXTENSIONS + san)
        validity = ["-startdate", _EXPIRED_START, "-enddate", _EXPIRED_END] if expired else ["-days", str(_VALID_DAYS)]
        _run(
            [
                "ca", "-batch", "-notext", "-config", str(self._config), "-cert", str(self.cert),
                "-keyfile", str(self.pair.key), "-in", str(csr), "-out", str(pair.cert),
                "-extfile", str(extensions), "-extensions", "leaf_ext", *validity,
            ],
            self.directory,
        )  # fmt: skip
        return pair


def encrypt_key(key: Path, out: Path, password: str) -> Path:
    """``key`` as an encrypted PKCS#8 PEM (AES-256) in ``out``."""
    _run(
        [
            "pkcs8", "-topk8", "-v2", "aes-256-cbc", "-in", str(key), "-out", str(out),
            "-passout", f"pass:{password}",
        ],
        out.parent,
    )  # fmt: skip
    out.chmod(0o600)
    return out
