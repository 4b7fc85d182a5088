//! What a holder has of its locks: [`Guards`], the guards of one acquisition (one lock,
//! or several taken together), and [`HeldLock`], what a handler or `with_lock` work sees
//! of them.

use std::fmt;
use std::sync::Arc;

use super::unlocking::{FinishOnDrop, Unlocking};
use super::{LockGuard, LostSignal};
use crate::backend::{FencingToken, LockMode};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

/// The guards of one acquisition: one lock (every single-key request through a layer,
/// without a vector), or several taken together in one order. What a layer holds for a
/// request, and what [`MultiGuard`](crate::kinds::MultiGuard) wraps.
#[derive(Debug)]
pub(crate) enum Guards {
    One(LockGuard),
    Many(Vec<LockGuard>),
}

impl Guards {
    pub(crate) fn from_vec(mut guards: Vec<LockGuard>) -> Self {
        match guards.pop() {
            Some(guard) if guards.is_empty() => Guards::One(guard),
            Some(last) => {
                guards.push(last);
                Guards::Many(guards)
            }
            None => Guards::Many(guards),
        }
    }

    /// The held locks, in acquisition order.
    pub(crate) fn as_slice(&self) -> &[LockGuard] {
        match self {
            Guards::One(guard) => std::slice::from_ref(guard),
            Guards::Many(guards) => guards,
        }
    }

    /// Each lock's fencing token, in acquisition order.
    pub(crate) fn fencing_tokens(&self) -> Vec<Option<FencingToken>> {
        self.as_slice()
            .iter()
            .map(LockGuard::fencing_token)
            .collect()
    }

    /// Fires as soon as any of the locks is lost.
    pub(crate) fn lost(&self) -> LostSignal {
        LostSignal::any(self.as_slice().iter().map(LockGuard::lost))
    }

    /// Whether any of the locks has been lost.
    pub(crate) fn is_lost(&self) -> bool {
        self.as_slice().iter().any(LockGuard::is_lost)
    }

    /// The guards, to release separately.
    pub(crate) fn into_vec(self) -> Vec<LockGuard> {
        match self {
            Guards::One(guard) => vec![guard],
            Guards::Many(guards) => guards,
        }
    }

    /// Releases every lock, all at once, even when some fail: [`Error::Lost`] when any
    /// lock had been lost, whatever else failed; else the first error met, in lock
    /// order.
    pub(crate) async fn unlock(self) -> Result<()> {
        match self.start_unlock() {
            Unlocking::Done(outcome) => outcome,
            Unlocking::Pending(release) => release.await,
        }
    }

    /// [`unlock`](Self::unlock) as far as it goes without waiting, as
    /// [`LockGuard::start_unlock`].
    pub(crate) fn start_unlock(self) -> Unlocking {
        match self {
            Guards::One(guard) => guard.start_unlock(),
            Guards::Many(guards) if guards.is_empty() => Unlocking::Done(Ok(())),
            // All at once: a slow or unreachable store costs one timeout, not one per
            // lock. Each guard's release finishes on its own if this is dropped.
            Guards::Many(guards) => Unlocking::Pending(FinishOnDrop::new(None, async move {
                let outcomes =
                    futures_util::future::join_all(guards.into_iter().map(LockGuard::unlock)).await;
                // A lost lock first: the holder must hear its work was not all under
                // the lock, even when another release failed too.
                if outcomes.iter().any(|o| matches!(o, Err(Error::Lost))) {
                    return Err(Error::Lost);
                }
                outcomes.into_iter().find(Result::is_err).unwrap_or(Ok(()))
            })),
        }
    }
}

/// The lock(s) the layer holds for this request, or that work run by
/// [`Lock::with_lock`](super::Lock::with_lock) holds.
///
/// With several keys the locks are listed in acquisition (sorted) order. Cheap to
/// clone. With nested `LockLayer`s, this describes the innermost layer's locks (all
/// held by the same owner).
#[derive(Clone)]
pub struct HeldLock {
    repr: Repr,
}

#[derive(Clone)]
enum Repr {
    /// One lock (the common case): no allocation.
    One {
        key: LockKey,
        token: Option<FencingToken>,
        mode: LockMode,
        owner: Owner,
        lost: LostSignal,
    },
    Many(Arc<Many>),
}

struct Many {
    keys: Vec<LockKey>,
    tokens: Vec<Option<FencingToken>>,
    mode: LockMode,
    owner: Owner,
    lost: LostSignal,
}

impl HeldLock {
    /// Describes `guards` (non-empty) for handlers. `None` for no guard.
    pub(crate) fn new(guards: &Guards) -> Option<Self> {
        let repr = match guards.as_slice() {
            [] => return None,
            [one] => Repr::One {
                key: one.key().clone(),
                token: one.fencing_token(),
                mode: one.mode(),
                owner: one.owner().clone(),
                lost: one.lost(),
            },
            all @ [first, ..] => Repr::Many(Arc::new(Many {
                keys: all.iter().map(|g| g.key().clone()).collect(),
                tokens: guards.fencing_tokens(),
                mode: first.mode(),
                owner: first.owner().clone(),
                lost: guards.lost(),
            })),
        };
        Some(HeldLock { repr })
    }

    /// Describes one held lock, for work run under it ([`Lock::with_lock`](super::Lock::with_lock)).
    pub(crate) fn of_guard(guard: &LockGuard) -> Self {
        HeldLock {
            repr: Repr::One {
                key: guard.key().clone(),
                token: guard.fencing_token(),
                mode: guard.mode(),
                owner: guard.owner().clone(),
                lost: guard.lost(),
            },
        }
    }

    /// The key — the first one, in sorted order, when the request holds several.
    pub fn key(&self) -> &LockKey {
        match &self.repr {
            Repr::One { key, .. } => key,
            // `new` refuses empty guards.
            Repr::Many(many) => &many.keys[0],
        }
    }

    /// Every key held, in acquisition order.
    pub fn keys(&self) -> &[LockKey] {
        match &self.repr {
            Repr::One { key, .. } => std::slice::from_ref(key),
            Repr::Many(many) => &many.keys,
        }
    }

    /// The fencing token of [`key`](HeldLock::key), when the layer is
    /// [`fenced`](crate::layer::LockLayerBuilder::fenced): pass it to the storage the
    /// handler writes to, so a write from a request whose lock was lost is refused.
    /// `None` when the layer's locks are not fenced.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.fencing_tokens()[0]
    }

    /// Every key's fencing token, in the order of [`keys`](HeldLock::keys).
    pub fn fencing_tokens(&self) -> &[Option<FencingToken>] {
        match &self.repr {
            Repr::One { token, .. } => std::slice::from_ref(token),
            Repr::Many(many) => &many.tokens,
        }
    }

    /// How the locks are held (exclusive, read, write, ...).
    pub fn mode(&self) -> LockMode {
        match &self.repr {
            Repr::One { mode, .. } => *mode,
            Repr::Many(many) => many.mode,
        }
    }

    /// The request's owner: the same one [`Locks`](crate::extract::Locks) acquires as.
    pub fn owner(&self) -> &Owner {
        match &self.repr {
            Repr::One { owner, .. } => owner,
            Repr::Many(many) => &many.owner,
        }
    }

    /// Fires when any of the request's locks is lost.
    pub fn lost(&self) -> LostSignal {
        self.lost_signal().clone()
    }

    /// Whether any of the request's locks has been lost.
    pub fn is_lost(&self) -> bool {
        self.lost_signal().is_lost()
    }

    fn lost_signal(&self) -> &LostSignal {
        match &self.repr {
            Repr::One { lost, .. } => lost,
            Repr::Many(many) => &many.lost,
        }
    }
}

impl fmt::Debug for HeldLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldLock")
            .field("keys", &self.keys())
            .field("fencing_tokens", &self.fencing_tokens())
            .field("mode", &self.mode())
            .field("owner", self.owner())
            .field("lost", &self.is_lost())
            .finish()
    }
}
