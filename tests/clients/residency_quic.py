"""A residency client that is not quinn: aioquic (tests/tools/requirements.txt), asked
for a snapshot as a router asks (tests/security_tiers.rs, issue 26's attacks 7 and 9).

    python residency_quic.py NAME@HOST:PORT CA CERT KEY ALPN

Connects over QUIC to the agent at HOST:PORT, checks the agent's certificate against the
CA file CA for the name NAME, presents the certificate CERT with its key KEY ("-" for both:
no client certificate), offers ALPN. Once its side of the handshake is done it opens one
bidirectional stream, sends what a router sends first (a resync request: a u32
little-endian length, then postcard of `Wire::V1Reply(Reply::Resync)`, i.e. 1, 0) and
reads the first frame the agent sends back, decoding it as residency/src/session.rs
defines it (postcard of `Wire::V1Msg(Msg::Snapshot { .. })`); when no frame comes, it
waits up to a second for the agent to close the connection. It prints one JSON line:

    finished    whether the client's side of the TLS handshake finished: it checked the
                agent's chain and sent its Finished (in TLS 1.3 a client is done before
                the server has checked the client's certificate, so a server that refuses
                it fails the handshake after this, with an alert)
    confirmed   whether the agent confirmed the handshake (QUIC HANDSHAKE_DONE): it took
                the client's certificate
    alpn        the protocol negotiated, or null
    server      the agent's certificate's names ({"dns", "ip", "uri"}) and whether NAME
                is one of them ("name_ok"; when not, the client closes before sending),
                or null
    stream_bytes  bytes received on the stream
    frame       the first frame: {"length", "kind", "well_formed", ...the snapshot's fields
                ("epoch", "seq", "instances", "blocks": [[scope, key, parent]], "last")},
                or null
    served      whether that frame was a well-formed snapshot
    closed      how the connection ended: {"by": "peer"|"local", "error_code", "frame_type",
                "reason", "tls_alert": [number, name] for a crypto error (0x100 + alert)},
                or null while it was still open when the client gave up
    error       anything the client raised, or null
"""

import asyncio
import ipaddress
import json
import socket
import ssl
import struct
import sys

from cryptography import x509

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.tls import AlertDescription

# What the agent reads at most in one frame (residency/src/net.rs, MAX_MESSAGE_BYTES).
MAX_MESSAGE_BYTES = 4 << 20
# Wire::V1Reply(Reply::Resync): variant 1 of Wire, variant 0 of Reply.
RESYNC = bytes([1, 0])
# How long to wait for each step.
STEP = 5.0


class Malformed(Exception):
    pass


class Postcard:
    """Reads postcard's encoding: unsigned integers and enum variants as LEB128 varints,
    strings and sequences as a varint length then their items, bool and Option's tag as
    one byte."""

    def __init__(self, data):
        self.data, self.at = data, 0

    def byte(self):
        if self.at >= len(self.data):
            raise Malformed("truncated")
        b = self.data[self.at]
        self.at += 1
        return b

    def varint(self, bits=64):
        value, shift = 0, 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift >= bits + 7:
                raise Malformed("varint too long")
        if value >> bits:
            raise Malformed(f"varint over {bits} bits")
        return value

    def flag(self):
        b = self.byte()
        if b > 1:
            raise Malformed(f"bool or Option tag {b}")
        return b == 1

    def string(self):
        n = self.varint()
        if self.at + n > len(self.data):
            raise Malformed("truncated string")
        s = self.data[self.at : self.at + n].decode("utf-8")
        self.at += n
        return s

    def seq(self, item):
        return [item() for _ in range(self.varint())]

    def scope(self):
        v = self.varint(32)
        if v == 0:
            return f"Gpu({self.varint(16)})"
        if v in (1, 2):
            return ["L1", "L2"][v - 1]
        raise Malformed(f"Scope variant {v}")


def decode_msg(body):
    """The agent's message in `body`: its kind and, for a snapshot or a heartbeat, its
    fields. Raises Malformed when `body` is not exactly one `Wire::V1Msg`."""
    r = Postcard(body)
    wire = r.varint(32)
    if wire != 0:
        raise Malformed(f"Wire variant {wire}, not V1Msg")
    msg = r.varint(32)
    if msg == 0:
        out = {
            "kind": "snapshot",
            "epoch": r.varint(),
            "seq": r.varint(),
            "instances": r.seq(r.string),
            "blocks": r.seq(
                lambda: [r.scope(), r.varint(), r.varint() if r.flag() else None]
            ),
            "last": r.flag(),
        }
    elif msg == 1:
        # A delta: its kind is enough here.
        return {"kind": "delta"}
    elif msg == 2:
        out = {"kind": "heartbeat", "epoch": r.varint(), "seq": r.varint()}
    else:
        raise Malformed(f"Msg variant {msg}")
    if r.at != len(body):
        raise Malformed(f"{len(body) - r.at} bytes after the message")
    return out


class Client(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.completed = False
        self.alpn = None
        self.received = bytearray()
        # Who closed the connection: "peer" (its CONNECTION_CLOSE received) or "local".
        self.by = None

    def quic_event_received(self, event):
        if isinstance(event, events.HandshakeCompleted):
            self.alpn = event.alpn_protocol
            self.completed = True
        elif isinstance(event, events.StreamDataReceived):
            self.received += event.data

    def datagram_received(self, data, addr):
        super().datagram_received(data, addr)
        self.noticed()

    def noticed(self):
        # aioquic reports a close as an event only once the closing or draining period
        # is over; its state tells at once, and whose close it was.
        if self.by is None and self._quic._close_event is not None:
            draining = self._quic._state.name == "DRAINING"
            self.by = "peer" if draining else "local"

    def ended(self):
        return self._quic._close_event is not None


async def until(cond, timeout):
    """Polls `cond` until it holds, for at most `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond() and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return cond()


def server_names(cert, want):
    """The agent's certificate's names, and whether `want` is one of them (a DNS name, or
    an IP address)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return {"dns": [], "ip": [], "uri": [], "name_ok": False}
    names = {
        "dns": san.get_values_for_type(x509.DNSName),
        "ip": [str(a) for a in san.get_values_for_type(x509.IPAddress)],
        "uri": san.get_values_for_type(x509.UniformResourceIdentifier),
    }
    try:
        want_ip = str(ipaddress.ip_address(want))
    except ValueError:
        want_ip = None
    names["name_ok"] = (
        want_ip in names["ip"]
        if want_ip
        else any(d.lower() == want.lower() for d in names["dns"])
    )
    return names


def closed(client):
    """How the connection ended, or None while it is open."""
    ev = client._quic._close_event
    if ev is None:
        return None
    out = {
        # A peer's close is noticed as its datagram arrives; any other is the client's.
        "by": client.by or "local",
        "error_code": ev.error_code,
        "frame_type": ev.frame_type,
        "reason": ev.reason_phrase,
        "tls_alert": None,
    }
    if 0x100 <= ev.error_code <= 0x1FF:
        alert = ev.error_code - 0x100
        try:
            name = AlertDescription(alert).name
        except ValueError:
            name = "unknown"
        out["tls_alert"] = [alert, name]
    return out


async def run(target, ca, cert, key, alpn):
    name, _, address = target.rpartition("@")
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    # The agent's chain is checked against CA by aioquic; its name is checked here, after
    # the handshake and before a byte is sent on a stream: aioquic checks names with
    # service_identity, which raises on a URI name without an authority such as the
    # role's, `warmpath:role:agent` (it splits a URI pattern at ":" into exactly two
    # parts), and aioquic reports that as "Certificate extensions could not be parsed".
    # With no server name it checks the chain only (and sends no SNI: the agent has one
    # certificate).
    config = QuicConfiguration(
        is_client=True,
        alpn_protocols=[alpn],
        server_name=None,
        verify_mode=ssl.CERT_REQUIRED,
    )
    config.load_verify_locations(cafile=ca)
    if cert != "-":
        config.load_cert_chain(cert, key)
    report = {
        "finished": False,
        "confirmed": False,
        "alpn": None,
        "server": None,
        "stream_bytes": 0,
        "frame": None,
        "served": False,
        "closed": None,
        "error": None,
    }
    loop = asyncio.get_running_loop()
    (family, _, _, _, addr) = (
        await loop.getaddrinfo(host, int(port), type=socket.SOCK_DGRAM)
    )[0]
    local = ("127.0.0.1", 0) if family == socket.AF_INET else ("::", 0)
    quic = QuicConnection(configuration=config)
    transport, client = await loop.create_datagram_endpoint(
        lambda: Client(quic), local_addr=local, family=family
    )
    try:
        client.connect(addr)
        await until(lambda: client.completed or client.ended(), STEP)
        client.noticed()
        if client.completed:
            report["finished"] = True
            report["alpn"] = client.alpn
            report["server"] = server_names(quic.tls._peer_certificate, name or host)
        if client.completed and not client.ended() and not report["server"]["name_ok"]:
            client.close(error_code=0x100 + AlertDescription.bad_certificate)
            await until(client.ended, 1.0)
        elif client.completed and not client.ended():
            stream = quic.get_next_available_stream_id()
            quic.send_stream_data(stream, struct.pack("<I", len(RESYNC)) + RESYNC)
            client.transmit()

            def frame_in():
                have = len(client.received)
                if have < 4:
                    return False
                (length,) = struct.unpack_from("<I", client.received)
                return length > MAX_MESSAGE_BYTES or have >= 4 + length

            # The first frame, or the end of the connection.
            await until(lambda: frame_in() or client.ended(), STEP)
            report["stream_bytes"] = len(client.received)
            if len(client.received) >= 4:
                (length,) = struct.unpack_from("<I", client.received)
                frame = {"length": length, "well_formed": False}
                body = bytes(client.received[4 : 4 + length])
                if length > MAX_MESSAGE_BYTES:
                    frame["error"] = "over the agent's message bound"
                elif len(body) < length:
                    frame["error"] = f"truncated: {len(body)} of {length} bytes"
                else:
                    try:
                        frame.update(decode_msg(body))
                        frame["well_formed"] = True
                    except (Malformed, UnicodeDecodeError) as e:
                        frame["error"] = str(e)
                report["frame"] = frame
                report["served"] = (
                    frame["well_formed"] and frame.get("kind") == "snapshot"
                )
            else:
                # The agent closes a connection it refuses at once.
                await until(client.ended, 1.0)
        report["confirmed"] = bool(getattr(quic, "_handshake_confirmed", False))
        report["closed"] = closed(client)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        if not client.ended():
            client.close()
            await until(client.ended, 1.0)
        transport.close()
    return report


def main():
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    report = asyncio.run(asyncio.wait_for(run(*sys.argv[1:6]), 30))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
