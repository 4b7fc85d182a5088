//! [`IdempotencyLayer`] and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, Method, StatusCode, header};
use tower::Layer;

use super::record::Fingerprint;
use super::rejection::{IdempotencyRejection, OnIdempotencyRejection, ProblemJson};
use super::service::IdempotencyService;
use crate::error::{ConfigError, Result};
use crate::key::LockKey;
use crate::layer::config::{check_layer_name, check_retry_after};
use crate::layer::rejection::{keep_retry_after, retry_after_secs};
use crate::layer::{KeyExtractor, MAX_WAIT};
use crate::lock::{LayerEvent, LayerKind, LayerOutcome, Lease, LockClient, NotStoredReason};
use crate::namespace::Namespace;

/// The request header carrying the key: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header a replayed response carries: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// How long a stored response is replayed by default: 24 hours, as Stripe keeps keys.
/// Longer than any client's retries; short enough that stores stay small.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// The longest TTL accepted: 30 days. A longer one is a unit mix-up.
pub const MAX_TTL: Duration = Duration::from_secs(30 * 24 * 60 * 60);

/// The longest key accepted by default: 255 bytes (a UUID is 36).
pub const DEFAULT_MAX_KEY_LEN: usize = 255;

/// The largest request body read to fingerprint a request by default: 1 MiB. Larger
/// requests are refused (`413`).
pub const DEFAULT_MAX_BODY: usize = 1024 * 1024;

/// The largest response body stored for replay by default: 16 KiB
/// ([`IdempotencyLayerBuilder::max_stored_body`]). An API's answers to the requests an
/// idempotency key guards (an order, a payment) are a few hundred bytes; a larger one
/// is passed through unstored.
pub const DEFAULT_MAX_STORED_BODY: usize = 16 * 1024;

/// How long a response's body is read to store it, by default, before it is passed on
/// as it comes, unstored: 1 s ([`IdempotencyLayerBuilder::max_stored_body_wait`]). The
/// answers an idempotency key guards are made at once; a body still coming after a
/// second is a stream, and holding it back longer would only delay its client.
pub const DEFAULT_MAX_STORED_BODY_WAIT: Duration = Duration::from_secs(1);

/// How many stored responses one caller (one scope) may have at once by default:
/// 1,000 ([`IdempotencyLayerBuilder::max_records_per_scope`]).
pub const DEFAULT_MAX_RECORDS_PER_SCOPE: u32 = 1_000;

/// How many stored responses the layer may have at once, all callers together, by
/// default: 100,000 ([`IdempotencyLayerBuilder::max_records`]).
pub const DEFAULT_MAX_RECORDS: u32 = 100_000;

/// The `Prefix` of every key: `idempotency`.
pub const DEFAULT_KEY_PREFIX: &str = "idempotency";

/// The statuses never stored for replay, whatever
/// [`store_if`](IdempotencyLayerBuilder::store_if) says: `408 Request Timeout`,
/// `425 Too Early`, `429 Too Many Requests` and `503 Service Unavailable` each mean
/// "not now", and a retry must run the request rather than be told "not now" again for
/// the record's TTL. So is any response a [`LockLayer`](crate::LockLayer) marked
/// [`Transient`](crate::layer::Transient) (busy, store unavailable, lock lost),
/// whatever its status.
pub const NEVER_STORED: [StatusCode; 4] = [
    StatusCode::REQUEST_TIMEOUT,
    StatusCode::TOO_EARLY,
    StatusCode::TOO_MANY_REQUESTS,
    StatusCode::SERVICE_UNAVAILABLE,
];

/// `Retry-After` for a request whose first is still in flight: 1 s.
pub const DEFAULT_IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The response headers stored and replayed by default: those that describe the
/// response's content and where it lives. Never `Set-Cookie` or anything else that
/// belongs to one client's session.
pub const DEFAULT_STORED_HEADERS: [HeaderName; 8] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::LINK,
];

type FingerprintFn = dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync;
type StoreIf = dyn Fn(StatusCode) -> bool + Send + Sync;
type OnReplay = dyn Fn(&mut http::response::Parts, &Replay) + Send + Sync;

/// The default of [`store_if`](IdempotencyLayerBuilder::store_if): every status below
/// 500 is final and stored; a 5xx is not, and a retry runs the handler again.
///
/// Why: a 5xx from a handler most often means its work did not happen (a database
/// error rolled the transaction back, a dependency timed out before the write), and the
/// retry is the client's way to get it done. Replaying the 5xx for a day would turn a
/// blip into a lost order. This departs from the IETF draft and from Stripe, which
/// store 5xx too; [`stripe`] is their behaviour.
pub fn below_500(status: StatusCode) -> bool {
    !status.is_server_error()
}

/// A [`store_if`](IdempotencyLayerBuilder::store_if) preset: every status is stored,
/// 5xx included, as Stripe and the IETF draft do; "not now" answers
/// ([`NEVER_STORED`], [`Transient`](crate::layer::Transient)) are still never stored.
/// For handlers whose 5xx may come after their effect (a charge made, then a failure
/// to answer), where running the retry could do it twice.
///
/// ```
/// use tower_lock::idempotency::{self, IdempotencyLayer};
/// # use tower_lock::{LockClient, MemoryBackend};
/// # let client = LockClient::new(MemoryBackend::new());
/// # let scope = tower_lock::layer::HeaderKey::new(http::HeaderName::from_static("x-user"));
/// let layer = IdempotencyLayer::builder(client, scope)
///     .store_if(idempotency::stripe)
///     .build()?;
/// # Ok::<(), tower_lock::ConfigError>(())
/// ```
pub fn stripe(status: StatusCode) -> bool {
    let _ = status;
    true
}

/// What a [`on_replay`](IdempotencyLayerBuilder::on_replay) hook is told about the
/// stored response it answers with.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Replay {
    /// When the response was stored, by the storing replica's clock.
    pub stored_at: std::time::SystemTime,
    /// When it stops being replayed: `stored_at` plus this layer's
    /// [`ttl`](IdempotencyLayerBuilder::ttl).
    pub expires_at: std::time::SystemTime,
}

/// At most this many parts hold everyone's quota of stored responses.
const MAX_TOTAL_PARTS: u32 = 16;
/// Everyone's quota gets a part per this many records (at least one part).
const RECORDS_PER_PART: u32 = 4_096;

/// The names of the quotas' permits.
pub(crate) struct Quotas {
    /// A caller's permits are `<this>:{<scope>}`.
    pub(crate) scope: Namespace,
    /// Every caller's together, in parts: `<prefix>:quota-total:{records-<i>}`, each
    /// with its share of the records. One name taken by every new key of every caller
    /// serialized them all on it (on PostgreSQL a transaction each, under one advisory
    /// lock); in parts, as many go at once as there are parts.
    pub(crate) total: Vec<(LockKey, u32)>,
}

impl Quotas {
    fn under(prefix: &Namespace, max_records: u32) -> Result<Self, ConfigError> {
        let name = |suffix: &str| match prefix.as_str() {
            "" => suffix.to_owned(),
            prefix => format!("{prefix}:{suffix}"),
        };
        let parts = (max_records / RECORDS_PER_PART).clamp(1, MAX_TOTAL_PARTS);
        let total = (0..parts)
            .map(|i| {
                let share = max_records / parts + u32::from(i < max_records % parts);
                let key = LockKey::namespaced(&name("quota-total"), &format!("records-{i}"))?;
                Ok((key, share))
            })
            .collect::<Result<Vec<_>, ConfigError>>()?;
        Ok(Quotas {
            scope: Namespace::for_setting("key_prefix", name("quota"))?,
            total,
        })
    }
}

pub(crate) struct Config {
    pub(crate) header: HeaderName,
    pub(crate) prefix: Namespace,
    pub(crate) name: Option<String>,
    pub(crate) ttl: Duration,
    pub(crate) max_key_len: usize,
    pub(crate) max_body: usize,
    pub(crate) max_stored_body: usize,
    pub(crate) max_stored_body_wait: Duration,
    pub(crate) max_records_per_scope: u32,
    pub(crate) max_records: u32,
    /// Where the quotas' permits live: `<prefix>:quota` (a caller's, in the hash tag of
    /// its scope) and `<prefix>:quota-total:{records}`; set by `build`.
    pub(crate) quotas: Option<Quotas>,
    pub(crate) required: bool,
    pub(crate) methods: Vec<Method>,
    pub(crate) wait: Duration,
    pub(crate) lease: Lease,
    pub(crate) in_flight_retry_after: Duration,
    pub(crate) unavailable_retry_after: Duration,
    pub(crate) replay_header: HeaderName,
    pub(crate) stored_headers: Vec<HeaderName>,
    pub(crate) store_if: Arc<StoreIf>,
    pub(crate) on_replay: Option<Arc<OnReplay>>,
    pub(crate) fingerprint: Arc<FingerprintFn>,
    /// The user's handler; `None`: `problems`.
    pub(crate) on_rejection: Option<Arc<dyn OnIdempotencyRejection>>,
    /// The default answers, with their `type` links.
    pub(crate) problems: ProblemJson,
}

impl Config {
    fn new() -> Self {
        Config {
            header: IDEMPOTENCY_KEY,
            prefix: Namespace::for_setting("key_prefix", DEFAULT_KEY_PREFIX)
                .unwrap_or_else(|_| Namespace::empty()),
            name: None,
            ttl: DEFAULT_TTL,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            max_body: DEFAULT_MAX_BODY,
            max_stored_body: DEFAULT_MAX_STORED_BODY,
            max_stored_body_wait: DEFAULT_MAX_STORED_BODY_WAIT,
            max_records_per_scope: DEFAULT_MAX_RECORDS_PER_SCOPE,
            max_records: DEFAULT_MAX_RECORDS,
            quotas: None,
            required: false,
            methods: vec![Method::POST, Method::PATCH],
            wait: Duration::ZERO,
            lease: Lease::Watchdog,
            in_flight_retry_after: DEFAULT_IN_FLIGHT_RETRY_AFTER,
            unavailable_retry_after: crate::layer::DEFAULT_UNAVAILABLE_RETRY_AFTER,
            replay_header: IDEMPOTENT_REPLAYED,
            stored_headers: DEFAULT_STORED_HEADERS.to_vec(),
            store_if: Arc::new(below_500),
            on_replay: None,
            fingerprint: Arc::new(|parts: &Parts, body: &Bytes| Fingerprint::of(parts, body)),
            on_rejection: None,
            problems: ProblemJson::default(),
        }
    }

    pub(crate) fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    pub(crate) fn name(&self) -> &str {
        self.name.as_deref().unwrap_or(self.prefix.as_str())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |name: &'static str, why: String| Err(ConfigError::invalid_setting(name, why));
        if self.ttl < Duration::from_millis(1) || self.ttl > MAX_TTL {
            return bad(
                "ttl",
                format!("must be 1 ms..={MAX_TTL:?} (got {:?})", self.ttl),
            );
        }
        if self.max_key_len == 0 || self.max_key_len > 512 {
            return bad(
                "max_key_len",
                format!("must be 1..=512 (got {})", self.max_key_len),
            );
        }
        if self.max_body == 0 {
            return bad("max_body", "must be at least 1 byte".into());
        }
        if self.max_stored_body == 0 {
            return bad("max_stored_body", "must be at least 1 byte".into());
        }
        if self.max_stored_body_wait.is_zero() || self.max_stored_body_wait > MAX_WAIT {
            return bad(
                "max_stored_body_wait",
                format!(
                    "must be more than zero and at most {MAX_WAIT:?} (got {:?})",
                    self.max_stored_body_wait
                ),
            );
        }
        if self.max_records_per_scope == 0 {
            return bad("max_records_per_scope", "must be at least 1".into());
        }
        if self.max_records == 0 {
            return bad("max_records", "must be at least 1".into());
        }
        if self.methods.is_empty() {
            return bad(
                "methods",
                "is empty: the layer would cover no request".into(),
            );
        }
        if self.wait > MAX_WAIT {
            return bad(
                "max_wait",
                format!("must be at most {MAX_WAIT:?} (got {:?})", self.wait),
            );
        }
        check_retry_after("in_flight_retry_after", self.in_flight_retry_after)?;
        check_retry_after("unavailable_retry_after", self.unavailable_retry_after)?;
        if let Some(name) = &self.name {
            check_layer_name(name)?;
        }
        crate::lock::validate_lease_setting("lease", self.lease)?;
        Ok(())
    }
}

/// What every clone of a layer, its services and their futures share.
pub(crate) struct Shared<K> {
    pub(crate) client: LockClient,
    pub(crate) config: Config,
    pub(crate) scope: K,
    pub(crate) report: crate::layer::report::Report,
}

impl<K> Shared<K> {
    /// Tells the observer, and the request's span, what the layer did.
    pub(crate) fn outcome(&self, key: Option<&LockKey>, outcome: LayerOutcome) {
        self.observe(key, outcome, None);
    }

    /// Tells the observer and the span that nothing was stored, and why; and the log,
    /// once per cause and period, for the causes a server's operator can act on.
    pub(crate) fn not_stored(&self, key: &LockKey, reason: NotStoredReason) {
        match reason {
            NotStoredReason::TooLarge | NotStoredReason::TooSlow | NotStoredReason::Trailers => {
                self.report.not_stored(self.config.name(), reason)
            }
            NotStoredReason::Declined
            | NotStoredReason::Transient
            | NotStoredReason::StoreFailed => {}
        }
        tracing::Span::current().record("not_stored", reason.as_str());
        self.observe(Some(key), LayerOutcome::NotStored, Some(reason));
    }

    fn observe(
        &self,
        key: Option<&LockKey>,
        outcome: LayerOutcome,
        not_stored: Option<NotStoredReason>,
    ) {
        tracing::Span::current().record("idempotency", outcome.as_str());
        if let Some(observer) = self.client.hooks().observer() {
            observer.layer_outcome(
                LayerEvent {
                    kind: LayerKind::Idempotency,
                    layer: self.config.name(),
                    namespace: key.map_or(self.config.prefix.as_str(), |k| k.namespace()),
                    key,
                    not_stored,
                },
                outcome,
            );
        }
    }

    /// The response for `rejection`, observed, with `Retry-After` added to an error
    /// response that has none.
    pub(crate) fn reject(
        &self,
        rejection: IdempotencyRejection,
        key: Option<&LockKey>,
    ) -> http::Response<crate::layer::RejectionBody> {
        let outcome = rejection.outcome();
        match &rejection {
            IdempotencyRejection::Unavailable { error, .. } => {
                self.report.outage(self.config.name(), error, false);
            }
            IdempotencyRejection::Misconfigured(error) => {
                self.report.misconfigured(self.config.name(), error);
            }
            IdempotencyRejection::Scope(error) if error.is_server_error() => {
                self.report.misconfigured(self.config.name(), error);
            }
            _ => {}
        }
        self.outcome(key, outcome);
        let retry_after = rejection.retry_after().map(retry_after_secs);
        let mut response = match &self.config.on_rejection {
            Some(handler) => handler.on_rejection(rejection),
            None => self.config.problems.on_rejection(rejection),
        };
        keep_retry_after(&mut response, retry_after);
        response
    }
}

/// Runs a retried request once and replays its response: see the
/// [module docs](crate::idempotency).
///
/// Cheap to clone: the client, the configuration and the scope extractor sit behind
/// one `Arc`.
pub struct IdempotencyLayer<K> {
    shared: Arc<Shared<K>>,
}

impl<K: KeyExtractor> IdempotencyLayer<K> {
    /// The layer with every default, keys scoped by `scope` (the caller: a user id
    /// authentication established, never a header the client fills in). Cannot fail,
    /// as [`LockLayer::new`](crate::LockLayer::new) cannot: the defaults are valid.
    ///
    /// On a store that keeps no responses (RedLock, a custom backend without a
    /// [`ReplayStore`](crate::backend::ReplayStore)), every request the layer covers is
    /// answered `500` and the cause logged as an ERROR once;
    /// [`builder`](Self::builder)`(..).build()` refuses such a store at startup.
    pub fn new(client: impl Into<LockClient>, scope: K) -> Self {
        let builder = Self::builder(client, scope);
        let mut config = builder.config;
        config.lease = crate::layer::config::request_lease(&builder.client);
        // The default prefix is valid: `None` cannot happen, and would answer 500.
        config.quotas = Quotas::under(&config.prefix, config.max_records).ok();
        Self::assemble(builder.client, config, builder.scope)
    }

    fn assemble(client: LockClient, config: Config, scope: K) -> Self {
        IdempotencyLayer {
            shared: Arc::new(Shared {
                client,
                config,
                scope,
                report: crate::layer::report::Report::new(),
            }),
        }
    }

    /// A builder, to change the defaults. `client` as for [`new`](Self::new).
    pub fn builder(client: impl Into<LockClient>, scope: K) -> IdempotencyLayerBuilder<K> {
        IdempotencyLayerBuilder {
            client: client.into(),
            scope,
            config: Config::new(),
            error: None,
            lease_set: false,
        }
    }
}

impl<K> IdempotencyLayer<K> {
    /// The lock client the layer uses.
    pub fn client(&self) -> &LockClient {
        &self.shared.client
    }
}

impl<K> Clone for IdempotencyLayer<K> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, K> Layer<S> for IdempotencyLayer<K> {
    type Service = IdempotencyService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, Arc::clone(&self.shared))
    }
}

impl<K> fmt::Debug for IdempotencyLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("client", &self.shared.client)
            .field("name", &self.shared.config.name())
            .finish_non_exhaustive()
    }
}

/// Configures an [`IdempotencyLayer`]; [`build`](Self::build) checks it.
#[must_use]
pub struct IdempotencyLayerBuilder<K> {
    client: LockClient,
    scope: K,
    config: Config,
    /// The first setter's error, reported by `build`.
    error: Option<ConfigError>,
    /// Whether [`lease`](Self::lease) was set: else the client's request lease.
    lease_set: bool,
}

impl<K: KeyExtractor> IdempotencyLayerBuilder<K> {
    /// The request header carrying the key. Default: [`IDEMPOTENCY_KEY`].
    pub fn header(mut self, header: HeaderName) -> Self {
        self.config.header = header;
        self
    }

    /// The namespace of the layer's locks and stored responses. Default:
    /// [`DEFAULT_KEY_PREFIX`]; give each layer sharing a store and a route its own.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        match Namespace::for_setting("key_prefix", prefix.into()) {
            Ok(prefix) => self.config.prefix = prefix,
            Err(error) => {
                self.error.get_or_insert(error);
            }
        }
        self
    }

    /// The layer's name in metrics (`layer` label) and logs. Default: its key prefix.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.config.name = Some(name.into());
        self
    }

    /// How long a stored response is replayed. Default: [`DEFAULT_TTL`].
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.ttl = ttl;
        self
    }

    /// The longest key accepted, in bytes. Default: [`DEFAULT_MAX_KEY_LEN`].
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.config.max_key_len = len;
        self
    }

    /// The largest request body read to fingerprint a request (larger: `413`). Default:
    /// [`DEFAULT_MAX_BODY`]. Responses stored are bounded by
    /// [`max_stored_body`](Self::max_stored_body).
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.config.max_body = bytes;
        self
    }

    /// The largest response body stored for replay, in bytes. A body of unknown length
    /// (streamed, chunked) is read up to this and stored when it ends within it, as a
    /// sized one is; a larger one is passed through unstored, with what was read of it
    /// ([`NotStoredReason::TooLarge`]). Default: [`DEFAULT_MAX_STORED_BODY`]. The most a
    /// store keeps for the layer is [`max_records`](Self::max_records) times this (and
    /// the headers kept with it).
    pub fn max_stored_body(mut self, bytes: usize) -> Self {
        self.config.max_stored_body = bytes;
        self
    }

    /// How long the layer reads a response's body to store it before it gives up and
    /// passes the body on as it comes ([`NotStoredReason::TooSlow`]): a stream of
    /// events, or a slow producer, is held back at most this long. The key's lock is
    /// held meanwhile. Default: [`DEFAULT_MAX_STORED_BODY_WAIT`]; at most
    /// [`MAX_WAIT`](crate::layer::MAX_WAIT).
    pub fn max_stored_body_wait(mut self, wait: Duration) -> Self {
        self.config.max_stored_body_wait = wait;
        self
    }

    /// How many stored responses one caller may have at once: a request with a new
    /// key from a caller who has this many is refused with `429 Too Many Requests` and
    /// a `Retry-After` of when the caller's oldest one expires, without running the
    /// handler. Default: [`DEFAULT_MAX_RECORDS_PER_SCOPE`]. A caller is the layer's
    /// scope (the keys its scope extractor gives); callers without one pass through
    /// unprotected and store nothing.
    ///
    /// Rejection, not eviction: evicting a caller's oldest response would let a retry of
    /// it run the handler again, which the layer is there to prevent. Each stored
    /// response holds one of the caller's permits (a lease of the response's
    /// [`ttl`](Self::ttl), on the lock store, `<prefix>:quota:{<scope>}`).
    pub fn max_records_per_scope(mut self, records: u32) -> Self {
        self.config.max_records_per_scope = records;
        self
    }

    /// How many stored responses the layer may have at once, all callers together: a
    /// request with a new key once there are this many is refused with `503 Service
    /// Unavailable` and a `Retry-After` of when the oldest expires, without running the
    /// handler. Default: [`DEFAULT_MAX_RECORDS`]. With
    /// [`max_stored_body`](Self::max_stored_body) it bounds what the layer keeps in the
    /// store: at most `max_records × max_stored_body` (1.6 GB with the defaults, a few
    /// dozen MB for responses of a few hundred bytes), and never more than `new keys per
    /// second × ttl` responses. Size it to that for your traffic.
    ///
    /// Kept in parts on the store (`<prefix>:quota-total:{records-<i>}`, one per 4,096
    /// records, at most 16), each new key in a part chosen at random or, if that one is
    /// full, a second: new keys do not queue on one name. The first `503` can come when
    /// both parts a key tries are full, a little before the cap (about 98% of it with
    /// the default).
    pub fn max_records(mut self, records: u32) -> Self {
        self.config.max_records = records;
        self
    }

    /// Whether a covered request without the key header is refused (`400`) rather than
    /// passed through unprotected. Default: `false`. A key that is present but unusable
    /// (empty, too long, sent twice, not a valid string) is refused with `400` either
    /// way: the client meant the request to be idempotent, and running it unprotected
    /// could run it twice.
    pub fn required(mut self, required: bool) -> Self {
        self.config.required = required;
        self
    }

    /// The methods the layer covers; others pass through. Default: `POST` and `PATCH`
    /// (`GET`, `HEAD`, `OPTIONS`, `PUT` and `DELETE` are idempotent by definition).
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// A retry arriving while the first request with its key is in flight waits up to
    /// `wait` for it to finish, and then gets its response replayed (or runs, when the
    /// first stored nothing). Default: zero, answering `409 Conflict` at once, as the
    /// draft does. The same setting as [`LockLayerBuilder::max_wait`](crate::layer::LockLayerBuilder::max_wait),
    /// with another default: a retry is rarely worth holding a connection for.
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.config.wait = wait;
        self
    }

    /// The lease of the layer's locks. Default: renewed while the handler runs, with
    /// [`DEFAULT_REQUEST_LEASE`](crate::layer::DEFAULT_REQUEST_LEASE), as
    /// [`LockLayer`](crate::LockLayer)'s.
    pub fn lease(mut self, lease: impl Into<Lease>) -> Self {
        self.config.lease = lease.into();
        self.lease_set = true;
        self
    }

    /// `Retry-After` for a request whose first is still in flight. Default:
    /// [`DEFAULT_IN_FLIGHT_RETRY_AFTER`].
    pub fn in_flight_retry_after(mut self, after: Duration) -> Self {
        self.config.in_flight_retry_after = after;
        self
    }

    /// `Retry-After` when the store cannot answer or a lock was lost. Default:
    /// [`DEFAULT_UNAVAILABLE_RETRY_AFTER`](crate::layer::DEFAULT_UNAVAILABLE_RETRY_AFTER).
    pub fn unavailable_retry_after(mut self, after: Duration) -> Self {
        self.config.unavailable_retry_after = after;
        self
    }

    /// The header (value `true`) a replayed response carries. Default:
    /// [`IDEMPOTENT_REPLAYED`].
    pub fn replay_header(mut self, header: HeaderName) -> Self {
        self.config.replay_header = header;
        self
    }

    /// The response headers stored and replayed; others are dropped from a replay.
    /// Default: [`DEFAULT_STORED_HEADERS`].
    pub fn stored_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.stored_headers = headers.into_iter().collect();
        self
    }

    /// Which responses are final, and stored. Default: [`below_500`] (a 5xx stores
    /// nothing, and the retry runs again; its docs say why). [`stripe`] stores every
    /// status, 5xx included. Whatever it says, the statuses in [`NEVER_STORED`] and the
    /// answers a [`LockLayer`](crate::LockLayer) marks
    /// [`Transient`](crate::layer::Transient) are never stored.
    pub fn store_if(mut self, store: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.config.store_if = Arc::new(store);
        self
    }

    /// Runs `hook` on every replayed response before it is sent, with when it was
    /// stored and when it expires: to add a header (how long the key is kept, say), as
    /// AWS Powertools' response hook does. The replay header is already set.
    ///
    /// ```
    /// use http::HeaderValue;
    /// use tower_lock::idempotency::IdempotencyLayer;
    /// # use tower_lock::{LockClient, MemoryBackend};
    /// # let client = LockClient::new(MemoryBackend::new());
    /// # let scope = tower_lock::layer::HeaderKey::new(http::HeaderName::from_static("x-user"));
    /// let layer = IdempotencyLayer::builder(client, scope)
    ///     .on_replay(|head, replay| {
    ///         let left = replay.expires_at.duration_since(std::time::SystemTime::now());
    ///         let secs = left.map_or(0, |left| left.as_secs());
    ///         head.headers.insert("idempotency-expires-in", HeaderValue::from(secs));
    ///     })
    ///     .build()?;
    /// # Ok::<(), tower_lock::ConfigError>(())
    /// ```
    pub fn on_replay(
        mut self,
        hook: impl Fn(&mut http::response::Parts, &Replay) + Send + Sync + 'static,
    ) -> Self {
        self.config.on_replay = Some(Arc::new(hook));
        self
    }

    /// Where the `type` links of the default `application/problem+json` rejections
    /// point: each is this followed by `#` and the problem's name (`#in-flight`,
    /// `#mismatch`, ...). Default: [`DEFAULT_PROBLEM_TYPE_BASE`](super::DEFAULT_PROBLEM_TYPE_BASE), this crate's page on
    /// idempotency. Point it at your API's own docs; the anchors must exist there.
    /// A handler set with [`on_rejection`](Self::on_rejection) answers instead, in
    /// whichever order the two are called.
    pub fn problem_type_base(mut self, base: impl Into<String>) -> Self {
        let base = base.into();
        match ProblemJson::with_type_base(base) {
            Ok(problems) => self.config.problems = problems,
            Err(error) => self.error = self.error.or(Some(error)),
        }
        self
    }

    /// What tells a retry from another request reusing its key. Default:
    /// [`Fingerprint::of`] (method, path, query and body).
    pub fn fingerprint(
        mut self,
        fingerprint: impl Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync + 'static,
    ) -> Self {
        self.config.fingerprint = Arc::new(fingerprint);
        self
    }

    /// Answers rejections with `handler` instead of `application/problem+json`.
    pub fn on_rejection(mut self, handler: impl OnIdempotencyRejection) -> Self {
        self.config.on_rejection = Some(Arc::new(handler));
        self
    }

    /// Checks the configuration and builds the layer.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Unsupported`] when the client's store keeps no responses (a store
    /// without a [`ReplayStore`](crate::backend::ReplayStore): RedLock, a custom
    /// backend); [`ConfigError::InvalidSetting`] naming the first bad setting:
    /// `key_prefix` empty or breaking the namespace rule, `ttl` outside 1 ms..=
    /// [`MAX_TTL`], `max_key_len` outside 1..=512, `max_body` zero, `methods` empty,
    /// `max_wait` over [`MAX_WAIT`], a retry-after zero or over an hour, `name`
    /// empty, too long or with control characters, `lease` out of range.
    pub fn build(mut self) -> Result<IdempotencyLayer<K>, ConfigError> {
        if let Some(error) = self.error {
            return Err(error);
        }
        if !self.lease_set {
            self.config.lease = crate::layer::config::request_lease(&self.client);
        }
        self.config.quotas = Some(Quotas::under(&self.config.prefix, self.config.max_records)?);
        if self.client.backend().replays().is_none() {
            return Err(ConfigError::Unsupported {
                backend: self.client.backend().profile().name(),
                what: "records of responses for replay (an IdempotencyLayer)".to_owned(),
            });
        }
        self.config.validate()?;
        Ok(IdempotencyLayer::assemble(
            self.client,
            self.config,
            self.scope,
        ))
    }
}

impl<K> fmt::Debug for IdempotencyLayerBuilder<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayerBuilder")
            .field("client", &self.client)
            .finish_non_exhaustive()
    }
}
