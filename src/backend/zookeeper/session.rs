//! The backend's ZooKeeper session: made at build, replaced when it expires.
//!
//! A session that expires has taken every ephemeral node of it along: each hold
//! granted in it is lost. Its [`StoreLoss`] fires (the lock core marks those holds lost
//! at once), a new session is made, with backoff while the ensemble cannot be reached,
//! and every waiter of this backend is woken to queue again in the new one.

use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::backend::StoreLoss;

/// The first pause before connecting again; doubled up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// How the backend connects: kept to make a new session when one expires.
#[derive(Clone)]
pub(super) struct Connect {
    pub(super) hosts: String,
    pub(super) session_timeout: Duration,
    pub(super) connection_timeout: Duration,
    pub(super) auth: Option<(String, Vec<u8>)>,
}

impl Connect {
    pub(super) async fn connect(&self) -> Result<zk::Client, zk::Error> {
        let mut connector = zk::Client::connector()
            .with_session_timeout(self.session_timeout)
            .with_connection_timeout(self.connection_timeout);
        if let Some((scheme, auth)) = &self.auth {
            connector = connector.with_auth(scheme, auth);
        }
        connector.connect(&self.hosts).await
    }
}

/// One session and what goes with it.
pub(super) struct Session {
    pub(super) client: zk::Client,
    /// Counts the backend's sessions: a node made in another one is gone.
    pub(super) generation: u64,
    /// Fired when the session ended: the holds granted in it are lost.
    pub(super) lost: StoreLoss,
}

/// The current session, replaced by [`supervise`] when it ends.
pub(super) struct Sessions {
    current: RwLock<Arc<Session>>,
    pub(super) connect: Connect,
    /// Cancelled when the backend is dropped: the supervisor ends, and with it the
    /// session.
    pub(super) closed: CancellationToken,
}

impl Sessions {
    pub(super) fn new(client: zk::Client, connect: Connect) -> Self {
        Sessions {
            current: RwLock::new(Arc::new(Session {
                client,
                generation: 1,
                lost: StoreLoss::new(),
            })),
            connect,
            closed: CancellationToken::new(),
        }
    }

    pub(super) fn current(&self) -> Arc<Session> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    fn replace(&self, client: zk::Client) -> Arc<Session> {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        let next = Arc::new(Session {
            client,
            generation: current.generation + 1,
            lost: StoreLoss::new(),
        });
        *current = Arc::clone(&next);
        next
    }
}

/// Something to tell when a session was replaced: the backend wakes its waiters.
pub(super) trait OnNewSession: Send + Sync + 'static {
    fn sessions(&self) -> &Sessions;
    fn new_session(&self, session: &Session);
}

fn ended(state: zk::SessionState) -> bool {
    matches!(
        state,
        zk::SessionState::Expired | zk::SessionState::Closed | zk::SessionState::AuthFailed
    )
}

/// Watches the current session; when it ends (expired, closed, refused its
/// credentials), fires its loss, makes a new one and tells `owner`. Ends when the
/// owner is gone or closed.
pub(super) async fn supervise<O: OnNewSession>(owner: Weak<O>, closed: CancellationToken) {
    loop {
        let Some(session) = owner.upgrade().map(|o| o.sessions().current()) else {
            return;
        };
        let mut states = session.client.state_watcher();
        loop {
            let state = tokio::select! {
                state = states.changed() => state,
                () = closed.cancelled() => return,
            };
            if ended(state) {
                tracing::warn!(session = %session.client.session_id(), ?state, "ZooKeeper session ended; its locks are lost");
                break;
            }
            if state == zk::SessionState::Disconnected {
                // The ensemble may expire the session a session timeout after it last
                // heard from this client, which the client noticed within a fifth of
                // it (its ping timeout): past a third of it, the session is given up
                // here, before the ensemble could have given its nodes to anyone.
                let grace = session.client.session_timeout() / 3;
                let back = tokio::time::timeout(grace, async {
                    loop {
                        match states.changed().await {
                            zk::SessionState::SyncConnected
                            | zk::SessionState::ConnectedReadOnly => {
                                return true;
                            }
                            state if ended(state) => return false,
                            _ => {}
                        }
                    }
                });
                let back = tokio::select! {
                    back = back => back.unwrap_or(false),
                    () = closed.cancelled() => return,
                };
                if !back {
                    tracing::warn!(session = %session.client.session_id(), grace_ms = grace.as_millis() as u64, "ZooKeeper connection not back in time; the session's locks are lost");
                    break;
                }
            }
        }
        session.lost.fire();
        drop(states);
        let mut backoff = MIN_BACKOFF;
        let client = loop {
            let Some(connect) = owner.upgrade().map(|o| o.sessions().connect.clone()) else {
                return;
            };
            let attempt = tokio::select! {
                attempt = connect.connect() => attempt,
                () = closed.cancelled() => return,
            };
            match attempt {
                Ok(client) => break client,
                Err(error) => {
                    tracing::debug!(%error, retry_in_ms = backoff.as_millis() as u64, "ZooKeeper: no new session yet");
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = closed.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        };
        let Some(owner) = owner.upgrade() else {
            return;
        };
        let next = owner.sessions().replace(client);
        tracing::info!(session = %next.client.session_id(), "ZooKeeper: new session");
        owner.new_session(&next);
    }
}
