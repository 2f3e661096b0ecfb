"""A quick look at the first reachable broker before a Kafka client is made, to name a setup mistake.

kafka-python retries a failed TLS handshake (an untrusted certificate, a wrong
hostname, a PLAINTEXT listener) and a closed connection (a TLS or SASL listener
spoken to in plain text) until ``bootstrap_timeout_ms`` runs out, then reports only
"Unable to bootstrap". These mistakes never heal by waiting, so before the client
is made kstore opens one connection itself, with the same TLS context, and asks:

1. Does the TLS handshake succeed? If not, why: the broker's certificate is not
   trusted or not for this host, the listener does not speak TLS, or the broker
   refused the client certificate (or needs one).
2. Does the broker answer an ApiVersions request? A TLS listener spoken to in plain
   text closes the connection: that is confirmed with a second, TLS connection.
3. With SASL: does the broker enable the mechanism (SaslHandshake), and does it
   accept the credentials (PLAIN, SCRAM, OAUTHBEARER, through kafka-python's own
   mechanism classes, when kafka-python is installed: without it, the client checks the
   credentials)? kafka-python retries a refused login until its timeout too,
   as the broker closes the connection right after refusing. Without SASL: does it
   answer a Metadata request (a SASL listener closes the connection instead)?

``config`` is what the probe takes besides the settings: the TLS context (``ssl_context``), a
token provider (``sasl_oauth_token_provider``), a proxy (``proxy_url``, ``socks5_proxy``: no probe);
:func:`kstore.kafka.security.probe_config` makes it without a client library.

Before that, the connection itself: a refused one or a name that does not resolve, at every
bootstrap address, is tried again briefly (:data:`ABSENT_TRIES`, a broker restarting is back by
then) and then reported at once, where kafka-python and librdkafka would wait out
``connect_timeout_s`` in silence.

A clear answer raises :class:`~kstore.errors.BrokerError`; anything else (a broker that does not
answer, a timeout, a proxy in between) lets the client try as usual.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kstore.errors import BrokerError

if TYPE_CHECKING:
    from kstore.settings import Settings

log = logging.getLogger(__name__)

_API_VERSIONS, _METADATA, _SASL_HANDSHAKE, _SASL_AUTHENTICATE = 18, 3, 17, 36
#: Mechanisms the probe logs in with (kafka-python's own implementation); GSSAPI and
#: AWS_MSK_IAM need outside parts and are left to the client.
_AUTHENTICATED_HERE = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
_UNSUPPORTED_SASL_MECHANISM = 33
#: Metadata versions whose request is the topics array and the auto-create flag (v8 adds two flags).
_METADATA_VERSIONS = range(4, 8)
_PROBE_TIMEOUT_S = 10.0
#: A broker that cannot be there (its port refuses connections, its name does not resolve) is tried
#: this many times, this far apart, before kstore says so: a broker restarting is back by then, and
#: the 30 s of ``connect_timeout_s`` are kept for a broker that does not answer at all.
ABSENT_TRIES = 3
ABSENT_RETRY_DELAY_S = 1.0
_CLIENT_ID = b"kstore-probe"


class _Inconclusive(Exception):
    """The probe learned nothing certain: let the client try."""


class _TlsRecord(Exception):
    """A plain-text request got a TLS record back (an alert): the listener speaks TLS."""


def probe(settings: Settings, config: Mapping[str, Any], *, sleep: Callable[[float], None] = time.sleep) -> None:
    """Raise BrokerError naming the cause if the first reachable broker clearly cannot work, or if
    no broker can be there at all (see :func:`_absent`)."""
    if config.get("proxy_url") or config.get("socks5_proxy"):
        return
    timeout = min(_PROBE_TIMEOUT_S, max(1.0, settings.connect_timeout_s))
    servers = [_split_address(server.strip()) for server in settings.bootstrap_servers.split(",")]
    for attempt in range(1, ABSENT_TRIES + 1):
        absent = []
        for host, port in servers:
            try:
                sock = socket.create_connection((host, port), timeout=timeout)
            except OSError as exc:
                why = _absent(exc, host)
                if why is None:
                    return  # silence, or no answer yet: the client waits for it as it always does
                absent.append(why if len(servers) == 1 else f"{host}:{port}: {why}")
                continue
            try:
                _check(sock, host, port, settings, config)
            except _Inconclusive:
                pass
            finally:
                sock.close()
            return
        if attempt < ABSENT_TRIES:
            log.debug("Kafka at %s: %s; trying again in %gs", settings.bootstrap_servers, "; ".join(absent),
                      ABSENT_RETRY_DELAY_S)
            sleep(ABSENT_RETRY_DELAY_S)
    took = ABSENT_RETRY_DELAY_S * (ABSENT_TRIES - 1)
    raise BrokerError(f"cannot reach Kafka at {settings.bootstrap_servers}: {'; '.join(absent)}; check "
                      f"--bootstrap-servers (tried {ABSENT_TRIES} times in {took:g}s)")


def _absent(exc: OSError, host: str) -> str | None:
    """Why no broker can be at an address, from the error connecting to it: nothing listens on the
    port (refused) or the name does not resolve. None for what waiting can end: no answer at all (a
    firewall that drops, a host that is down), a name server that does not answer."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror) and exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)):
        return f"the name {host!r} does not resolve"
    return None


def _split_address(server: str) -> tuple[str, int]:
    host, _, port = server.rpartition(":")
    if not host:  # no port given: kafka-python's default
        return server, 9092
    return host.strip("[]"), int(port)


def _check(sock: socket.socket, host: str, port: int, settings: Settings, config: Mapping[str, Any]) -> None:
    where, protocol = f"{host}:{port}", settings.security_protocol
    context: ssl.SSLContext | None = config.get("ssl_context")
    has_certificate = bool(settings.ssl_certfile)
    stream: socket.socket = sock
    if context is not None:
        stream = _handshake(context, sock, host, where, has_certificate)
    with _answers(where, context is not None, has_certificate):
        versions = _api_versions(_round_trip(stream, _request(_API_VERSIONS, 0, b"")))
        if settings.sasl_mechanism:
            _sasl(stream, host, where, settings, settings.sasl_mechanism, config, versions)
            return
        metadata = next((v for v in reversed(_METADATA_VERSIONS) if v in versions.get(_METADATA, ())), None)
        if metadata is None:
            return
        try:
            _round_trip(stream, _request(_METADATA, metadata, struct.pack(">ib", 0, 0)))
        except (ConnectionError, EOFError):
            raise BrokerError(
                f"Kafka at {where} closed the connection at the first request after ApiVersions: it expects SASL "
                f"authentication; set security_protocol to {'SASL_SSL' if context is not None else 'SASL_PLAINTEXT'}"
                f" and a sasl_mechanism (security_protocol is {protocol})") from None


def _sasl(stream: socket.socket, host: str, where: str, settings: Settings, mechanism_name: str,
          config: Mapping[str, Any], versions: Mapping[int, range]) -> None:
    """SaslHandshake, then (for the mechanisms that need nothing outside kstore) the authentication itself:
    kafka-python retries a refused login until its timeout, as the broker closes right after refusing."""
    error, enabled = _sasl_handshake(_round_trip(stream, _request(_SASL_HANDSHAKE, 1, _string(mechanism_name))))
    if error == _UNSUPPORTED_SASL_MECHANISM:
        raise BrokerError(f"Kafka at {where} does not enable SASL mechanism {mechanism_name} "
                          f"on this listener; it enables: {', '.join(enabled) or 'none'}")
    if error != 0 or mechanism_name not in _AUTHENTICATED_HERE:
        return
    mechanism = _mechanism(mechanism_name, host, settings, config)
    if mechanism is None:
        return
    version = 1 if 1 in versions.get(_SASL_AUTHENTICATE, range(0, 2)) else 0
    while not mechanism.is_done():
        body = _round_trip(stream, _request(_SASL_AUTHENTICATE, version, _bytes(mechanism.auth_bytes())))
        code, message, answer = _sasl_authenticate(body)
        if code != 0:
            who = f" as user {settings.sasl_username!r}" if settings.sasl_username else ""
            raise BrokerError(f"Kafka at {where} refused SASL {mechanism_name} authentication{who}: "
                              f"{message or f'error {code}'}")
        mechanism.receive(answer)


def _mechanism(name: str, host: str, settings: Settings, config: Mapping[str, Any]) -> Any:
    """kafka-python's implementation of a SASL mechanism, set up with the credentials; None without
    kafka-python (the SCRAM exchange is not written again here: the client checks the credentials)."""
    try:
        from kafka.net.sasl import get_sasl_mechanism
        from kafka.net.sasl.oauth import AbstractTokenProvider
    except ImportError:
        log.debug("probe: kafka-python is not installed, so the SASL %s credentials are left to the client", name)
        return None
    sasl: dict[str, Any] = {"sasl_mechanism": name, "sasl_plain_username": settings.sasl_username,
                            "sasl_plain_password": settings.sasl_password}
    given: Any = config.get("sasl_oauth_token_provider")
    if given is not None and not isinstance(given, AbstractTokenProvider):

        class _Provider(AbstractTokenProvider):  # type: ignore[misc]
            def token(self) -> str:
                return str(provider.token())

        provider, given = given, _Provider()
    if given is not None:
        sasl["sasl_oauth_token_provider"] = given
    return get_sasl_mechanism(name)(host=host, **sasl)


def _handshake(context: ssl.SSLContext, sock: socket.socket, host: str, where: str,
               has_certificate: bool) -> socket.socket:
    try:
        return context.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as exc:
        raise BrokerError(f"Kafka at {where}: {_verify_failure(exc, host)}") from None
    except ssl.SSLError as exc:
        raise BrokerError(f"Kafka at {where}: {_tls_failure(exc, has_certificate)}") from None
    except (ConnectionError, EOFError):
        raise BrokerError(f"Kafka at {where} closed the connection during the TLS handshake: is it a TLS "
                          "listener? (security_protocol is SSL or SASL_SSL)") from None
    except OSError as exc:
        raise _Inconclusive() from exc


def _verify_failure(exc: ssl.SSLCertVerificationError, host: str) -> str:
    code, message = exc.verify_code, exc.verify_message
    if code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
        return (f"the broker's TLS certificate is not for {host!r} ({message}): connect by a name the "
                "certificate lists, or turn hostname verification off (ssl_check_hostname=false) only if you must")
    if code in (9, 10):  # not yet valid, expired
        return f"the broker's TLS certificate {message}"
    return (f"the broker's TLS certificate is not trusted ({message}): give the CA that signed it as ssl_cafile")


def _tls_failure(exc: ssl.SSLError, has_certificate: bool) -> str:
    reason = str(exc.reason or exc)
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST",
                  "UNEXPECTED_EOF_WHILE_READING", "UNSUPPORTED_PROTOCOL"):
        return (f"the listener does not speak TLS ({reason}): is it PLAINTEXT or SASL_PLAINTEXT? "
                "(security_protocol is SSL or SASL_SSL)")
    refused = "CERTIFICATE" in reason or "UNKNOWN_CA" in reason or reason.endswith("ALERT_HANDSHAKE_FAILURE")
    if refused and not has_certificate:
        return f"the broker requires a client certificate ({reason}): give ssl_certfile and ssl_keyfile"
    if "CERTIFICATE_EXPIRED" in reason:
        return f"the broker refused the client certificate: it has expired ({reason})"
    if refused:
        return (f"the broker refused the client certificate ({reason}): is it signed by a CA the broker "
                "trusts, and still valid?")
    return f"TLS failed: {reason}"


@contextlib.contextmanager
def _answers(where: str, tls: bool, has_certificate: bool) -> Iterator[None]:
    """Turn what a first request can meet into a diagnosis (or an inconclusive probe)."""
    try:
        yield
    except ssl.SSLError as exc:  # TLS 1.3: the broker's verdict on the client certificate comes after the handshake
        raise BrokerError(f"Kafka at {where}: {_tls_failure(exc, has_certificate)}") from None
    except _TlsRecord:
        raise BrokerError(f"Kafka at {where} is a TLS listener: set security_protocol to SSL or SASL_SSL "
                          "(it answered a plain-text request with a TLS alert)") from None
    except (ConnectionError, EOFError):
        if not tls and _speaks_tls(where):
            raise BrokerError(f"Kafka at {where} is a TLS listener: set security_protocol to SSL or SASL_SSL "
                              "(a plain-text client gets its connection closed)") from None
        raise _Inconclusive() from None
    except (OSError, struct.error, ValueError) as exc:
        raise _Inconclusive() from exc


def _speaks_tls(where: str) -> bool:
    """Whether a TLS handshake (certificates not checked: only the protocol matters) succeeds."""
    host, port = _split_address(where)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S) as sock, \
                context.wrap_socket(sock, server_hostname=host):
            return True
    except ssl.SSLError as exc:  # the handshake got far enough to fail on a TLS alert: it is TLS
        return "ALERT" in str(exc.reason or "")
    except OSError:
        return False


# --- the Kafka wire, just enough of it -------------------------------------------------------------

def _request(api_key: int, version: int, body: bytes) -> bytes:
    header = struct.pack(">hhih", api_key, version, 1, len(_CLIENT_ID)) + _CLIENT_ID
    return struct.pack(">i", len(header) + len(body)) + header + body


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


def _bytes(raw: bytes) -> bytes:
    return struct.pack(">i", len(raw)) + raw


def _round_trip(stream: socket.socket, request: bytes) -> bytes:
    stream.sendall(request)
    head = _read(stream, 4)
    if head[0] in (0x15, 0x16) and head[1] == 0x03:  # a TLS alert or handshake record, not a Kafka size
        raise _TlsRecord()
    (size,) = struct.unpack(">i", head)
    if not 4 <= size <= 1 << 20:
        raise ValueError(f"implausible response size {size}")
    return _read(stream, size)[4:]  # without the correlation id


def _read(stream: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = stream.recv(n - len(out))
        if not chunk:
            raise EOFError("the broker closed the connection")
        out += chunk
    return bytes(out)


def _api_versions(body: bytes) -> dict[int, range]:
    error, count = struct.unpack_from(">hi", body, 0)
    versions: dict[int, range] = {}
    for i in range(max(0, count) if error == 0 else 0):
        key, low, high = struct.unpack_from(">hhh", body, 6 + 6 * i)
        versions[key] = range(low, high + 1)
    return versions


def _sasl_handshake(body: bytes) -> tuple[int, list[str]]:
    error, count = struct.unpack_from(">hi", body, 0)
    pos, enabled = 6, []
    for _ in range(max(0, count)):
        (length,) = struct.unpack_from(">h", body, pos)
        enabled.append(body[pos + 2:pos + 2 + length].decode(errors="replace"))
        pos += 2 + length
    return error, enabled


def _sasl_authenticate(body: bytes) -> tuple[int, str | None, bytes]:
    """SaslAuthenticate v0/v1: error code, error message, the server's auth bytes."""
    error, length = struct.unpack_from(">hh", body, 0)
    message = body[4:4 + length].decode(errors="replace") if length >= 0 else None
    pos = 4 + max(0, length)
    (size,) = struct.unpack_from(">i", body, pos)
    return error, message, body[pos + 4:pos + 4 + max(0, size)]
