//! The seckill store in MySQL or MariaDB: vouchers, stock and orders in InnoDB tables
//! (created at start), and a per-user fence that makes the database itself refuse a
//! stale lock holder's write. The same tables and rules as `pg_store.rs`, in MySQL's
//! SQL.
//!
//! Tables (prefix `seckill_`): `seckill_vouchers (id, stock)`, `seckill_orders (id,
//! voucher_id, user_id, fencing_token)`, `seckill_fences (voucher_id, user_id,
//! last_token)`.
//!
//! # Fencing, enforced by the database
//!
//! A request that holds the user's lock starts by raising the user's fence to its
//! fencing token (`UPDATE ... SET last_token = ? WHERE ... AND last_token < ?`); a token
//! not above the fence is refused. Its write then runs in one transaction that locks
//! the fence row (`SELECT ... FOR UPDATE`) and goes ahead only while the fence still
//! holds its token: stock and order together, or neither. So a holder that paused past
//! its lease, while a newer holder took the lock and started, is refused when it wakes
//! — before it reads, or at its write — however late it acts.

#![allow(dead_code)] // each includer uses a different part

use sqlx::MySqlPool;

use crate::app::{BoxFut, Order, Placed, Store, StoreError, VoucherView};

fn store_error(e: sqlx::Error) -> StoreError {
    StoreError(format!("mysql: {e}"))
}

/// One statement each: a `CREATE TABLE IF NOT EXISTS` is atomic in InnoDB, so several
/// processes starting at once need no lock around them (PostgreSQL's can collide, and
/// `pg_store.rs` takes an advisory lock). The index is part of its table for the same
/// reason: MySQL has no `CREATE INDEX IF NOT EXISTS`.
const SCHEMA: [&str; 3] = [
    "CREATE TABLE IF NOT EXISTS seckill_vouchers (
        id    BIGINT NOT NULL PRIMARY KEY,
        stock BIGINT NOT NULL
    ) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS seckill_orders (
        id            BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
        voucher_id    BIGINT NOT NULL,
        user_id       BIGINT NOT NULL,
        fencing_token BIGINT NOT NULL,
        KEY seckill_orders_buyer (voucher_id, user_id)
    ) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS seckill_fences (
        voucher_id BIGINT NOT NULL,
        user_id    BIGINT NOT NULL,
        last_token BIGINT NOT NULL,
        PRIMARY KEY (voucher_id, user_id)
    ) ENGINE=InnoDB",
];

/// Takes one unit of stock if any is left.
const TAKE_STOCK: &str = "UPDATE seckill_vouchers SET stock = stock - 1 WHERE id = ? AND stock > 0";

const INSERT_ORDER: &str =
    "INSERT INTO seckill_orders (voucher_id, user_id, fencing_token) VALUES (?, ?, ?)";

/// The store on one MySQL or MariaDB database. Cheap to clone (a pool inside).
#[derive(Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
}

impl MySqlStore {
    /// The store on `pool`, with its tables created if missing.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached or refuses the schema.
    pub async fn open(pool: MySqlPool) -> Result<Self, StoreError> {
        for statement in SCHEMA {
            sqlx::query(statement)
                .execute(&pool)
                .await
                .map_err(store_error)?;
        }
        Ok(MySqlStore { pool })
    }

    /// Creates `voucher` with `stock` units unless it exists; returns whether it did.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached.
    pub async fn seed(&self, voucher: u64, stock: i64) -> Result<bool, StoreError> {
        // `INSERT IGNORE`, not `ON DUPLICATE KEY UPDATE id = id`: with the found-rows
        // flag sqlx sets, the latter counts an existing row as 1, as an insert.
        let inserted = sqlx::query("INSERT IGNORE INTO seckill_vouchers (id, stock) VALUES (?, ?)")
            .bind(id(voucher))
            .bind(stock)
            .execute(&self.pool)
            .await
            .map_err(store_error)?
            .rows_affected();
        Ok(inserted == 1)
    }

    /// Starts the sale of `voucher` afresh: `stock` units, no orders. Fences stay:
    /// fencing tokens never go backwards.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached.
    pub async fn reset(&self, voucher: u64, stock: i64) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(store_error)?;
        sqlx::query("DELETE FROM seckill_orders WHERE voucher_id = ?")
            .bind(id(voucher))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        sqlx::query(
            "INSERT INTO seckill_vouchers (id, stock) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE stock = VALUES(stock)",
        )
        .bind(id(voucher))
        .bind(stock)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        tx.commit().await.map_err(store_error)
    }

    async fn place(&self, voucher: u64, user: u64, token: u64) -> Result<Placed, sqlx::Error> {
        // Dropped without a commit (a refusal, an error), the transaction rolls back.
        let mut tx = self.pool.begin().await?;
        if token > 0 {
            // The fence row, locked (a record lock: the primary key, by equality): a
            // newer holder cannot raise it until this commits.
            let fence: Option<i64> = sqlx::query_scalar(
                "SELECT last_token FROM seckill_fences \
                  WHERE voucher_id = ? AND user_id = ? FOR UPDATE",
            )
            .bind(id(voucher))
            .bind(id(user))
            .fetch_optional(&mut *tx)
            .await?;
            if fence != Some(id(token)) {
                return Ok(Placed::Stale);
            }
        }
        let taken = sqlx::query(TAKE_STOCK)
            .bind(id(voucher))
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if taken == 0 {
            return Ok(Placed::SoldOut);
        }
        let order_id = sqlx::query(INSERT_ORDER)
            .bind(id(voucher))
            .bind(id(user))
            .bind(id(token))
            .execute(&mut *tx)
            .await?
            .last_insert_id();
        tx.commit().await?;
        Ok(Placed::Created(Order {
            order_id,
            voucher_id: voucher,
            user_id: user,
            fencing_token: token,
        }))
    }
}

/// Ids and tokens as `BIGINT`.
fn id(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Store for MySqlStore {
    fn voucher(&self, voucher: u64) -> BoxFut<'_, Result<Option<VoucherView>, StoreError>> {
        Box::pin(async move {
            let row: Option<(i64, i64)> = sqlx::query_as(
                "SELECT v.stock, CAST((SELECT COUNT(*) FROM seckill_orders o \
                                        WHERE o.voucher_id = v.id) AS SIGNED) \
                   FROM seckill_vouchers v WHERE v.id = ?",
            )
            .bind(id(voucher))
            .fetch_optional(&self.pool)
            .await
            .map_err(store_error)?;
            Ok(row.map(|(stock, orders)| VoucherView {
                id: voucher,
                stock,
                orders: orders.unsigned_abs(),
            }))
        })
    }

    fn has_order(&self, voucher: u64, user: u64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let found: i64 = sqlx::query_scalar(
                "SELECT CAST(EXISTS (SELECT 1 FROM seckill_orders \
                                      WHERE voucher_id = ? AND user_id = ?) AS SIGNED)",
            )
            .bind(id(voucher))
            .bind(id(user))
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
            Ok(found != 0)
        })
    }

    fn take_stock(&self, voucher: u64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let taken = sqlx::query(TAKE_STOCK)
                .bind(id(voucher))
                .execute(&self.pool)
                .await
                .map_err(store_error)?
                .rows_affected();
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
            let order_id = sqlx::query(INSERT_ORDER)
                .bind(id(voucher))
                .bind(id(user))
                .bind(id(fencing_token))
                .execute(&self.pool)
                .await
                .map_err(store_error)?
                .last_insert_id();
            Ok(Order {
                order_id,
                voucher_id: voucher,
                user_id: user,
                fencing_token,
            })
        })
    }

    fn orders(&self, voucher: u64) -> BoxFut<'_, Result<Vec<Order>, StoreError>> {
        Box::pin(async move {
            let rows: Vec<(i64, i64, i64)> = sqlx::query_as(
                "SELECT id, user_id, fencing_token FROM seckill_orders \
                  WHERE voucher_id = ? ORDER BY id",
            )
            .bind(id(voucher))
            .fetch_all(&self.pool)
            .await
            .map_err(store_error)?;
            Ok(rows
                .into_iter()
                .map(|(order_id, user, token)| Order {
                    order_id: order_id.unsigned_abs(),
                    voucher_id: voucher,
                    user_id: user.unsigned_abs(),
                    fencing_token: token.unsigned_abs(),
                })
                .collect())
        })
    }

    fn fence(
        &self,
        voucher: u64,
        user: u64,
        fencing_token: u64,
    ) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            if fencing_token == 0 {
                return Ok(true); // no lock (--no-lock): nothing to fence
            }
            // Two statements where PostgreSQL has one upsert with a `WHERE`: MySQL's
            // `ON DUPLICATE KEY UPDATE` takes no condition, and the count it answers
            // cannot tell "raised" from "left as it was" under the found-rows flag.
            // Each statement is atomic and a fence only ever rises, so nothing can come
            // between them that would make either answer wrong.
            let created = sqlx::query(
                "INSERT IGNORE INTO seckill_fences (voucher_id, user_id, last_token) \
                 VALUES (?, ?, ?)",
            )
            .bind(id(voucher))
            .bind(id(user))
            .bind(id(fencing_token))
            .execute(&self.pool)
            .await
            .map_err(store_error)?
            .rows_affected();
            if created == 1 {
                return Ok(true);
            }
            let raised = sqlx::query(
                "UPDATE seckill_fences SET last_token = ? \
                  WHERE voucher_id = ? AND user_id = ? AND last_token < ?",
            )
            .bind(id(fencing_token))
            .bind(id(voucher))
            .bind(id(user))
            .bind(id(fencing_token))
            .execute(&self.pool)
            .await
            .map_err(store_error)?
            .rows_affected();
            Ok(raised == 1)
        })
    }

    fn place_order(
        &self,
        voucher: u64,
        user: u64,
        fencing_token: u64,
    ) -> BoxFut<'_, Result<Placed, StoreError>> {
        Box::pin(async move {
            self.place(voucher, user, fencing_token)
                .await
                .map_err(store_error)
        })
    }
}
