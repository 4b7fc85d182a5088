//! [`StoreLoss`]: how a store that drops holds by itself tells the lock core at once.

use tokio_util::sync::CancellationToken;

/// A signal a store fires when it dropped a set of holds by itself, without anyone
/// asking: a ZooKeeper session that expired takes every ephemeral node of it along.
///
/// A backend whose holds can vanish so hands one out per hold from
/// [`LockBackend::loss_signal`](super::LockBackend::loss_signal); the lock core marks
/// the hold lost the moment the signal fires (its guards' lost signal fires too), rather
/// than at the next renewal. Clones share one signal: one per session, say, fired once.
///
/// ```
/// use tower_lock::backend::StoreLoss;
///
/// let session = StoreLoss::new();
/// let for_a_hold = session.clone();
/// assert!(!for_a_hold.is_fired());
/// session.fire();
/// assert!(for_a_hold.is_fired());
/// ```
#[derive(Clone, Debug, Default)]
pub struct StoreLoss(CancellationToken);

impl StoreLoss {
    /// A signal not fired yet.
    pub fn new() -> Self {
        StoreLoss(CancellationToken::new())
    }

    /// Fires the signal, for good: every hold it was handed out for is lost.
    pub fn fire(&self) {
        self.0.cancel();
    }

    /// Whether it fired.
    pub fn is_fired(&self) -> bool {
        self.0.is_cancelled()
    }

    /// Ready once it fired.
    pub async fn fired(&self) {
        self.0.cancelled().await;
    }
}
