//! [`LockLayer`] and its builder.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, Response, StatusCode};
use tower::Layer;

use super::config::{Config, ModeSelect, OnLost, ReleaseOn};
use super::keys::{KeyError, KeyExtractor, Keys};
use super::rejection::{OnRejection, Rejection, RejectionBody, keep_retry_after};
use super::report::Report;
use super::service::LockService;
use crate::backend::LockMode;
use crate::error::{ConfigError, Result};
use crate::key::LockKey;
use crate::lock::{LayerEvent, LayerKind, LayerOutcome, Lease, LockClient};

/// What every clone of a layer, its services and their futures share.
pub(crate) struct Core {
    pub(crate) client: LockClient,
    pub(crate) config: Config,
    /// What the layer remembers to keep its failure log short.
    pub(crate) report: Report,
}

impl Core {
    /// Answers a request the layer rejects (`key`: its first key, if one was derived),
    /// observed and traced.
    pub(crate) fn reject(
        &self,
        rejection: Rejection,
        key: Option<&LockKey>,
    ) -> Response<RejectionBody> {
        self.outcome(key, rejection.outcome());
        let retry_after = rejection.retry_after_secs();
        let transient = rejection.transient();
        let mut response = self.config.on_rejection.on_rejection(rejection);
        keep_retry_after(&mut response, retry_after);
        if let Some(transient) = transient {
            response.extensions_mut().insert(transient);
        }
        response
    }

    /// Reports what the layer did with a request to the observer, and, but for a
    /// request served under its lock (whose span already says `locked`), to the layer's
    /// span.
    pub(crate) fn outcome(&self, key: Option<&LockKey>, outcome: LayerOutcome) {
        if outcome != LayerOutcome::Served {
            tracing::Span::current().record("decision", outcome.as_str());
        }
        if let Some(observer) = self.client.hooks().observer() {
            let event = LayerEvent {
                kind: LayerKind::Lock,
                layer: self.name(),
                // Without a key, none: the extractor's namespace is not the layer's to
                // know, and its prefix alone would name a series no key is counted in.
                namespace: key.map_or("", |k| k.namespace()),
                key,
                not_stored: None,
            };
            observer.layer_outcome(event, outcome);
        }
    }

    /// The layer's name, for metrics and logs.
    pub(crate) fn name(&self) -> &str {
        self.config.layer_name()
    }

    /// Puts the configured prefix in front of every key.
    pub(crate) fn prefixed(&self, keys: Keys) -> Result<Keys, KeyError> {
        match &self.config.key_prefix {
            None => Ok(keys),
            Some(prefix) => {
                keys.try_map(|k| LockKey::new(format!("{prefix}:{k}")).map_err(KeyError::from))
            }
        }
    }
}

pub(crate) struct Shared<K> {
    pub(crate) core: Arc<Core>,
    pub(crate) keys: K,
}

/// Locks each request on the key(s) its key function derives, for the time the inner
/// service handles it. See the [module docs](crate::layer).
///
/// Cheap to clone: the client, the configuration and the key function sit behind one
/// `Arc`; clones never make another backend, connection or watchdog.
pub struct LockLayer<K> {
    shared: Arc<Shared<K>>,
}

impl<K: KeyExtractor> LockLayer<K> {
    /// Locks every request on the keys `keys` derives from it, with the defaults: wait up to
    /// [`DEFAULT_WAIT`](super::DEFAULT_WAIT), hold with the watchdog, release when the
    /// response is ready, answer a busy lock with
    /// [`DEFAULT_BUSY_STATUS`](super::DEFAULT_BUSY_STATUS), fail closed.
    ///
    /// `client` is the application's [`LockClient`]: make one per store at startup and
    /// pass clones to every layer, so that they share one identity, one watchdog, and
    /// the observer, name and key redaction the client was built with, and a handler's
    /// own locks re-enter the request's. A backend is accepted too (through
    /// [`From`]), for a layer that is the only user of its store (a test): it gets a
    /// client of its own, built with [`LockClient::new`], so none of those settings.
    ///
    /// ```
    /// use axum::{Router, routing::post};
    /// use tower_lock::layer::{LockLayer, PathParamKey};
    /// use tower_lock::{LockClient, MemoryBackend};
    ///
    /// let client = LockClient::new(MemoryBackend::new()); // one per store, cloned
    /// let account = PathParamKey::new("id").namespace("account")?;
    /// let app: Router = Router::new()
    ///     .route("/accounts/{id}/deposits", post(|| async { "ok" })
    ///         .route_layer(LockLayer::new(client.clone(), account.clone())))
    ///     .route("/accounts/{id}/withdrawals", post(|| async { "ok" })
    ///         .route_layer(LockLayer::new(client.clone(), account)));
    /// # Ok::<(), tower_lock::Error>(())
    /// ```
    pub fn new(client: impl Into<LockClient>, keys: K) -> Self {
        let client = client.into();
        let config = Config {
            lease: super::config::request_lease(&client),
            ..Config::default()
        };
        LockLayer::from_parts(client, keys, config)
    }

    /// Configures a layer; see [`LockLayerBuilder`]. `client` as for
    /// [`new`](Self::new).
    pub fn builder(client: impl Into<LockClient>, keys: K) -> LockLayerBuilder<K> {
        LockLayerBuilder {
            client: client.into(),
            keys,
            config: Config::default(),
            mode: Ok(ModeSelect::Fixed(LockMode::Exclusive)),
            mode_setter: None,
            lease_set: false,
        }
    }

    fn from_parts(client: LockClient, keys: K, config: Config) -> Self {
        LockLayer {
            shared: Arc::new(Shared {
                core: Arc::new(Core {
                    client,
                    config,
                    report: Report::new(),
                }),
                keys,
            }),
        }
    }
}

impl<K> LockLayer<K> {
    /// The client the layer locks with.
    pub fn client(&self) -> &LockClient {
        &self.shared.core.client
    }
}

impl<K> Clone for LockLayer<K> {
    fn clone(&self) -> Self {
        LockLayer {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, K> Layer<S> for LockLayer<K> {
    type Service = LockService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        LockService::new(inner, Arc::clone(&self.shared))
    }
}

impl<K> fmt::Debug for LockLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockLayer")
            .field("client", &self.shared.core.client)
            .field("config", &self.shared.core.config)
            .finish_non_exhaustive()
    }
}

/// Configures a [`LockLayer`]. Setters consume and return the builder;
/// [`build`](LockLayerBuilder::build) checks every value and names the first bad one.
///
/// ```
/// use std::time::Duration;
/// use http::{HeaderName, Method};
/// use tower_lock::layer::{HeaderKey, LockLayer};
/// use tower_lock::{LockClient, MemoryBackend};
///
/// let client = LockClient::new(MemoryBackend::new());
/// let layer = LockLayer::builder(
///     client.clone(),
///     HeaderKey::new(HeaderName::from_static("x-user-id")),
/// )
/// .key_prefix("lock:order")
/// .max_wait(Duration::from_millis(500))
/// .methods([Method::POST])
/// .build()?;
/// # let _ = layer;
///
/// let err = LockLayer::builder(client, HeaderKey::new(HeaderName::from_static("x")))
///     .lease(Duration::ZERO)
///     .build()
///     .unwrap_err();
/// assert!(err.to_string().contains("`lease`"));
/// # Ok::<(), tower_lock::Error>(())
/// ```
#[must_use]
pub struct LockLayerBuilder<K> {
    client: LockClient,
    keys: K,
    config: Config,
    mode: Result<ModeSelect, ConfigError>,
    /// The setter that chose the mode, to name both when another one conflicts.
    mode_setter: Option<&'static str>,
    /// Whether [`lease`](Self::lease) was set: else the client's request lease.
    lease_set: bool,
}

impl<K: KeyExtractor> LockLayerBuilder<K> {
    /// The longest a request waits for a busy lock before it is rejected as busy. Zero:
    /// one attempt. Default [`DEFAULT_WAIT`](super::DEFAULT_WAIT); at most
    /// [`MAX_WAIT`](super::MAX_WAIT). A store outage (a failover, a restart) is waited
    /// out within the same bound: the request is answered as unavailable (or served
    /// without its lock, with [`fail_open`](Self::fail_open)) only when the store has
    /// not answered by then.
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.config.wait = wait;
        self
    }

    /// How the lock is held: renewed while the request runs — by default with
    /// [`DEFAULT_REQUEST_LEASE`](super::DEFAULT_REQUEST_LEASE) ([`Lease::Renewed`]), with
    /// the client's watchdog lease ([`Lease::Watchdog`]) — or a fixed lease (a
    /// `Duration`): the lock is freed when it ends, and the request is then treated as
    /// having lost it (see [`on_lost`](Self::on_lost)).
    pub fn lease(mut self, lease: impl Into<Lease>) -> Self {
        self.config.lease = lease.into();
        self.lease_set = true;
        self
    }

    /// The status for a lock still busy after the wait. Default
    /// [`DEFAULT_BUSY_STATUS`](super::DEFAULT_BUSY_STATUS) (429, and why); 409 and 423
    /// are the usual alternatives. Must be 4xx or 5xx. `Retry-After` is sent whatever
    /// the status.
    pub fn busy_status(mut self, status: StatusCode) -> Self {
        self.config.busy_status = status;
        self
    }

    /// `Retry-After` for a lock still busy after the wait: when retrying makes sense.
    /// Default [`DEFAULT_BUSY_RETRY_AFTER`](super::DEFAULT_BUSY_RETRY_AFTER) (1 s). With
    /// a fixed [`lease`](Self::lease) the holder's remaining lease is sent instead when
    /// it is sooner (it is a real bound then; under the watchdog it is not). Rounded up
    /// to whole seconds; at most [`MAX_RETRY_AFTER`](super::MAX_RETRY_AFTER).
    pub fn busy_retry_after(mut self, retry_after: Duration) -> Self {
        self.config.busy_retry_after = retry_after;
        self
    }

    /// Replaces the default rejection responses (plain text, see
    /// [`Rejection::into_response`](super::Rejection::into_response)) with
    /// `handler(rejection)`: with the `axum` feature, a closure returning anything
    /// `IntoResponse`. An error response (4xx or 5xx) without `Retry-After` gets the
    /// layer's, when the rejection has one; a handler that sets its own keeps it.
    pub fn on_rejection(mut self, handler: impl OnRejection) -> Self {
        self.config.on_rejection = Arc::new(handler);
        self
    }

    /// When the lock store cannot answer (unreachable, timed out, no quorum) within a
    /// request's [`max_wait`](Self::max_wait), serve requests without their lock
    /// instead of answering 503. Either way the outage is
    /// logged as a warning, at most once per
    /// [`OUTAGE_LOG_INTERVAL`](super::OUTAGE_LOG_INTERVAL) with the count of requests
    /// since.
    /// Default `false` (fail closed): availability over exclusion is a choice to make
    /// per route, knowingly. A misconfiguration (a key holding another type of data, an
    /// unsupported mode, no runtime) always fails closed.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config.fail_open = fail_open;
        self
    }

    /// `Retry-After` for 503 answers (store unavailable, lock lost). Default
    /// [`DEFAULT_UNAVAILABLE_RETRY_AFTER`](super::DEFAULT_UNAVAILABLE_RETRY_AFTER);
    /// rounded up to whole seconds.
    pub fn unavailable_retry_after(mut self, retry_after: Duration) -> Self {
        self.config.unavailable_retry_after = retry_after;
        self
    }

    /// When the lock is released: with the response head (the default), or once the
    /// response body has been sent ([`ReleaseOn::BodyEnd`], for streaming responses
    /// whose body does the protected work).
    ///
    /// With `BodyEnd` the release finishes before the client can have the body's last
    /// byte, on HTTP/1.1 and HTTP/2 (see [`LockBody`](super::LockBody)); a response
    /// without a body (to `HEAD`, a 204 or 304, an empty body) releases with its head. A
    /// lock lost while the body streams is logged (at `error`) and released with the
    /// body, but the body is not cut: the response has begun and its status is sent.
    /// Work the body does under the lock should carry the fencing token
    /// ([`HeldLock`](crate::extract::HeldLock)) to the storage it writes to.
    pub fn release_on(mut self, release_on: ReleaseOn) -> Self {
        self.config.release_on = release_on;
        self
    }

    /// What to do when the lock is lost while the inner service runs. Default
    /// [`OnLost::Cancel`].
    pub fn on_lost(mut self, on_lost: OnLost) -> Self {
        self.config.on_lost = on_lost;
        self
    }

    /// Lock only requests with these methods; others pass through unlocked (they still
    /// get an owner, so [`Locks`](crate::extract::Locks) works). Default: all methods.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = Some(methods.into_iter().collect());
        self
    }

    /// Names the layer in its metrics (the `layer` label of
    /// `tower_lock_layer_outcomes_total`), its observer events
    /// ([`LayerEvent::layer`](crate::LayerEvent::layer)) and its log lines, so that two
    /// layers of a process can be told apart: `orders`, `payments`. Default: the
    /// [`key_prefix`](Self::key_prefix), or `""` without one. Not empty, at most
    /// [`MAX_LAYER_NAME_LEN`](super::MAX_LAYER_NAME_LEN) bytes, no control characters;
    /// keep it a fixed text, since every name is a metric series of its own.
    ///
    /// ```
    /// use http::HeaderName;
    /// use tower_lock::layer::{HeaderKey, LockLayer};
    /// use tower_lock::MemoryBackend;
    ///
    /// let orders = LockLayer::builder(
    ///     MemoryBackend::new(),
    ///     HeaderKey::new(HeaderName::from_static("x-user-id")).namespace("lock:order")?,
    /// )
    /// .name("orders")
    /// .build()?;
    /// # let _ = orders;
    /// # Ok::<(), tower_lock::Error>(())
    /// ```
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.config.name = Some(name.into());
        self
    }

    /// Puts `prefix:` in front of every key (`lock:order` + `{42}` →
    /// `lock:order:{42}`). A [`Namespace`](crate::Namespace), not empty: at most
    /// [`MAX_NAMESPACE_LEN`](crate::MAX_NAMESPACE_LEN) bytes, no braces or control
    /// characters, no `:` at either end (`"lock:"` would double it) or two in a row;
    /// [`build`](Self::build) names `key_prefix` otherwise.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.key_prefix = Some(prefix.into());
        self
    }

    /// Fencing tokens for every request's locks (default: off): handlers read them from
    /// [`HeldLock::fencing_token`](crate::extract::HeldLock::fencing_token) and pass them
    /// to the storage they write to, which refuses a stale request's writes. A fenced
    /// lock keeps one small counter per key in the store after it is released (on
    /// Redis, Redisson `RFencedLock`'s `redisson_lock_token:{NAME}`, about 70 bytes plus
    /// the key): with a key per user, one per user who ever came. Unfenced locks leave
    /// nothing behind.
    pub fn fenced(mut self, fenced: bool) -> Self {
        self.config.fenced = fenced;
        self
    }

    /// Fair locks: waiting requests get the lock in arrival order. Needs a backend
    /// that implements [`LockMode::Fair`]. One kind per layer: setting another one too
    /// is an error at [`build`](Self::build).
    pub fn fair(self) -> Self {
        self.select_mode("fair", Ok(ModeSelect::Fixed(LockMode::Fair)))
    }

    /// A read-write lock per key: `GET`, `HEAD` and `OPTIONS` take the read side
    /// (they run together), other methods the write side (alone). Needs a backend that
    /// implements [`LockMode::Read`] and [`LockMode::Write`]. One kind per layer.
    pub fn read_write_by_method(self) -> Self {
        self.select_mode("read_write_by_method", Ok(ModeSelect::ReadWriteByMethod))
    }

    /// At most `max` requests per key at once (a leased semaphore). Needs a backend
    /// that implements [`LockMode::Permits`]. `max` must be at least 1. One kind per
    /// layer.
    pub fn permits(self, max: u32) -> Self {
        let mode = NonZeroU32::new(max)
            .map(|max| ModeSelect::Fixed(LockMode::Permits { max }))
            .ok_or_else(|| ConfigError::invalid_setting("permits", "must be at least 1 (got 0)"));
        self.select_mode("permits", mode)
    }

    /// Records the kind of lock; a second setter choosing another kind (or the same
    /// kind with another `max`) is an error at `build`, never a silent overwrite.
    fn select_mode(mut self, setter: &'static str, mode: Result<ModeSelect, ConfigError>) -> Self {
        self.mode = match (self.mode, self.mode_setter, mode) {
            (Err(first_error), _, _) => Err(first_error),
            (Ok(current), Some(first), Ok(new)) if current != new => {
                Err(ConfigError::invalid_setting(
                    "mode",
                    format!(
                        "is set twice, by `{first}` and `{setter}`; a layer takes one kind of lock"
                    ),
                ))
            }
            (_, _, mode) => mode,
        };
        self.mode_setter = Some(setter);
        self
    }

    /// Checks the configuration and builds the layer.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`] naming the first bad setting: `max_wait` over
    /// [`MAX_WAIT`](super::MAX_WAIT), `lease` outside
    /// [`MIN_LEASE`](crate::MIN_LEASE)..=[`MAX_LEASE`](crate::MAX_LEASE), `busy_status`
    /// not 4xx/5xx, `busy_retry_after` or `unavailable_retry_after` zero or over
    /// [`MAX_RETRY_AFTER`](super::MAX_RETRY_AFTER), `methods` empty, `key_prefix` empty
    /// or with braces or control characters, `name` empty, too long or with control
    /// characters, `permits` zero, `mode` set twice.
    pub fn build(self) -> Result<LockLayer<K>, ConfigError> {
        let mut config = self.config;
        config.mode = self.mode?;
        if !self.lease_set {
            config.lease = super::config::request_lease(&self.client);
        }
        config.validate()?;
        Ok(LockLayer::from_parts(self.client, self.keys, config))
    }
}

impl<K> fmt::Debug for LockLayerBuilder<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockLayerBuilder")
            .field("client", &self.client)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}
