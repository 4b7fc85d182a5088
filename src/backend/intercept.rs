//! [`Intercepted`]: a backend around another one that changes only what it means to.
//! The docs are on [`Intercept`]: this module is private, both are re-exported from
//! `backend`.

use super::{
    Acquire, BoxFuture, ClientNames, LocalStore, LockBackend, LockMode, LockRequest, LockState,
    Release, ReplayStore, StoreAdmin, StoreProfile, Subscription, admin_of,
};
use crate::error::Result;
use crate::key::LockKey;

/// What an [`Intercepted`] backend changes about the backend `B` it wraps. Every method
/// forwards to `inner` by default.
///
/// A wrapper that implements [`LockBackend`] by hand must forward every method, and a
/// forgotten one silently changes behaviour: a dropped [`abandon`](LockBackend::abandon)
/// lets late attempts take locks, a dropped profile loses the clock-drift allowance, a
/// dropped [`local`](LockBackend::local) sends a test down a path production never
/// takes. An [`Intercept`] has a default for every call that forwards it to the inner
/// backend unchanged, so a wrapper writes only the calls it changes — as a tower
/// middleware is a `Service` around a `Service`, with the difference that every call not
/// written here still reaches the store.
///
/// # Example
///
/// Counting acquisitions, through both routes an acquisition can take:
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use tower_lock::backend::{Acquire, BoxFuture, Intercept, Intercepted, LockBackend, LockRequest};
/// use tower_lock::{LockClient, MemoryBackend, Result};
///
/// #[derive(Clone, Default)]
/// struct CountAcquires(Arc<AtomicUsize>);
///
/// impl<B: LockBackend> Intercept<B> for CountAcquires {
///     fn acquire<'a>(&'a self, inner: &'a B, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
///         self.0.fetch_add(1, Ordering::Relaxed);
///         inner.acquire(req)
///     }
///
///     fn acquire_now(&self, inner: &B, req: &LockRequest) -> Option<Result<Acquire>> {
///         let answer = inner.local()?.acquire_now(req)?;
///         self.0.fetch_add(1, Ordering::Relaxed);
///         Some(answer)
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<()> {
/// let backend = Intercepted::new(MemoryBackend::new(), CountAcquires::default());
/// let client = LockClient::new(backend.clone());
/// client.get_lock("k")?.lock().await?.unlock().await?;
/// assert_eq!(backend.intercept().0.load(Ordering::Relaxed), 1);
/// // Everything else reached the store as it is: the profile, the fast path.
/// assert_eq!(backend.profile().name(), "memory");
/// assert!(backend.local().is_some());
/// # Ok(())
/// # }
/// ```
///
/// # Two routes
///
/// Three calls can reach a store by two routes, and an intercept that changes one of
/// them usually means to change both:
///
/// - an acquisition: [`acquire`](Intercept::acquire), or on the fast path
///   [`acquire_now`](Intercept::acquire_now) when the inner store has one;
/// - a release: [`release`](Intercept::release) or [`release_now`](Intercept::release_now);
/// - a renewal: [`renew`](Intercept::renew), or the watchdog's batch
///   [`renew_many`](Intercept::renew_many).
///
/// A fast-path method may return `None` to send the call the async way (a release held
/// back at a gate cannot be answered on the spot). [`abandon`](Intercept::abandon)
/// reaches the inner store's own `abandon`, not this intercept's `release`: intercept it
/// too to delay or fail it.
pub trait Intercept<B: LockBackend>: Send + Sync + 'static {
    /// [`LockBackend::profile`].
    fn profile<'a>(&'a self, inner: &'a B) -> &'a StoreProfile {
        inner.profile()
    }

    /// [`LockBackend::acquire`]; see also [`acquire_now`](Intercept::acquire_now).
    fn acquire<'a>(&'a self, inner: &'a B, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        inner.acquire(req)
    }

    /// [`LocalStore::acquire_now`], offered when `inner` has a fast path.
    fn acquire_now(&self, inner: &B, req: &LockRequest) -> Option<Result<Acquire>> {
        inner.local()?.acquire_now(req)
    }

    /// [`LockBackend::renew`]; see also [`renew_many`](Intercept::renew_many).
    fn renew<'a>(&'a self, inner: &'a B, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        inner.renew(req)
    }

    /// [`LockBackend::renew_many`]: how the watchdog renews.
    fn renew_many<'a>(
        &'a self,
        inner: &'a B,
        reqs: &'a [LockRequest],
    ) -> BoxFuture<'a, Vec<Result<bool>>> {
        inner.renew_many(reqs)
    }

    /// [`LockBackend::release`]; see also [`release_now`](Intercept::release_now).
    fn release<'a>(&'a self, inner: &'a B, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        inner.release(req)
    }

    /// [`LocalStore::release_now`], offered when `inner` has a fast path.
    fn release_now(&self, inner: &B, req: &LockRequest) -> Option<Result<Release>> {
        inner.local()?.release_now(req)
    }

    /// [`LockBackend::abandon`].
    fn abandon<'a>(&'a self, inner: &'a B, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        inner.abandon(req)
    }

    /// [`LockBackend::subscribe`].
    fn subscribe<'a>(
        &'a self,
        inner: &'a B,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        inner.subscribe(req)
    }

    /// [`LockBackend::has_local_waiters`].
    fn has_local_waiters(&self, inner: &B, req: &LockRequest) -> bool {
        inner.has_local_waiters(req)
    }

    /// [`LockBackend::cancel_wait`].
    fn cancel_wait<'a>(&'a self, inner: &'a B, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        inner.cancel_wait(req)
    }

    /// [`StoreAdmin::inspect`], when `inner` has [administration](LockBackend::admin).
    fn inspect<'a>(
        &'a self,
        inner: &'a B,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<LockState>> {
        match admin_of(inner) {
            Ok(admin) => admin.inspect(key, mode),
            Err(error) => Box::pin(std::future::ready(Err(error))),
        }
    }

    /// [`StoreAdmin::force_release`], when `inner` has administration.
    fn force_release<'a>(
        &'a self,
        inner: &'a B,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        match admin_of(inner) {
            Ok(admin) => admin.force_release(key, mode),
            Err(error) => Box::pin(std::future::ready(Err(error))),
        }
    }

    /// [`StoreAdmin::ping`], when `inner` has administration.
    fn ping<'a>(&'a self, inner: &'a B) -> BoxFuture<'a, Result<()>> {
        match admin_of(inner) {
            Ok(admin) => admin.ping(),
            Err(error) => Box::pin(std::future::ready(Err(error))),
        }
    }

    /// [`StoreAdmin::clients`], when `inner` has administration.
    fn clients<'a>(&'a self, inner: &'a B) -> Option<&'a dyn ClientNames> {
        inner.admin()?.clients()
    }

    /// [`LockBackend::replays`].
    fn replays<'a>(&'a self, inner: &'a B) -> Option<&'a dyn ReplayStore> {
        inner.replays()
    }

    /// [`LockBackend::loss_signal`].
    fn loss_signal(&self, inner: &B, req: &LockRequest) -> Option<super::StoreLoss> {
        inner.loss_signal(req)
    }
}

/// The backend `B` with the calls an [`Intercept`] `I` changes, changed, and every other
/// call forwarded; see [`Intercept`].
///
/// It has a fast path ([`LockBackend::local`]) exactly when `B` has one, answered by
/// the intercept's [`acquire_now`](Intercept::acquire_now) and
/// [`release_now`](Intercept::release_now).
#[derive(Clone, Debug, Default)]
pub struct Intercepted<B, I> {
    inner: B,
    intercept: I,
}

impl<B, I> Intercepted<B, I> {
    /// `inner`, with its calls passing through `intercept`.
    pub fn new(inner: B, intercept: I) -> Self {
        Intercepted { inner, intercept }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The intercept.
    pub fn intercept(&self) -> &I {
        &self.intercept
    }

    /// The wrapped backend and the intercept.
    pub fn into_parts(self) -> (B, I) {
        (self.inner, self.intercept)
    }
}

impl<B: LockBackend, I: Intercept<B>> LockBackend for Intercepted<B, I> {
    fn profile(&self) -> &StoreProfile {
        self.intercept.profile(&self.inner)
    }

    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        self.intercept.acquire(&self.inner, req)
    }

    fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        self.intercept.renew(&self.inner, req)
    }

    fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
        self.intercept.renew_many(&self.inner, reqs)
    }

    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        self.intercept.release(&self.inner, req)
    }

    fn abandon<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        self.intercept.abandon(&self.inner, req)
    }

    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        self.intercept.subscribe(&self.inner, req)
    }

    fn has_local_waiters(&self, req: &LockRequest) -> bool {
        self.intercept.has_local_waiters(&self.inner, req)
    }

    fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        self.intercept.cancel_wait(&self.inner, req)
    }

    fn local(&self) -> Option<&dyn LocalStore> {
        self.inner.local()?;
        Some(self)
    }

    fn admin(&self) -> Option<&dyn StoreAdmin> {
        self.inner.admin()?;
        Some(self)
    }

    fn replays(&self) -> Option<&dyn ReplayStore> {
        self.intercept.replays(&self.inner)
    }

    fn loss_signal(&self, req: &LockRequest) -> Option<super::StoreLoss> {
        self.intercept.loss_signal(&self.inner, req)
    }
}

/// Offered exactly when `B` has administration.
impl<B: LockBackend, I: Intercept<B>> StoreAdmin for Intercepted<B, I> {
    fn inspect<'a>(&'a self, key: &'a LockKey, mode: LockMode) -> BoxFuture<'a, Result<LockState>> {
        self.intercept.inspect(&self.inner, key, mode)
    }

    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        self.intercept.force_release(&self.inner, key, mode)
    }

    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        self.intercept.ping(&self.inner)
    }

    fn clients(&self) -> Option<&dyn ClientNames> {
        self.intercept.clients(&self.inner)
    }
}

impl<B: LockBackend, I: Intercept<B>> LocalStore for Intercepted<B, I> {
    fn acquire_now(&self, req: &LockRequest) -> Option<Result<Acquire>> {
        self.intercept.acquire_now(&self.inner, req)
    }

    fn release_now(&self, req: &LockRequest) -> Option<Result<Release>> {
        self.intercept.release_now(&self.inner, req)
    }
}

/// The intercept that changes nothing.
impl<B: LockBackend> Intercept<B> for () {}

/// The method list of the contract is written in several places: the traits, the
/// `Arc`/`Box` forwarding, [`Intercept`] and [`Intercepted`]. A method added to one and
/// forgotten in another would silently skip the wrapper, so this test reads the
/// sources and fails when they drift apart.
#[cfg(test)]
mod drift {
    use std::collections::BTreeSet;

    const BACKEND: &str = include_str!("mod.rs");
    const ADMIN: &str = include_str!("admin.rs");
    const INTERCEPT: &str = include_str!("intercept.rs");

    /// The names of the `fn`s in the block that starts at the first line `header`
    /// begins, up to its matching closing brace.
    fn methods(source: &str, header: &str) -> BTreeSet<String> {
        let start = source
            .find(header)
            .unwrap_or_else(|| panic!("no `{header}` in the source"));
        let open = start + source[start..].find('{').expect("a block");
        let mut depth = 0usize;
        let mut end = open;
        for (i, c) in source[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        source[open..end]
            .split("fn ")
            .skip(1)
            .filter_map(|rest| {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                (!name.is_empty()).then_some(name)
            })
            .collect()
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn every_place_that_lists_the_contract_lists_all_of_it() {
        let backend = methods(BACKEND, "pub trait LockBackend");
        let admin = methods(ADMIN, "pub trait StoreAdmin");
        let local = methods(BACKEND, "pub trait LocalStore");
        assert_eq!(backend.len(), 13, "LockBackend changed: {backend:?}");
        assert_eq!(
            methods(BACKEND, "macro_rules! forward_backend"),
            backend,
            "the Arc/Box forwarding drifted from LockBackend"
        );
        assert_eq!(
            methods(
                INTERCEPT,
                "impl<B: LockBackend, I: Intercept<B>> LockBackend for"
            ),
            backend,
            "Intercepted drifted from LockBackend"
        );
        assert_eq!(
            methods(
                INTERCEPT,
                "impl<B: LockBackend, I: Intercept<B>> StoreAdmin for"
            ),
            admin,
            "Intercepted drifted from StoreAdmin"
        );
        assert_eq!(
            methods(
                INTERCEPT,
                "impl<B: LockBackend, I: Intercept<B>> LocalStore for"
            ),
            local,
            "Intercepted drifted from LocalStore"
        );
        // An intercept sees every call: the operations, the fast path and the
        // administration; `local` and `admin` are how Intercepted offers the last two.
        let mut expected: BTreeSet<String> = backend
            .difference(&set(&["local", "admin"]))
            .cloned()
            .collect();
        expected.extend(local);
        expected.extend(admin);
        assert_eq!(
            methods(INTERCEPT, "pub trait Intercept<B: LockBackend>"),
            expected,
            "Intercept drifted from the contract"
        );
    }

    #[test]
    fn the_reader_finds_what_it_should() {
        let names = methods("trait T { fn a(&self); fn b_c() {} }", "trait T");
        assert_eq!(names, set(&["a", "b_c"]));
    }
}
