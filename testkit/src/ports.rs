//! Free loopback ports for the processes the tests start, taken from below the kernel's
//! ephemeral range so that a restarted process gets its port back.

/// A free loopback address, below the kernel's ephemeral port range.
///
/// Tests start processes on these ports and, after a kill, start them again on the same
/// port. A port from the ephemeral range (what binding port 0 gives) can be taken in
/// between as the local port of any outgoing connection, which the tests make by the
/// thousand, and the restart then fails. So the ports come from below that range (read
/// from `/proc/sys/net/ipv4/ip_local_port_range`), in a window of this process's own,
/// each checked free by binding it, none handed out twice by one process.
pub fn free_addr() -> std::net::SocketAddr {
    free_port(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
}

/// A free loopback UDP address (a QUIC listener), by the same rule as [`free_addr`].
pub fn free_udp_addr() -> std::net::SocketAddr {
    free_port(|port| std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok())
}

/// Port 0 means the kernel's choice; `free` says whether a port can be bound now.
fn free_port(free: impl Fn(u16) -> bool) -> std::net::SocketAddr {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOW: u32 = 10_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let loopback = |port: u16| std::net::SocketAddr::from(([127, 0, 0, 1], port));
    if ephemeral_low <= LOW + 1_000 {
        // No room below the range: the kernel's choice, as before.
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
        return loopback(l.local_addr().expect("local address").port());
    }
    let span = ephemeral_low - LOW;
    let start = (u64::from(std::process::id()) * 997 % u64::from(span)) as u32;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOW + (start + n) % span) as u16;
        if free(port) {
            return loopback(port);
        }
    }
    panic!("no free loopback port between {LOW} and {ephemeral_low}")
}
