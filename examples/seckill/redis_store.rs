//! The seckill store in Redis: vouchers and orders shared by every server process that
//! uses the same Redis.
//!
//! The store's keys live under `seckill:`; a voucher's keys share its hash tag, so they would
//! sit in one Redis Cluster slot:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `seckill:voucher:{<id>}:stock` | string | units left; the voucher exists while this key does |
//! | `seckill:voucher:{<id>}:orders` | list | the orders as JSON, oldest first |
//! | `seckill:voucher:{<id>}:buyers` | set | the ids of users with an order |
//! | `seckill:order_id` | string | the last order id handed out |
//!
//! As in the memory store each method is one step, and only `take_stock` is atomic on
//! its own (the Lua script `lua/seckill_take_stock.lua`). "Has this user ordered?"
//! followed by "insert the order" is still a check-then-act race between a user's
//! concurrent requests — now across processes — which only the per-user lock closes.
#![allow(dead_code)] // each includer uses a different part

use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{FromRedisValue, Script};

/// What asks the Sentinels where the primary is (nothing without the `sentinel`
/// feature).
#[cfg(feature = "sentinel")]
pub type Sentinels = tokio::sync::Mutex<redis::sentinel::SentinelClient>;
#[cfg(not(feature = "sentinel"))]
pub type Sentinels = std::convert::Infallible;

use crate::app::{BoxFut, Order, Store, StoreError, VoucherView};

/// The prefix of the store's keys and (given to `RedisBackendBuilder::key_prefix`) of
/// the lock keys, `seckill:lock:order:{<user id>}`. The locks' fencing counters follow
/// the backend's naming, `redisson_lock_token:seckill:lock:order:{<user id>}`, and stay
/// for the backend's token retention (an hour) after a user's last order.
pub const NAMESPACE: &str = "seckill";

static TAKE_STOCK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("../../lua/seckill_take_stock.lua")));

/// The key of one of a voucher's parts (`stock`, `orders`, `buyers`).
pub fn voucher_key(voucher: u64, part: &str) -> String {
    format!("{NAMESPACE}:voucher:{{{voucher}}}:{part}")
}

fn order_id_key() -> String {
    format!("{NAMESPACE}:order_id")
}

fn store_error(e: redis::RedisError) -> StoreError {
    StoreError(format!("redis: {e}"))
}

/// The store on one Redis server. Cheap to clone: clones share one multiplexed
/// connection that reconnects by itself, and behind Sentinel follows the primary.
#[derive(Clone)]
pub struct RedisStore {
    link: Arc<Link>,
}

/// The store's connection, and how it follows a failover.
struct Link {
    conn: RwLock<ConnectionManager>,
    /// Behind Sentinel: asks where the primary is now.
    sentinel: Option<Sentinels>,
    config: ConnectionManagerConfig,
}

/// One request of the store: a command, a transaction, or the script.
enum Request<'a> {
    Cmd(&'a redis::Cmd),
    Pipe(&'a redis::Pipeline),
    Script(&'a redis::ScriptInvocation<'a>),
}

impl Link {
    fn conn(&self) -> ConnectionManager {
        self.conn
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    async fn once<T: FromRedisValue>(&self, request: &Request<'_>) -> redis::RedisResult<T> {
        let mut conn = self.conn();
        match request {
            Request::Cmd(cmd) => cmd.query_async(&mut conn).await,
            Request::Pipe(pipe) => pipe.query_async(&mut conn).await,
            Request::Script(script) => script.invoke_async(&mut conn).await,
        }
    }

    /// Sends `request`; once more when it met a connection that broke (a restart) or a
    /// primary that moved, as the lock calls are: a read always, a write (`write`) only
    /// when it cannot have been applied (refused while connecting, or by a replica),
    /// since sending an applied write again would apply it twice.
    async fn send<T: FromRedisValue>(
        &self,
        request: Request<'_>,
        write: bool,
    ) -> Result<T, StoreError> {
        let error = match self.once(&request).await {
            Ok(value) => return Ok(value),
            Err(error) => error,
        };
        let moved = error.code() == Some("READONLY");
        let broken = error.is_connection_dropped() || error.is_io_error();
        if moved || broken {
            self.follow().await;
        }
        let not_applied = error.is_connection_refusal() || moved;
        if not_applied || (broken && !write) {
            return self.once(&request).await.map_err(store_error);
        }
        Err(store_error(error))
    }

    /// Behind Sentinel, moves to the primary they name now, if it is another server.
    async fn follow(&self) {
        let Some(sentinel) = &self.sentinel else {
            return;
        };
        #[cfg(not(feature = "sentinel"))]
        match *sentinel {}
        #[cfg(feature = "sentinel")]
        let client = match sentinel.lock().await.async_get_client().await {
            Ok(client) => client,
            Err(error) => {
                eprintln!("the Sentinels name no primary now: {error}");
                return;
            }
        };
        #[cfg(feature = "sentinel")]
        if let Ok(conn) = ConnectionManager::new_lazy_with_config(client, self.config.clone()) {
            *self
                .conn
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = conn;
        }
    }
}

/// What [`RedisStore::seed`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Seeded {
    /// The voucher was absent and now has the given stock.
    Fresh,
    /// The voucher was there already (another process seeded it) and was left alone.
    Existing(VoucherView),
}

impl RedisStore {
    /// Connects to the Redis server at `url`. Commands time out after a second and a
    /// lost connection is retried twice, so a Redis outage answers 503 quickly.
    ///
    /// # Errors
    ///
    /// When the URL is invalid or the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::with_client(redis::Client::open(url).map_err(store_error)?, None).await
    }

    /// The same, on the server of `client`; behind Sentinel (`sentinel`, which named
    /// that server), following the primary they name after a failover.
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub async fn with_client(
        client: redis::Client,
        sentinel: Option<Sentinels>,
    ) -> Result<Self, StoreError> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(2);
        let conn = ConnectionManager::new_with_config(client, config.clone())
            .await
            .map_err(store_error)?;
        Ok(RedisStore {
            link: Arc::new(Link {
                conn: RwLock::new(conn),
                sentinel,
                config,
            }),
        })
    }

    /// Creates `voucher` with `stock` units unless it exists (`SET ... NX`): the first
    /// process to start seeds the sale, later ones join it without resetting it.
    ///
    /// # Errors
    ///
    /// When Redis cannot be reached.
    pub async fn seed(&self, voucher: u64, stock: i64) -> Result<Seeded, StoreError> {
        let mut set = redis::cmd("SET");
        set.arg(voucher_key(voucher, "stock")).arg(stock).arg("NX");
        // NX: sent twice, it sets at most once.
        let set: Option<String> = self.link.send(Request::Cmd(&set), false).await?;
        if set.is_some() {
            return Ok(Seeded::Fresh);
        }
        match self.voucher(voucher).await? {
            Some(view) => Ok(Seeded::Existing(view)),
            // Someone deleted it between our two commands.
            None => Err(StoreError(format!(
                "voucher {voucher} was deleted while seeding; start again"
            ))),
        }
    }

    /// Starts the sale of `voucher` afresh: `stock` units, no orders (one transaction).
    /// Lock keys and fencing counters are not touched.
    ///
    /// # Errors
    ///
    /// When Redis cannot be reached.
    pub async fn reset(&self, voucher: u64, stock: i64) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        pipe.atomic()
            .del(voucher_key(voucher, "orders"))
            .ignore()
            .del(voucher_key(voucher, "buyers"))
            .ignore()
            .set(voucher_key(voucher, "stock"), stock)
            .ignore();
        // A reset sent twice resets twice: the same state.
        self.link.send(Request::Pipe(&pipe), false).await
    }
}

impl Store for RedisStore {
    fn voucher(&self, id: u64) -> BoxFut<'_, Result<Option<VoucherView>, StoreError>> {
        Box::pin(async move {
            let mut pipe = redis::pipe();
            pipe.atomic()
                .get(voucher_key(id, "stock"))
                .llen(voucher_key(id, "orders"));
            let (stock, orders): (Option<i64>, u64) =
                self.link.send(Request::Pipe(&pipe), false).await?;
            Ok(stock.map(|stock| VoucherView { id, stock, orders }))
        })
    }

    fn has_order(&self, voucher: u64, user: u64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("SISMEMBER");
            cmd.arg(voucher_key(voucher, "buyers")).arg(user);
            self.link.send(Request::Cmd(&cmd), false).await
        })
    }

    fn take_stock(&self, voucher: u64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let script = TAKE_STOCK.key(voucher_key(voucher, "stock"));
            let taken: i64 = self.link.send(Request::Script(&script), true).await?;
            // -1 (the voucher vanished) is "nothing to take", as in the memory store.
            Ok(taken == 1)
        })
    }

    fn insert_order(
        &self,
        voucher: u64,
        user: u64,
        fencing_token: u64,
    ) -> BoxFut<'_, Result<Order, StoreError>> {
        Box::pin(async move {
            let mut incr = redis::cmd("INCR");
            incr.arg(order_id_key());
            let order_id: u64 = self.link.send(Request::Cmd(&incr), true).await?;
            let order = Order {
                order_id,
                voucher_id: voucher,
                user_id: user,
                fencing_token,
            };
            let json = serde_json::to_string(&order)
                .map_err(|e| StoreError(format!("encoding the order: {e}")))?;
            // The order and its buyer together, or neither.
            let mut pipe = redis::pipe();
            pipe.atomic()
                .rpush(voucher_key(voucher, "orders"), json)
                .ignore()
                .sadd(voucher_key(voucher, "buyers"), user)
                .ignore();
            self.link.send::<()>(Request::Pipe(&pipe), true).await?;
            Ok(order)
        })
    }

    fn orders(&self, voucher: u64) -> BoxFut<'_, Result<Vec<Order>, StoreError>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("LRANGE");
            cmd.arg(voucher_key(voucher, "orders")).arg(0).arg(-1);
            let raw: Vec<String> = self.link.send(Request::Cmd(&cmd), false).await?;
            raw.iter()
                .map(|json| {
                    serde_json::from_str(json)
                        .map_err(|e| StoreError(format!("a stored order is not valid: {e}")))
                })
                .collect()
        })
    }
}
