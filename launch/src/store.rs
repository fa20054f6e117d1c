//! Hosting the rendezvous store on machine 0: bind first (port 0 = a free
//! port chosen by the kernel), then hand the bound socket to the server, so
//! there is no window in which another process can take the port.

use std::io::Read;
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};

use accel_api::{Error, ErrorKind, Result};
use accel_rendezvous::{TcpStoreServer, TorchStoreServer};

/// `n` random bytes as lowercase hex, from the kernel's generator.
///
/// # Errors
/// [`ErrorKind::Io`] when /dev/urandom cannot be read.
pub fn random_hex(n: usize) -> Result<String> {
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(|e| Error::io("cannot read /dev/urandom for a run token", e))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// Resolve `host:port` to the first socket address.
fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    (h, port)
        .to_socket_addrs()
        .map_err(|e| {
            Error::io(
                format!("cannot resolve the main process address `{host}`"),
                e,
            )
            .with_fix("pass an IP address or a resolvable name to --main-process-ip")
        })?
        .next()
        .ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("the main process address `{host}` resolves to nothing"),
            )
        })
}

/// Bind the store's socket on machine 0.
///
/// * One machine (`multi == false`): `127.0.0.1:port`; a busy explicit port
///   falls back to a free one, with a notice (only the local workers need
///   to know it, and they are told).
/// * Several machines: `host:port` exactly; a busy port is an error naming
///   it, since the other machines were told that port.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] for a busy or unbindable address on a run
/// over several machines; [`ErrorKind::Io`] otherwise.
pub fn bind(host: &str, port: u16, multi: bool) -> Result<(TcpListener, Option<String>)> {
    let addr = resolve(host, port)?;
    match TcpListener::bind(addr) {
        Ok(l) => Ok((l, None)),
        Err(e) if !multi && port != 0 && e.kind() == std::io::ErrorKind::AddrInUse => {
            let l = TcpListener::bind(SocketAddr::new(addr.ip(), 0))
                .map_err(|e| Error::io("cannot bind a free port on 127.0.0.1", e))?;
            let got = l.local_addr().map(|a| a.port()).unwrap_or(0);
            Ok((
                l,
                Some(format!(
                    "port {port} is in use on this machine; the store listens on port {got} instead \
                     (the workers are told through MASTER_PORT)"
                )),
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "port {port} is already in use on {host}: machine 0 cannot host the store there"
            ),
        )
        .with_op("store bind")
        .with_fix(format!(
            "stop what listens on port {port} (`ss -ltnp 'sport = :{port}'`), or pass another \
             --main-process-port to every machine"
        ))
        .with_source(e)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("{addr} is not an address of this machine, so machine 0 cannot listen on it"),
        )
        .with_op("store bind")
        .with_fix(
            "run machine rank 0 on the machine that owns --main-process-ip, or pass one of its own addresses",
        )
        .with_source(e)),
        Err(e) => Err(Error::io(format!("cannot bind the store to {addr}"), e).with_op("store bind")),
    }
}

/// Host the torch-protocol endpoint for torch workers at `host:port`
/// (MASTER_ADDR:MASTER_PORT; a free port when `port` is 0 or busy on one
/// machine), with a state of its own: torch clients never see accel's keys
/// (docs/adr/0019-torch-store.md).
///
/// # Errors
/// As [`bind`], plus the server's start errors.
pub fn host_torch(
    host: &str,
    port: u16,
    multi: bool,
) -> Result<(TorchStoreServer, Option<String>)> {
    let (listener, notice) = bind(host, port, multi)?;
    let server = TorchStoreServer::from_listener(listener, Default::default())?;
    Ok((server, notice))
}

/// Bind and serve.
///
/// # Errors
/// As [`bind`], plus the server's start errors.
pub fn host(
    host: &str,
    port: u16,
    multi: bool,
    token: &str,
) -> Result<(TcpStoreServer, Option<String>)> {
    let (listener, notice) = bind(host, port, multi)?;
    let server = TcpStoreServer::from_listener(listener, Some(token.to_string()))?;
    Ok((server, notice))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_hex() {
        let a = random_hex(16).unwrap();
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, random_hex(16).unwrap());
    }

    #[test]
    fn busy_port_is_an_error_only_across_machines() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let e = bind("127.0.0.1", port, true).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("port {port} is already in use")),
            "{e}"
        );
        let (l, notice) = bind("127.0.0.1", port, false).unwrap();
        assert_ne!(l.local_addr().unwrap().port(), port);
        assert!(notice.unwrap().contains(&format!("port {port} is in use")));
        let (l, notice) = bind("127.0.0.1", 0, false).unwrap();
        assert_ne!(l.local_addr().unwrap().port(), 0);
        assert!(notice.is_none());
    }
}
