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

use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, Script};

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
/// connection that reconnects by itself.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
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
        Self::with_client(redis::Client::open(url).map_err(store_error)?).await
    }

    /// The same, on the server of `client` (behind Sentinel, the primary they named).
    ///
    /// # Errors
    ///
    /// When the server cannot be reached.
    pub async fn with_client(client: redis::Client) -> Result<Self, StoreError> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(1)))
            .set_number_of_retries(2);
        let conn = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(store_error)?;
        Ok(RedisStore { conn })
    }

    /// Creates `voucher` with `stock` units unless it exists (`SET ... NX`): the first
    /// process to start seeds the sale, later ones join it without resetting it.
    ///
    /// # Errors
    ///
    /// When Redis cannot be reached.
    pub async fn seed(&self, voucher: u64, stock: i64) -> Result<Seeded, StoreError> {
        let mut conn = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(voucher_key(voucher, "stock"))
            .arg(stock)
            .arg("NX")
            .query_async(&mut conn)
            .await
            .map_err(store_error)?;
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
        let mut conn = self.conn.clone();
        redis::pipe()
            .atomic()
            .del(voucher_key(voucher, "orders"))
            .ignore()
            .del(voucher_key(voucher, "buyers"))
            .ignore()
            .set(voucher_key(voucher, "stock"), stock)
            .ignore()
            .query_async::<()>(&mut conn)
            .await
            .map_err(store_error)
    }
}

impl Store for RedisStore {
    fn voucher(&self, id: u64) -> BoxFut<'_, Result<Option<VoucherView>, StoreError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let (stock, orders): (Option<i64>, u64) = redis::pipe()
                .atomic()
                .get(voucher_key(id, "stock"))
                .llen(voucher_key(id, "orders"))
                .query_async(&mut conn)
                .await
                .map_err(store_error)?;
            Ok(stock.map(|stock| VoucherView { id, stock, orders }))
        })
    }

    fn has_order(&self, voucher: u64, user: u64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            conn.sismember(voucher_key(voucher, "buyers"), user)
                .await
                .map_err(store_error)
        })
    }

    fn take_stock(&self, voucher: u64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let taken: i64 = TAKE_STOCK
                .key(voucher_key(voucher, "stock"))
                .invoke_async(&mut conn)
                .await
                .map_err(store_error)?;
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
            let mut conn = self.conn.clone();
            let order_id: u64 = conn.incr(order_id_key(), 1).await.map_err(store_error)?;
            let order = Order {
                order_id,
                voucher_id: voucher,
                user_id: user,
                fencing_token,
            };
            let json = serde_json::to_string(&order)
                .map_err(|e| StoreError(format!("encoding the order: {e}")))?;
            // The order and its buyer together, or neither.
            redis::pipe()
                .atomic()
                .rpush(voucher_key(voucher, "orders"), json)
                .ignore()
                .sadd(voucher_key(voucher, "buyers"), user)
                .ignore()
                .query_async::<()>(&mut conn)
                .await
                .map_err(store_error)?;
            Ok(order)
        })
    }

    fn orders(&self, voucher: u64) -> BoxFut<'_, Result<Vec<Order>, StoreError>> {
        Box::pin(async move {
            let mut conn = self.conn.clone();
            let raw: Vec<String> = conn
                .lrange(voucher_key(voucher, "orders"), 0, -1)
                .await
                .map_err(store_error)?;
            raw.iter()
                .map(|json| {
                    serde_json::from_str(json)
                        .map_err(|e| StoreError(format!("a stored order is not valid: {e}")))
                })
                .collect()
        })
    }
}
