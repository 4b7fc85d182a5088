//! The seckill store in PostgreSQL: vouchers, stock and orders in tables (created at
//! start), and a per-user fence that makes the database itself refuse a stale lock
//! holder's write.
//!
//! Tables (prefix `seckill_`): `seckill_vouchers (id, stock)`, `seckill_orders (id,
//! voucher_id, user_id, fencing_token)`, `seckill_fences (voucher_id, user_id,
//! last_token)`.
//!
//! # Fencing, enforced by the database
//!
//! A request that holds the user's lock starts by raising the user's fence to its
//! fencing token (`UPDATE ... SET last_token = $t WHERE last_token < $t`); a token not
//! above the fence is refused. Its write then runs in one transaction that locks the
//! fence row and goes ahead only while the fence still holds its token: stock and order
//! together, or neither. So a holder that paused past its lease, while a newer holder
//! took the lock and started, is refused when it wakes — before it reads, or at its
//! write — however late it acts.

#![allow(dead_code)] // each includer uses a different part

use sqlx::PgPool;

use crate::app::{BoxFut, Order, Placed, Store, StoreError, VoucherView};

fn store_error(e: sqlx::Error) -> StoreError {
    StoreError(format!("postgres: {e}"))
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS seckill_vouchers (
    id    bigint PRIMARY KEY,
    stock bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS seckill_orders (
    id            bigserial PRIMARY KEY,
    voucher_id    bigint NOT NULL,
    user_id       bigint NOT NULL,
    fencing_token bigint NOT NULL
);
CREATE INDEX IF NOT EXISTS seckill_orders_buyer ON seckill_orders (voucher_id, user_id);
CREATE TABLE IF NOT EXISTS seckill_fences (
    voucher_id bigint NOT NULL,
    user_id    bigint NOT NULL,
    last_token bigint NOT NULL,
    PRIMARY KEY (voucher_id, user_id)
);
";

/// The store on one PostgreSQL database. Cheap to clone (a pool inside).
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
}

impl PgStore {
    /// The store on `pool`, with its tables created if missing.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached or refuses the schema.
    pub async fn open(pool: PgPool) -> Result<Self, StoreError> {
        let sql = format!("SELECT pg_advisory_xact_lock(hashtext('seckill schema'));{SCHEMA}");
        sqlx::raw_sql(&sql)
            .execute(&pool)
            .await
            .map_err(store_error)?;
        Ok(PgStore { pool })
    }

    /// Creates `voucher` with `stock` units unless it exists; returns whether it did.
    ///
    /// # Errors
    ///
    /// When the database cannot be reached.
    pub async fn seed(&self, voucher: u64, stock: i64) -> Result<bool, StoreError> {
        let inserted = sqlx::query(
            "INSERT INTO seckill_vouchers (id, stock) VALUES ($1, $2) ON CONFLICT (id) DO NOTHING",
        )
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
        sqlx::query("DELETE FROM seckill_orders WHERE voucher_id = $1")
            .bind(id(voucher))
            .execute(&mut *tx)
            .await
            .map_err(store_error)?;
        sqlx::query(
            "INSERT INTO seckill_vouchers (id, stock) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET stock = excluded.stock",
        )
        .bind(id(voucher))
        .bind(stock)
        .execute(&mut *tx)
        .await
        .map_err(store_error)?;
        tx.commit().await.map_err(store_error)
    }

    async fn place(&self, voucher: u64, user: u64, token: u64) -> Result<Placed, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        if token > 0 {
            // The fence row, locked: a newer holder cannot start until this commits.
            let fence: Option<i64> = sqlx::query_scalar(
                "SELECT last_token FROM seckill_fences \
                  WHERE voucher_id = $1 AND user_id = $2 FOR UPDATE",
            )
            .bind(id(voucher))
            .bind(id(user))
            .fetch_optional(&mut *tx)
            .await?;
            if fence != Some(id(token)) {
                return Ok(Placed::Stale);
            }
        }
        let taken = sqlx::query(
            "UPDATE seckill_vouchers SET stock = stock - 1 WHERE id = $1 AND stock > 0",
        )
        .bind(id(voucher))
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if taken == 0 {
            return Ok(Placed::SoldOut);
        }
        let order_id: i64 = sqlx::query_scalar(
            "INSERT INTO seckill_orders (voucher_id, user_id, fencing_token) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(id(voucher))
        .bind(id(user))
        .bind(id(token))
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Placed::Created(Order {
            order_id: order_id.unsigned_abs(),
            voucher_id: voucher,
            user_id: user,
            fencing_token: token,
        }))
    }
}

/// Ids and tokens as PostgreSQL's `bigint`.
fn id(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Store for PgStore {
    fn voucher(&self, voucher: u64) -> BoxFut<'_, Result<Option<VoucherView>, StoreError>> {
        Box::pin(async move {
            let row: Option<(i64, i64)> = sqlx::query_as(
                "SELECT v.stock, (SELECT count(*) FROM seckill_orders o WHERE o.voucher_id = v.id) \
                   FROM seckill_vouchers v WHERE v.id = $1",
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
            sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM seckill_orders WHERE voucher_id = $1 AND user_id = $2)",
            )
            .bind(id(voucher))
            .bind(id(user))
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)
        })
    }

    fn take_stock(&self, voucher: u64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let taken = sqlx::query(
                "UPDATE seckill_vouchers SET stock = stock - 1 WHERE id = $1 AND stock > 0",
            )
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
            let order_id: i64 = sqlx::query_scalar(
                "INSERT INTO seckill_orders (voucher_id, user_id, fencing_token) VALUES ($1, $2, $3) RETURNING id",
            )
            .bind(id(voucher))
            .bind(id(user))
            .bind(id(fencing_token))
            .fetch_one(&self.pool)
            .await
            .map_err(store_error)?;
            Ok(Order {
                order_id: order_id.unsigned_abs(),
                voucher_id: voucher,
                user_id: user,
                fencing_token,
            })
        })
    }

    fn orders(&self, voucher: u64) -> BoxFut<'_, Result<Vec<Order>, StoreError>> {
        Box::pin(async move {
            let rows: Vec<(i64, i64, i64)> = sqlx::query_as(
                "SELECT id, user_id, fencing_token FROM seckill_orders WHERE voucher_id = $1 ORDER BY id",
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
            let raised = sqlx::query(
                "INSERT INTO seckill_fences (voucher_id, user_id, last_token) VALUES ($1, $2, $3) \
                 ON CONFLICT (voucher_id, user_id) DO UPDATE SET last_token = excluded.last_token \
                  WHERE seckill_fences.last_token < excluded.last_token",
            )
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
