//! ZMTP 3.0 over TCP, the client end of a SUB or DEALER socket with the NULL mechanism:
//! what the agent needs to read its engines' KV events and ask their replay sockets, with
//! every frame's length checked against the message bound *before* its body is read. The
//! `zeromq` crate (0.7, its newest release) has no receive limit: it reserves and buffers a
//! frame of whatever length the peer announces, so one 1 GiB frame cost the agent a
//! gigabyte before its own check ran (issue 26, attack 10;
//! [0102](../../docs/decisions/0102-certificate-roles.md)).
//!
//! The agent announces ZMTP 3.0, so a 3.1 peer (libzmq 4.3, pyzmq: vLLM) speaks 3.0 with
//! it: a subscription is a message whose first byte is 1, and no heartbeat commands come.
//! Commands between messages are read (bounded) and ignored. Not cancel-safe: a caller
//! that abandons [`Zmtp::recv`] midway must drop the connection.

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Most frames in one message (vLLM sends 3, its replay socket 4).
pub const MAX_PARTS: usize = 16;

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The socket failed or closed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol.
    #[error("ZMTP: {0}")]
    Protocol(&'static str),
    /// The peer announced a frame that would take the message past the bound: refused
    /// before a byte of it was read.
    #[error("a frame of {0} bytes is over the message bound")]
    TooLarge(u64),
}

/// One connection to a ZMQ peer (over TCP; any byte stream for the fuzzer).
#[derive(Debug)]
pub struct Zmtp<S = TcpStream> {
    io: BufReader<S>,
    max_message: usize,
}

/// The greeting: signature, version 3.0, mechanism NULL, as client.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A frame: flags (`more`, long size, `command`), size, body.
fn frame(out: &mut Vec<u8>, body: &[u8], more: bool, command: bool) {
    let mut flags = u8::from(more) | if command { 4 } else { 0 };
    if body.len() > 255 {
        flags |= 2;
        out.push(flags);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(flags);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

impl Zmtp<TcpStream> {
    /// Connects to `endpoint` (`tcp://HOST:PORT`) as a `socket_type` (`SUB`, `DEALER`)
    /// and completes the handshake within `within`; messages are bounded at `max_message`
    /// bytes.
    pub async fn connect(
        endpoint: &str,
        socket_type: &str,
        max_message: usize,
        within: Duration,
    ) -> Result<Zmtp, ZmtpError> {
        let addr = endpoint
            .strip_prefix("tcp://")
            .ok_or(ZmtpError::Protocol("only tcp:// endpoints"))?;
        let handshake = async {
            let stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            let mut z = Zmtp {
                io: BufReader::new(stream),
                max_message,
            };
            z.io.get_mut().write_all(&greeting()).await?;
            let mut g = [0u8; 64];
            z.io.read_exact(&mut g).await?;
            if g[0] != 0xFF || g[9] & 1 != 1 {
                return Err(ZmtpError::Protocol("not a ZMTP peer"));
            }
            if g[10] < 3 {
                return Err(ZmtpError::Protocol("a ZMTP version before 3.0"));
            }
            if &g[12..16] != b"NULL" || g[16..32].iter().any(|&b| b != 0) {
                return Err(ZmtpError::Protocol("a security mechanism other than NULL"));
            }
            let mut ready = vec![5];
            ready.extend_from_slice(b"READY");
            ready.push(11);
            ready.extend_from_slice(b"Socket-Type");
            ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
            ready.extend_from_slice(socket_type.as_bytes());
            let mut out = Vec::new();
            frame(&mut out, &ready, false, true);
            z.io.get_mut().write_all(&out).await?;
            // The peer's READY (its properties are not needed).
            let (flags, body) = z.read_frame(0).await?;
            if flags & 4 == 0 || !body.starts_with(b"\x05READY") {
                return Err(ZmtpError::Protocol("no READY from the peer"));
            }
            Ok(z)
        };
        tokio::time::timeout(within, handshake)
            .await
            .map_err(|_| ZmtpError::Io(std::io::ErrorKind::TimedOut.into()))?
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Zmtp<S> {
    /// A connection over `stream` whose handshake is done (the fuzzer's way in).
    pub fn after_handshake(stream: S, max_message: usize) -> Zmtp<S> {
        Zmtp {
            io: BufReader::new(stream),
            max_message,
        }
    }

    /// Subscribes to every topic (a SUB socket).
    pub async fn subscribe_all(&mut self) -> Result<(), ZmtpError> {
        self.send(&[&[1u8]]).await
    }

    /// Sends one message of `parts`.
    pub async fn send(&mut self, parts: &[&[u8]]) -> Result<(), ZmtpError> {
        let mut out = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            frame(&mut out, p, i + 1 < parts.len(), false);
        }
        self.io.get_mut().write_all(&out).await?;
        Ok(())
    }

    /// One frame's flags and body, the body at most `room` bytes (a command's at most the
    /// message bound): its length is checked before the body is read.
    async fn read_frame(&mut self, room: usize) -> Result<(u8, Vec<u8>), ZmtpError> {
        let flags = self.io.read_u8().await?;
        let len = if flags & 2 != 0 {
            self.io.read_u64().await?
        } else {
            u64::from(self.io.read_u8().await?)
        };
        let room = if flags & 4 != 0 {
            self.max_message
        } else {
            room
        };
        if len > room as u64 {
            return Err(ZmtpError::TooLarge(len));
        }
        let mut body = vec![0u8; len as usize];
        self.io.read_exact(&mut body).await?;
        Ok((flags, body))
    }

    /// The next message: at most [`MAX_PARTS`] frames and the message bound in all.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut parts = Vec::new();
        let mut total = 0usize;
        loop {
            let (flags, body) = self.read_frame(self.max_message - total).await?;
            if flags & 4 != 0 {
                if !parts.is_empty() {
                    return Err(ZmtpError::Protocol("a command inside a message"));
                }
                continue;
            }
            total += body.len();
            parts.push(Bytes::from(body));
            if flags & 1 == 0 {
                return Ok(parts);
            }
            if parts.len() >= MAX_PARTS {
                return Err(ZmtpError::Protocol("too many frames in one message"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zeromq::{Socket, SocketRecv, SocketSend};

    /// The `zeromq` crate's PUB and ROUTER (what engine-sim runs) talk to this client.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn speaks_to_zeromqs_pub_and_router_and_refuses_a_large_frame_unread() {
        let mut publisher = zeromq::PubSocket::new();
        let at = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .unwrap()
            .to_string();
        let mut sub = Zmtp::connect(&at, "SUB", 1 << 20, Duration::from_secs(5))
            .await
            .unwrap();
        sub.subscribe_all().await.unwrap();
        // The publisher sends only once it has seen the subscription.
        let msg = loop {
            let m = zeromq::ZmqMessage::try_from(vec![
                Bytes::from_static(b"topic"),
                Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 1]),
                Bytes::from(vec![7u8; 300]),
            ])
            .unwrap();
            publisher.send(m).await.unwrap();
            if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
                break m.unwrap();
            }
        };
        assert_eq!(msg.len(), 3);
        assert_eq!(&msg[0][..], b"topic");
        assert_eq!(msg[2].len(), 300);

        let mut router = zeromq::RouterSocket::new();
        let at = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let mut dealer = Zmtp::connect(&at, "DEALER", 1 << 20, Duration::from_secs(5))
            .await
            .unwrap();
        dealer.send(&[b"", b"ask"]).await.unwrap();
        let asked = router.recv().await.unwrap().into_vec();
        assert_eq!(&asked[1..], &[Bytes::new(), Bytes::from_static(b"ask")]);
        let answer = vec![
            asked[0].clone(),
            Bytes::new(),
            Bytes::from(vec![1u8; 2 << 20]),
        ];
        router
            .send(zeromq::ZmqMessage::try_from(answer).unwrap())
            .await
            .unwrap();
        match dealer.recv().await {
            Err(ZmtpError::TooLarge(n)) => assert_eq!(n, 2 << 20),
            other => panic!("{other:?}"),
        }
    }
}
