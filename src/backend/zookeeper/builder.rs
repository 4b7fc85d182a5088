//! [`ZooKeeperBackendBuilder`]: the settings, checked when the backend is built.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use zookeeper_client as zk;

use super::session::{Connect, Sessions, supervise};
use super::{
    DEFAULT_RESPONSE_TIMEOUT, DEFAULT_ROOT, DEFAULT_SESSION_TIMEOUT, Inner, ZooKeeperBackend,
};
use crate::backend::{ClockDrift, DEFAULT_WAITER_TIMEOUT, LockMode, StoreProfile};
use crate::error::{ConfigError, SetupError, StoreError, StoreErrorKind};

/// Configures a [`ZooKeeperBackend`].
#[must_use]
pub struct ZooKeeperBackendBuilder {
    hosts: String,
    chroot: Option<String>,
    root: String,
    session_timeout: Duration,
    connection_timeout: Option<Duration>,
    response_timeout: Duration,
    waiter_timeout: Duration,
    auth: Option<(String, Vec<u8>)>,
}

impl ZooKeeperBackendBuilder {
    pub(super) fn new(hosts: String) -> Self {
        ZooKeeperBackendBuilder {
            hosts,
            chroot: None,
            root: DEFAULT_ROOT.to_owned(),
            session_timeout: DEFAULT_SESSION_TIMEOUT,
            connection_timeout: None,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            waiter_timeout: DEFAULT_WAITER_TIMEOUT,
            auth: None,
        }
    }

    /// Runs every path under `chroot` (an absolute path), as `host:port/chroot` in the
    /// connect string does; the chroot must exist.
    pub fn chroot(mut self, chroot: impl Into<String>) -> Self {
        self.chroot = Some(chroot.into());
        self
    }

    /// The path keys are put under: the lock of key `k` is the directory `<root>/k`,
    /// where Curator's recipes at that path meet it. Default [`DEFAULT_ROOT`]; `/` puts
    /// keys at the top (of the chroot).
    pub fn root(mut self, root: impl Into<String>) -> Self {
        self.root = root.into();
        self
    }

    /// The session timeout to ask the ensemble for (it bounds it between 2 and 20 of its
    /// ticks by default). Default [`DEFAULT_SESSION_TIMEOUT`]. A holder cut off from the
    /// ensemble loses its locks within it; a third of it after its connection dropped,
    /// this backend gives the session up itself.
    pub fn session_timeout(mut self, timeout: Duration) -> Self {
        self.session_timeout = timeout;
        self
    }

    /// How long connecting to one server may take (the client's default: two fifths
    /// of the session timeout).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = Some(timeout);
        self
    }

    /// How long a call waits for the ensemble's answer before it counts as
    /// unanswered. Default [`DEFAULT_RESPONSE_TIMEOUT`].
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long a tower-lock waiter may sit at the head of a queue without claiming
    /// the lock before other tower-lock clients delete its node (a waiter whose
    /// acquisition was leaked in a process that lives on: its session alone would keep
    /// it there). Default [`DEFAULT_WAITER_TIMEOUT`]; at least [`MIN_WAITER_TIMEOUT`]. A
    /// live waiter claims the head within a round trip of its predecessor leaving.
    ///
    /// [`MIN_WAITER_TIMEOUT`]: crate::backend::MIN_WAITER_TIMEOUT
    pub fn waiter_timeout(mut self, timeout: Duration) -> Self {
        self.waiter_timeout = timeout;
        self
    }

    /// Authenticates the session (`addauth`), e.g. `("digest", b"user:password")`.
    /// Nodes are then created readable and writable by that identity only
    /// (`CREATOR_ALL_ACL`); without it, by anyone (`OPEN_ACL_UNSAFE`), as Curator's
    /// default.
    pub fn auth(mut self, scheme: impl Into<String>, auth: impl Into<Vec<u8>>) -> Self {
        self.auth = Some((scheme.into(), auth.into()));
        self
    }

    /// Connects and makes the backend; a task that replaces an expired session runs on
    /// the current tokio runtime.
    ///
    /// # Errors
    ///
    /// [`SetupError::Config`] for a setting out of range or a root that is no absolute
    /// path; [`SetupError::Store`] when no server of the ensemble can be reached
    /// ([unavailable](StoreErrorKind::Unavailable)) or the credentials are refused
    /// ([misconfigured](StoreErrorKind::Misconfigured)).
    pub async fn build(self) -> Result<ZooKeeperBackend, SetupError> {
        let root = normalize_root(&self.root)?;
        for (name, value) in [
            ("session_timeout", self.session_timeout),
            ("response_timeout", self.response_timeout),
        ] {
            if value < Duration::from_millis(1) {
                return Err(ConfigError::invalid_setting(
                    name,
                    format!("must be at least 1 ms, not {value:?}"),
                )
                .into());
            }
        }
        crate::backend::limits::validate_waiter_timeout(self.waiter_timeout)?;
        let mut hosts = self.hosts.clone();
        if let Some(chroot) = &self.chroot {
            if !chroot.starts_with('/') || chroot.len() < 2 || chroot.ends_with('/') {
                return Err(ConfigError::invalid_setting(
                    "chroot",
                    format!("must be an absolute path without a trailing `/`, not {chroot:?}"),
                )
                .into());
            }
            hosts.push_str(chroot);
        }
        let connect = Connect {
            hosts: hosts.clone(),
            session_timeout: self.session_timeout,
            connection_timeout: self.connection_timeout.unwrap_or(Duration::ZERO),
            auth: self.auth.clone(),
        };
        let client = connect.connect().await.map_err(|error| {
            let kind = match error {
                zk::Error::AuthFailed | zk::Error::NoAuth => StoreErrorKind::Misconfigured,
                zk::Error::BadArguments(_) => {
                    return SetupError::Config(ConfigError::invalid_setting(
                        "hosts",
                        format!("{hosts:?}: {error}"),
                    ));
                }
                _ => StoreErrorKind::Unavailable,
            };
            SetupError::Store(
                StoreError::new(kind, error)
                    .with_message(format!("cannot connect to ZooKeeper at {hosts}")),
            )
        })?;
        let acls = if self.auth.is_some() {
            zk::Acls::creator_all()
        } else {
            zk::Acls::anyone_all()
        };
        let modes = [
            LockMode::Exclusive,
            LockMode::Fair,
            LockMode::Read,
            LockMode::Write,
            LockMode::Permits {
                max: std::num::NonZeroU32::MIN,
            },
        ];
        let profile = StoreProfile::new("zookeeper")
            .with_store_id(format!("zookeeper:{hosts}{root}"))
            .with_queued_modes(modes)
            // A contender times a holder's lease from when it first saw the holder's
            // node at that version, on its own clock: rates may differ by 1%.
            .with_clock_drift(ClockDrift::new(10_000, Duration::from_millis(2)));
        let inner = Arc::new_cyclic(|me| Inner {
            me: me.clone(),
            runtime: tokio::runtime::Handle::current(),
            profile,
            root,
            response_timeout: self.response_timeout,
            waiter_timeout: self.waiter_timeout,
            acls,
            sessions: Sessions::new(client, connect),
            holds: Mutex::new(HashMap::new()),
            seen: Mutex::new(HashMap::new()),
            subs: Mutex::new(HashMap::new()),
            names: Mutex::new(HashMap::new()),
        });
        let closed = inner.sessions.closed.clone();
        tokio::spawn(supervise(Arc::downgrade(&inner), closed));
        Ok(ZooKeeperBackend { inner })
    }
}

/// The root without a trailing `/` (empty for `/`).
fn normalize_root(root: &str) -> Result<String, SetupError> {
    if root == "/" {
        return Ok(String::new());
    }
    let ok = root.starts_with('/')
        && !root.ends_with('/')
        && super::layout::check_key(&root[1..]).is_ok();
    if ok {
        Ok(root.to_owned())
    } else {
        Err(ConfigError::invalid_setting(
            "root",
            format!("must be an absolute ZooKeeper path, not {root:?}"),
        )
        .into())
    }
}
