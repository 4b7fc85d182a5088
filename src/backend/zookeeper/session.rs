//! The backend's ZooKeeper session: made at build, replaced when it ends.
//!
//! A session that expires has taken every ephemeral node of it along: each hold
//! granted in it is lost. A session whose connection is not back within a third of its
//! timeout is given up the same way, before the ensemble could expire it and hand its
//! nodes to anyone. Its [`StoreLoss`] fires (the lock core marks those holds lost at
//! once), and a new session is made: one try of every server, then a short backoff,
//! so that the first lock after an outage comes soon after the ensemble answers. A
//! session given up is then closed on the ensemble if it still lives there: its nodes,
//! whose holds are lost already, go at once, not a session timeout later. Every waiter
//! of this backend is woken to queue again in the new session.

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use zookeeper_client as zk;

use crate::backend::StoreLoss;

/// The first pause before connecting again; doubled up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(50);
/// The longest pause between two tries for a new session: a try costs a refused
/// connection per server while the ensemble is down, and bounds how long after it
/// answers again the first lock waits.
const MAX_BACKOFF: Duration = Duration::from_millis(400);

/// How the backend connects: kept to make a new session when one expires.
#[derive(Clone)]
pub(super) struct Connect {
    pub(super) hosts: String,
    pub(super) session_timeout: Duration,
    pub(super) connection_timeout: Duration,
    pub(super) auth: Option<(String, Vec<u8>)>,
}

impl Connect {
    fn connector(&self) -> zk::Connector {
        let mut connector = zk::Client::connector()
            .with_session_timeout(self.session_timeout)
            .with_connection_timeout(self.connection_timeout);
        if let Some((scheme, auth)) = &self.auth {
            connector = connector.with_auth(scheme, auth);
        }
        connector
    }

    /// A new session, trying the servers for up to a session timeout.
    pub(super) async fn connect(&self) -> Result<zk::Client, zk::Error> {
        self.connector().connect(&self.hosts).await
    }

    /// A new session, one try of every server: the caller backs off itself.
    async fn reconnect(&self) -> Result<zk::Client, zk::Error> {
        self.connector()
            .with_fail_eagerly()
            .connect(&self.hosts)
            .await
    }

    /// Closes `session` on the ensemble if it still lives there: a client takes it over
    /// and ends it, and its nodes go with it.
    async fn close(&self, session: zk::SessionInfo) {
        let taken = self
            .connector()
            .with_session(session)
            .with_fail_eagerly()
            .connect(&self.hosts)
            .await;
        let Ok(client) = taken else {
            // Expired already, or the ensemble cannot be reached: it expires it.
            return;
        };
        let mut states = client.state_watcher();
        // Dropped, the client closes the session from its own task.
        drop(client);
        let _ = tokio::time::timeout(self.session_timeout, async {
            while !ended(states.changed().await) {}
        })
        .await;
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
    current: watch::Sender<Arc<Session>>,
    pub(super) connect: Connect,
    /// Cancelled when the backend is dropped: the supervisor ends, and with it the
    /// session.
    pub(super) closed: CancellationToken,
}

impl Sessions {
    pub(super) fn new(client: zk::Client, connect: Connect) -> Self {
        Sessions {
            current: watch::Sender::new(Arc::new(Session {
                client,
                generation: 1,
                lost: StoreLoss::new(),
            })),
            connect,
            closed: CancellationToken::new(),
        }
    }

    pub(super) fn current(&self) -> Arc<Session> {
        Arc::clone(&self.current.borrow())
    }

    /// The session to make calls in: the current one, or, while it is being replaced
    /// (given up: its loss fired), the next one, waited for up to `within`. `None` when
    /// none came: a call in a session given up would wait for an answer that cannot
    /// come.
    pub(super) async fn live(&self, within: Duration) -> Option<Arc<Session>> {
        let mut sessions = self.current.subscribe();
        let next = async {
            loop {
                let session = Arc::clone(&sessions.borrow_and_update());
                if !session.lost.is_fired() {
                    return Some(session);
                }
                sessions.changed().await.ok()?;
            }
        };
        tokio::time::timeout(within, next).await.ok().flatten()
    }

    /// Installs a new session (the supervisor is the only one that does).
    fn replace(&self, client: zk::Client) -> Arc<Session> {
        let next = Arc::new(Session {
            client,
            generation: self.current.borrow().generation + 1,
            lost: StoreLoss::new(),
        });
        self.current.send_replace(Arc::clone(&next));
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
        // Whether the session was given up here (it may live on in the ensemble).
        let given_up = loop {
            let state = tokio::select! {
                state = states.changed() => state,
                () = closed.cancelled() => return,
            };
            if ended(state) {
                tracing::warn!(session = %session.client.session_id(), ?state, "ZooKeeper session ended; its locks are lost");
                break false;
            }
            if state == zk::SessionState::Disconnected {
                // The ensemble may expire the session a session timeout after it last
                // heard from this client, which the client noticed two fifths of it
                // (and a tick, a twentieth) after it last heard from the ensemble:
                // past a third of it more, the session is given up here, before the
                // ensemble could have given its nodes to anyone.
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
                    break true;
                }
            }
        };
        session.lost.fire();
        drop(states);
        let mut backoff = MIN_BACKOFF;
        let client = loop {
            let Some(connect) = owner.upgrade().map(|o| o.sessions().connect.clone()) else {
                return;
            };
            let attempt = tokio::select! {
                attempt = connect.reconnect() => attempt,
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
        if given_up {
            let connect = owner.sessions().connect.clone();
            let old = session.client.session().clone();
            tokio::spawn(async move { connect.close(old).await });
        }
    }
}
