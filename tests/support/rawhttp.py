"""A loopback server that answers each request with bytes the test scripts, and counts
the connections it accepted: for the framing, keep-alive and TLS of outbound requests."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Seen:
    """What the server saw: connections accepted, and each request's head (by connection)."""

    connections: int = 0
    heads: list[tuple[int, bytes]] = field(default_factory=list)
    closed: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))


#: The answer to a request: (bytes to send, then close the connection?), given the
#: request's number (from 0) across all connections. ``Seen.closed`` is released each
#: time the server has closed a connection so.
Script = Callable[[int], tuple[bytes, bool]]


@contextmanager
def raw_server(script: Script, *, tls: ssl.SSLContext | None = None,
               read_body: bool = True) -> Iterator[tuple[int, Seen]]:
    """Serve on loopback until the block ends; ``read_body=False`` answers after the
    request's head, reading none of its body."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen = Seen()
    lock = threading.Lock()

    def serve(conn: socket.socket, number: int) -> None:
        buffer = b""
        with conn:
            if tls is not None:
                try:
                    conn = tls.wrap_socket(conn, server_side=True)
                except (OSError, ssl.SSLError):
                    return  # the client refused our certificate
            while True:
                while b"\r\n\r\n" not in buffer:
                    if not (data := _received(conn)):
                        return  # the client went away
                    buffer += data
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while read_body and len(buffer) < length:
                    if not (data := _received(conn)):
                        return
                    buffer += data
                buffer = buffer[length:] if read_body else b""
                with lock:
                    index = len(seen.heads)
                    seen.heads.append((number, head))
                reply, close = script(index)
                try:
                    conn.sendall(reply)
                except OSError:
                    return
                if close:
                    conn.close()
                    seen.closed.release()  # closed by the server, as scripted
                    return

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with lock:
                seen.connections += 1
                number = seen.connections
            threading.Thread(target=serve, args=(conn, number), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield port, seen
    finally:
        listener.close()


def _received(conn: socket.socket) -> bytes:
    """The next bytes the client sent; empty once it closed or reset the connection."""
    try:
        return conn.recv(65536)
    except OSError:
        return b""


def reply(body: bytes = b"ok", *, status: str = "200 OK", headers: str = "") -> bytes:
    """An HTTP/1.1 response framed by Content-Length."""
    return (f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n").encode() + body


@dataclass(frozen=True)
class Authority:
    """A certificate authority made for one test, and a server certificate it signed."""

    ca_pem: bytes
    server: ssl.SSLContext

    def client(self) -> ssl.SSLContext:
        return ssl.create_default_context(cadata=self.ca_pem.decode())


def make_authority(tmp: Path, *, names: list[str]) -> Authority:
    """A new CA, and a server context whose certificate names ``names`` (DNS names or IPs)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "standmeet test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for name in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt.append(x509.DNSName(name))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_file, key_file = tmp / "server.pem", tmp / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert_file, key_file)
    return Authority(ca.public_bytes(serialization.Encoding.PEM), server)
