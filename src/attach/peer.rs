//! Who is on the other end of a Unix socket, and who we are.

use std::io;
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;

/// The credentials the kernel vouches for on a connected Unix socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// Effective user id of the peer process (when it connected).
    pub uid: u32,
    /// Its process id, where the platform reports it.
    pub pid: Option<i32>,
}

/// Our effective user id.
pub fn my_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The peer's credentials (SO_PEERCRED on Linux).
#[cfg(any(target_os = "linux", target_os = "android"))]
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let expected = std::mem::size_of::<libc::ucred>();
    let mut len = expected as libc::socklen_t;
    // SAFETY: the fd is open for the lifetime of `stream`; `cred` and `len` are valid, writable
    // and sized for SO_PEERCRED's `struct ucred`.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != expected {
        return Err(io::Error::other("SO_PEERCRED returned a short answer"));
    }
    Ok(PeerCred {
        uid: cred.uid,
        pid: Some(cred.pid),
    })
}

/// The peer's credentials (getpeereid on the BSDs and macOS).
#[cfg(any(
    target_os = "macos",
    target_os = "ios",
    target_os = "freebsd",
    target_os = "openbsd",
    target_os = "netbsd",
    target_os = "dragonfly"
))]
pub fn peer_cred(stream: &UnixStream) -> io::Result<PeerCred> {
    let mut uid: libc::uid_t = 0;
    let mut gid: libc::gid_t = 0;
    // SAFETY: the fd is open for the lifetime of `stream`; `uid` and `gid` are valid and
    // writable.
    let rc = unsafe { libc::getpeereid(stream.as_raw_fd(), &mut uid, &mut gid) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred { uid, pid: None })
}

/// Without a way to learn the peer, nobody is let in.
#[cfg(not(any(
    target_os = "linux",
    target_os = "android",
    target_os = "macos",
    target_os = "ios",
    target_os = "freebsd",
    target_os = "openbsd",
    target_os = "netbsd",
    target_os = "dragonfly"
)))]
pub fn peer_cred(_stream: &UnixStream) -> io::Result<PeerCred> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "peer credentials are not available on this platform",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ends_of_a_pair_are_us() {
        let (a, b) = UnixStream::pair().unwrap();
        let me = my_uid();
        assert_eq!(peer_cred(&a).unwrap().uid, me);
        assert_eq!(peer_cred(&b).unwrap().uid, me);
    }
}
