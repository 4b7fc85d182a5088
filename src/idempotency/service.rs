//! [`IdempotencyService`]: the middleware made by
//! [`IdempotencyLayer`](super::IdempotencyLayer), and the steps of one request.

use std::collections::VecDeque;
use std::fmt;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use futures_util::future::BoxFuture;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Limited};
use tower::Service;
use tracing::Instrument;

use super::body::IdempotencyBody;
use super::key::{self, BadKey};
use super::layer::{Config, NEVER_STORED, Replay, Shared};
use super::record::{Fingerprint, Record};
use super::rejection::IdempotencyRejection;
use crate::StoreErrorKind;
use crate::backend::ReplayStore;
use crate::error::{BoxError, Error};
use crate::extract::{HeldLock, Locks};
use crate::key::LockKey;
use crate::layer::{KeyExtractor, Transient};
use crate::lock::{LayerOutcome, LockGuard, NotStoredReason};
use crate::owner::Owner;

/// Runs a retried request once and replays its response. Made by
/// [`IdempotencyLayer`](super::IdempotencyLayer); see the
/// [module docs](crate::idempotency).
pub struct IdempotencyService<S, K> {
    inner: S,
    shared: Arc<Shared<K>>,
}

impl<S, K> IdempotencyService<S, K> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<K>>) -> Self {
        IdempotencyService { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, K> Clone for IdempotencyService<S, K> {
    fn clone(&self) -> Self {
        IdempotencyService {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for IdempotencyService<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("layer", &self.shared.config.name())
            .finish_non_exhaustive()
    }
}

impl<S, K, ReqB, ResB> Service<Request<ReqB>> for IdempotencyService<S, K>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    K: KeyExtractor,
    ReqB: Body + From<Bytes> + Send + 'static,
    ReqB::Data: Send,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<IdempotencyBody<ResB>>;
    type Error = S::Error;
    /// Boxed: one request is a chain of store calls, a body to read and a handler to
    /// race against its lock's loss; one allocation is nothing next to those.
    type Future = BoxFuture<'static, Result<Self::Response, S::Error>>;

    /// Always ready, as [`LockService`](crate::layer::LockService): the inner service's
    /// readiness is awaited only once the request holds its lock (or passes through).
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let svc = self.inner.clone();
        let shared = Arc::clone(&self.shared);
        let span = tracing::debug_span!(
            "tower_lock.idempotency",
            layer = shared.config.name(),
            idempotency = tracing::field::Empty,
            not_stored = tracing::field::Empty,
        );
        Box::pin(handle(shared, svc, req).instrument(span))
    }
}

type Answer<ResB, E> = Result<Response<IdempotencyBody<ResB>>, E>;

/// One request: the key, the body, the lock, then a replay or the handler's run.
async fn handle<S, K, ReqB, ResB>(
    shared: Arc<Shared<K>>,
    svc: S,
    req: Request<ReqB>,
) -> Answer<ResB, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    K: KeyExtractor,
    ReqB: Body + From<Bytes>,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    let config = &shared.config;
    if !config.covers(req.method()) {
        return pass(svc, req).await;
    }
    let idem = match key::parse(req.headers(), &config.header, config.max_key_len) {
        Ok(idem) => idem.into_owned(),
        // A present key the layer cannot use is refused whatever `required` says: the
        // client meant the request to run once, and running it unprotected could run
        // it twice.
        Err(BadKey::Missing) if !config.required => return pass(svc, req).await,
        Err(bad) => {
            let detail = bad.detail(&config.header, config.max_key_len);
            return Ok(rejected(
                &shared,
                IdempotencyRejection::BadKey { detail },
                None,
            ));
        }
    };
    let (parts, body) = req.into_parts();
    let (parts, scope) = shared.scope.extract(parts).await;
    let scope = match scope {
        Ok(scope) if scope.is_empty() => return pass(svc, Request::from_parts(parts, body)).await,
        Ok(scope) => scope,
        Err(e) => return Ok(rejected(&shared, IdempotencyRejection::Scope(e), None)),
    };
    let key = match key::lock_key(&config.prefix, scope.as_slice(), &parts, &idem) {
        Ok(key) => key,
        Err(e) => {
            let detail = format!("the `{}` header makes no valid key: {e}", config.header);
            return Ok(rejected(
                &shared,
                IdempotencyRejection::BadKey { detail },
                None,
            ));
        }
    };
    let body = match Limited::new(body, config.max_body).collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            let limit = config.max_body;
            return Ok(rejected(
                &shared,
                IdempotencyRejection::BodyTooLarge { limit },
                Some(&key),
            ));
        }
        Err(_) => return Ok(rejected(&shared, IdempotencyRejection::BadBody, Some(&key))),
    };
    let fingerprint = (config.fingerprint)(&parts, &body);
    let request = Covered {
        shared: &shared,
        key,
        fingerprint,
        scope: scope.into_vec(),
    };
    request.run(svc, parts, body).await
}

/// A request the layer covers, with its key, fingerprint and caller.
struct Covered<'a, K> {
    shared: &'a Shared<K>,
    key: LockKey,
    fingerprint: Fingerprint,
    scope: Vec<LockKey>,
}

/// A new key's places in the quotas of stored responses: the caller's and everyone's.
/// Kept for the response's lifetime once it is stored; given back when nothing is.
struct Places {
    caller: LockGuard,
    total: LockGuard,
}

impl Places {
    /// The response was stored: each place is held until the response expires.
    fn keep(self) {
        self.caller.keep_until_lease_end();
        self.total.keep_until_lease_end();
    }

    /// Nothing was stored: the places are free for another key.
    async fn free(self) {
        let _ = self.caller.unlock().await;
        let _ = self.total.unlock().await;
    }
}

impl<K> Covered<'_, K> {
    /// The store's records; `build` refused a client whose store keeps none.
    fn replays(&self) -> Result<&dyn ReplayStore, IdempotencyRejection> {
        self.shared.client.backend().replays().ok_or_else(|| {
            IdempotencyRejection::Misconfigured(Error::store(
                StoreErrorKind::Misconfigured,
                "the store keeps no responses for replay",
            ))
        })
    }

    /// Replays what a finished request stored; else takes the key's lock and, unless a
    /// request stored its response meanwhile, runs the handler and stores its response.
    async fn run<S, ReqB, ResB>(
        self,
        svc: S,
        mut parts: Parts,
        body: Bytes,
    ) -> Answer<ResB, S::Error>
    where
        S: Service<Request<ReqB>, Response = Response<ResB>>,
        ReqB: From<Bytes>,
        ResB: Body<Data = Bytes>,
        ResB::Error: Into<BoxError>,
    {
        let config = &self.shared.config;
        // A stored response is final: it answers at once, without the lock (one read;
        // taking the lock would cost a write, on PostgreSQL a synchronous commit).
        match self.load().await {
            Ok(None) => {}
            Ok(Some(record)) => return Ok(self.replay(record)),
            Err(rejection) => return Ok(self.reject(rejection)),
        }
        // The handler's `Locks` act as this client, and as an outer layer's owner if
        // there is one.
        let (owner, _) = Locks::attach(&mut parts.extensions, &self.shared.client);
        let lock = match self.shared.client.get_fenced_lock(self.key.clone()) {
            Ok(lock) => lock.with_owner(owner.clone()),
            Err(e) => return Ok(self.reject(IdempotencyRejection::Misconfigured(e.into()))),
        };
        let guard = match lock.try_lock_for(config.wait, config.lease).await {
            Ok(guard) => guard,
            // The lock is held by the first request, still running, unless it stored
            // its response since the read above: then the record answers.
            Err(e) if e.is_busy() => {
                return Ok(match self.load().await {
                    Ok(Some(record)) => self.replay(record),
                    Ok(None) => self.reject(IdempotencyRejection::InFlight {
                        retry_after: config.in_flight_retry_after,
                    }),
                    Err(rejection) => self.reject(rejection),
                });
            }
            Err(e) => return Ok(self.reject(self.failure(e))),
        };
        // Under the lock: a request that finished before it was taken left its record.
        match self.load().await {
            Ok(None) => {}
            Ok(Some(record)) => {
                // Released before answering: whoever the client sends next finds it free.
                let _ = guard.unlock().await;
                return Ok(self.replay(record));
            }
            Err(rejection) => {
                let _ = guard.unlock().await;
                return Ok(self.reject(rejection));
            }
        }
        // A new key: a place for its response in the caller's quota and everyone's,
        // before the handler runs.
        let places = match self.places().await {
            Ok(places) => places,
            Err(rejection) => {
                let _ = guard.unlock().await;
                return Ok(self.reject(rejection));
            }
        };
        let mut req = Request::from_parts(parts, ReqB::from(body));
        // An outer `LockLayer`'s lock is the one the handler fences its writes with:
        // it keeps its `HeldLock`; else the handler gets this one's.
        Locks::record_held(req.extensions_mut(), HeldLock::of_guard(&guard), true);
        match call_while_held(svc, req, owner, &guard).await {
            Handled::Response(Ok(response)) => Ok(self.store(response, guard, places).await),
            Handled::Response(Err(error)) => {
                let _ = guard.unlock().await;
                places.free().await;
                Err(error)
            }
            Handled::Lost => {
                let _ = guard.unlock().await;
                places.free().await;
                let retry_after = config.unavailable_retry_after;
                Ok(self.reject(IdempotencyRejection::Lost { retry_after }))
            }
        }
    }

    /// A place in the caller's quota of stored responses and one in everyone's: a
    /// permit of each, leased for the response's TTL, under an owner of its own (each
    /// response its own permit). `429` when the caller's are taken, `503` when
    /// everyone's are, each with `Retry-After` of when the oldest expires.
    async fn places(&self) -> Result<Places, IdempotencyRejection> {
        let config = &self.shared.config;
        let client = &self.shared.client;
        let Some(quotas) = &config.quotas else {
            return Err(IdempotencyRejection::Misconfigured(Error::invalid_config(
                "quotas",
                "are set when the layer is built",
            )));
        };
        let mut scope = String::new();
        for key in &self.scope {
            scope.push_str(key.as_str());
            scope.push('\n');
        }
        let lease = crate::Lease::Fixed(config.ttl);
        let take = async |key: LockKey, max: u32| {
            let permit = client.get_permits(key, max)?.with_owner(client.new_owner());
            permit.try_lock_for(std::time::Duration::ZERO, lease).await
        };
        let over = |error: Error, full: fn(std::time::Duration) -> IdempotencyRejection| match error
        {
            Error::Busy { holder_ttl } => full(holder_ttl.unwrap_or(config.ttl)),
            error => self.failure(error),
        };
        let caller_key = LockKey::in_namespace(&quotas.scope, &scope)
            .map_err(|e| IdempotencyRejection::Misconfigured(e.into()))?;
        let caller = take(caller_key, config.max_records_per_scope)
            .await
            .map_err(|e| {
                over(e, |retry_after| IdempotencyRejection::TooManyRecords {
                    retry_after,
                })
            })?;
        // A part of everyone's quota at random, and another if that one is full: no
        // caller can aim at one part, and the parts fill evenly.
        let parts = quotas.total.len();
        let first = fastrand::usize(..parts);
        let mut tries = vec![first];
        if parts > 1 {
            tries.push((first + 1 + fastrand::usize(..parts - 1)) % parts);
        }
        let mut full = None;
        for part in tries {
            let (key, share) = &quotas.total[part];
            match take(key.clone(), *share).await {
                Ok(total) => return Ok(Places { caller, total }),
                Err(error) if error.is_busy() => full = Some(error),
                Err(error) => {
                    let _ = caller.unlock().await;
                    return Err(self.failure(error));
                }
            }
        }
        let _ = caller.unlock().await;
        let error = full.unwrap_or(Error::Busy { holder_ttl: None });
        Err(over(error, |retry_after| {
            IdempotencyRejection::RecordsFull { retry_after }
        }))
    }

    /// The record kept for the key, if any; `Err` is the rejection to answer.
    async fn load(&self) -> Result<Option<Record>, IdempotencyRejection> {
        match self.replays()?.load(&self.key).await {
            Ok(None) => Ok(None),
            Ok(Some(bytes)) => Record::decode(&bytes).map(Some).map_err(|corrupt| {
                IdempotencyRejection::Misconfigured(Error::store(
                    StoreErrorKind::Unexpected,
                    corrupt.to_string(),
                ))
            }),
            Err(e) => Err(self.failure(e)),
        }
    }

    /// The stored response, or `422` when it was made for another request.
    fn replay<ResB>(&self, record: Record) -> Response<IdempotencyBody<ResB>> {
        if record.fingerprint != self.fingerprint {
            return self.reject(IdempotencyRejection::Mismatch);
        }
        let mut response = Response::new(IdempotencyBody::whole(record.body.clone()));
        *response.status_mut() = record.status;
        let headers = response.headers_mut();
        for (name, value) in record.headers.iter().cloned() {
            headers.append(name, value);
        }
        headers.insert(
            self.shared.config.replay_header.clone(),
            HeaderValue::from_static("true"),
        );
        if let Some(hook) = &self.shared.config.on_replay {
            let (mut head, body) = response.into_parts();
            let replay = Replay {
                stored_at: record.stored_at,
                expires_at: record.stored_at + self.shared.config.ttl,
            };
            hook(&mut head, &replay);
            response = Response::from_parts(head, body);
        }
        self.shared.outcome(Some(&self.key), LayerOutcome::Replayed);
        response
    }

    /// Stores a final response whose body fits, read whole first (of a known length or
    /// streamed), releasing the lock in the same step. Anything else passes through
    /// unstored, the lock released first: a status that is not stored, or a body too
    /// large, too slow or with trailers, passed on with what was read of it.
    async fn store<ResB>(
        &self,
        response: Response<ResB>,
        guard: LockGuard,
        places: Places,
    ) -> Response<IdempotencyBody<ResB>>
    where
        ResB: Body<Data = Bytes>,
        ResB::Error: Into<BoxError>,
    {
        let config = &self.shared.config;
        let (head, body) = response.into_parts();
        let transient =
            head.extensions.get::<Transient>().is_some() || NEVER_STORED.contains(&head.status);
        let unstored = if transient {
            Some(NotStoredReason::Transient)
        } else if !(config.store_if)(head.status) {
            Some(NotStoredReason::Declined)
        } else if body.size_hint().lower() > config.max_stored_body as u64 {
            Some(NotStoredReason::TooLarge)
        } else {
            None
        };
        if let Some(reason) = unstored {
            let _ = guard.unlock().await;
            places.free().await;
            self.shared.not_stored(&self.key, reason);
            return Response::from_parts(head, IdempotencyBody::inner(body));
        }
        let mut body = Box::pin(body);
        let bytes = match read_to_store(body.as_mut(), config).await {
            Read::Whole(bytes) => bytes,
            Read::Failed(e) => {
                let error = Error::store(
                    StoreErrorKind::Unexpected,
                    format!("the handler's response body failed: {e}"),
                );
                let _ = guard.unlock().await;
                places.free().await;
                return self.reject(IdempotencyRejection::Misconfigured(error));
            }
            Read::Unfit(read, reason) => {
                let _ = guard.unlock().await;
                places.free().await;
                self.shared.not_stored(&self.key, reason);
                return Response::from_parts(head, IdempotencyBody::prefixed(read, body));
            }
        };
        let record = Record::new(
            self.fingerprint,
            head.status,
            &head.headers,
            &config.stored_headers,
            bytes.clone(),
        );
        match guard.unlock_storing(record.encode(), config.ttl).await {
            Ok(true) => {
                places.keep();
                self.shared.outcome(Some(&self.key), LayerOutcome::Stored);
            }
            Ok(false) => {
                places.free().await;
                self.shared
                    .not_stored(&self.key, NotStoredReason::StoreFailed);
            }
            Err(error) => {
                tracing::warn!(%error, key = %self.shared.client.display_key(&self.key), "response not stored for replay; a retry will run the handler again");
                places.free().await;
                self.shared
                    .not_stored(&self.key, NotStoredReason::StoreFailed);
            }
        }
        Response::from_parts(head, IdempotencyBody::whole(bytes))
    }

    fn failure(&self, error: Error) -> IdempotencyRejection {
        match error {
            Error::Lost => IdempotencyRejection::Lost {
                retry_after: self.shared.config.unavailable_retry_after,
            },
            error if error.is_unavailable() => IdempotencyRejection::Unavailable {
                error,
                retry_after: self.shared.config.unavailable_retry_after,
            },
            error => IdempotencyRejection::Misconfigured(error),
        }
    }

    fn reject<ResB>(&self, rejection: IdempotencyRejection) -> Response<IdempotencyBody<ResB>> {
        rejected(self.shared, rejection, Some(&self.key))
    }
}

fn rejected<K, ResB>(
    shared: &Shared<K>,
    rejection: IdempotencyRejection,
    key: Option<&LockKey>,
) -> Response<IdempotencyBody<ResB>> {
    shared
        .reject(rejection, key)
        .map(IdempotencyBody::rejection)
}

/// A request the layer does not cover: called as it is.
async fn pass<S, ReqB, ResB>(mut svc: S, req: Request<ReqB>) -> Answer<ResB, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
{
    poll_fn(|cx| svc.poll_ready(cx)).await?;
    let response = svc.call(req).await?;
    Ok(response.map(IdempotencyBody::inner))
}

/// What [`read_to_store`] made of a response's body.
enum Read {
    /// It ended, all data, within the limits: these bytes.
    Whole(Bytes),
    /// It will not be stored, for this reason; these frames were read from it.
    Unfit(VecDeque<Frame<Bytes>>, NotStoredReason),
    /// It failed, with this error (as text: it need not be `Send` across the release).
    Failed(String),
}

/// Reads a response's body to store it: to its end, unless it grows past
/// `max_stored_body`, does not end within `max_stored_body_wait` (a stream of events
/// would be held back forever) or ends with trailers.
async fn read_to_store<B>(mut body: Pin<&mut B>, config: &Config) -> Read
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let deadline = tokio::time::Instant::now() + config.max_stored_body_wait;
    let mut read = VecDeque::new();
    let mut len = 0usize;
    loop {
        let frame = tokio::time::timeout_at(deadline, poll_fn(|cx| body.as_mut().poll_frame(cx)));
        match frame.await {
            Err(_elapsed) => return Read::Unfit(read, NotStoredReason::TooSlow),
            Ok(None) => break,
            Ok(Some(Err(e))) => return Read::Failed(e.into().to_string()),
            Ok(Some(Ok(frame))) => {
                let trailers = !frame.is_data();
                len = len.saturating_add(frame.data_ref().map_or(0, Bytes::len));
                read.push_back(frame);
                if trailers {
                    return Read::Unfit(read, NotStoredReason::Trailers);
                }
                if len > config.max_stored_body {
                    return Read::Unfit(read, NotStoredReason::TooLarge);
                }
            }
        }
    }
    if read.len() == 1
        && let Some(Ok(data)) = read.pop_front().map(Frame::into_data)
    {
        return Read::Whole(data);
    }
    let mut whole = BytesMut::with_capacity(len);
    for frame in read {
        if let Ok(data) = frame.into_data() {
            whole.extend_from_slice(&data);
        }
    }
    Read::Whole(whole.freeze())
}

enum Handled<T> {
    Response(T),
    Lost,
}

/// Calls `svc` as `owner` once it is ready, unless the lock is lost first: then the
/// handler is dropped (its work stops at its next `.await`).
async fn call_while_held<S, ReqB>(
    mut svc: S,
    req: Request<ReqB>,
    owner: Owner,
    guard: &LockGuard,
) -> Handled<Result<S::Response, S::Error>>
where
    S: Service<Request<ReqB>>,
{
    let lost = guard.lost();
    let handler = owner.scope(async move {
        poll_fn(|cx| svc.poll_ready(cx)).await?;
        svc.call(req).await
    });
    tokio::select! {
        biased;
        result = handler => Handled::Response(result),
        () = lost.wait() => Handled::Lost,
    }
}
